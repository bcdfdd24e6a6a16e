"""GRPO with actor.lora on a TP=2 Megatron actor and one vLLM-CPU replica of TP 2 (hybrid; the per-device sync
sends each rank's own TP slices to the engine worker on its slot): the export merges scale·B·A into the base
weights, so the engine serves the trainer's LoRA model. After two steps (adapters trained, synced after each) the
log-probs of a sequence the replica samples equal the trainer's within 1e-4; the KL term reads the reference from
the same model with the adapters off (no reference engine), and it is non-zero once the adapters have moved.
"""

from __future__ import annotations

import pytest
from trainer_fixtures import lora_vllm_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def lora_run(ray_cluster, tmp_path_factory):
    yield from lora_vllm_run(tmp_path_factory.mktemp("lora_vllm"), ["actor.use_kl_loss=true"])


def test_engine_serves_the_trainers_lora_model_after_each_sync(lora_run):
    assert lora_run["version"] == 2
    assert lora_run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, lora_run["gap"]
    second = lora_run["metrics"][1]
    assert second["rollout/logprob_abs_diff_max"] <= 1e-4  # step 2's samples came from the step-1 adapters
    assert second["weight_sync/bytes_sliced"] > 0  # the TP-slice path carried the merged slices


def test_paired_tp_ranks_send_only_their_slices(lora_run):
    """Trainer rank r feeds the engine worker on its slot: its own TP slice of the dense TP-split tensors (q/k/v/o,
    gate/up/down; embeddings and norms whole), so each device moves about half of those bytes."""
    from bridges.hf_io import HFCheckpoint

    per_rank, sid = lora_run["per_rank"], lora_run["server_id"]
    assert [r["receivers"] for r in per_rank] == [[f"{sid}/0"], [f"{sid}/1"]]
    sliced, whole = per_rank[0]["bytes_sliced"], per_rank[0]["bytes_whole"]
    assert per_rank[1]["bytes_sliced"] == sliced > 0 and per_rank[1]["bytes_whole"] == whole
    # The merged export has the base model's names and shapes: both ranks' slices + the whole tensors = the model.
    with HFCheckpoint(str(lora_run["model"])) as checkpoint:
        whole_model = sum(checkpoint(name)[...].nbytes for name in checkpoint.names())
    assert 2 * sliced + whole == whole_model and sliced + whole < whole_model


def test_reference_is_the_base_model_with_the_adapters_off(lora_run):
    first, second = lora_run["metrics"]
    assert second["actor/kl_loss"] > 0, lora_run["metrics"]  # the adapters moved the actor away from the base
    assert first["actor/grad_norm"] > 0 and second["actor/grad_norm"] > 0
