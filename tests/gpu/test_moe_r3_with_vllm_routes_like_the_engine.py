"""On one GPU with the real vLLM (hybrid GRPO, bf16), a small random-weight Qwen3-MoE: with router replay R3
(`actor.megatron.router_replay=rollout`) the engine returns every fed token's experts (vLLM's
`enable_return_routed_experts`), they reach the sample store aligned with the tokens (int16, -1 only at each
sample's last token), and the trainer's forward routes every engine-routed (token, MoE layer) exactly as the
engine did; its own top-k agrees with the engine's far above chance (a routing shifted by one token would not).
The same run without replay gives the other side of the printed summary line: logprob_mismatch and step time.

Also the bench entry: `python -m pytest tests/gpu/test_moe_r3_with_vllm_routes_like_the_engine.py -s` prints
`R3 routing agreement … mismatch … step time ratio …` (steps after the first; shapes below, ~4 min on an H200)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the trainer-mode fixtures
from trainer_fixtures import KeepsStepTensors, stepped, tiny_trainer

from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.gpu

STEPS, B, N, RESPONSE = 3, 16, 4, 128
LAYERS, EXPERTS, TOP_K = 6, 16, 2
SHAPE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_hidden_layers=LAYERS,
             num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=256, dtype=torch.bfloat16)


class Trainer(KeepsStepTensors, PPOTrainer):
    pass


def run(root: Path, mode: str, *overrides: str) -> tuple[list[dict], list, float]:
    start = time.perf_counter()
    trainer = tiny_trainer(Trainer, "tiny/grpo", root, [
        f"data.train_batch_size={B}", f"rollout.n={N}", "actor.ppo_mini_batch_size=8",
        f"data.max_response_length={RESPONSE}", "data.max_prompt_length=64", f"trainer.total_training_steps={STEPS}",
        "actor.megatron.params_dtype=bfloat16", "rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.3",
        f"actor.megatron.router_replay={mode}", *overrides,
    ], list("abcdefgh"), prompts=B * STEPS, family="qwen3_moe", **SHAPE)
    built = time.perf_counter() - start
    print(f"[{mode}] built in {built:.1f}s", flush=True)
    with stepped(trainer, STEPS) as (done, metrics, _):
        for i, m in enumerate(metrics):
            keys = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
                    "rollout/logprob_mismatch", "actor/routing_agreement", "actor/routing_replayed")
            print(f"[{mode}] step {i + 1}: " + ", ".join(f"{k}={m[k]:.4f}" for k in keys if k in m), flush=True)
        if mode == "rollout":
            print(f"[{mode}] per layer: " + ", ".join(f"{k.split('/')[-1]}={v:.4f}" for k, v in metrics[-1].items()
                                                     if k.startswith("actor/routing_agreement/")), flush=True)
        return metrics, done.step_tensors, built


def check_layout(tensors) -> None:
    """Every step's stored routing: int16 [tokens, MoE layers, top-k] on input_ids' offsets, experts in range,
    NOT_ROUTED exactly on each sample's last token (the one the engine never fed)."""
    for step, batch in enumerate(tensors, 1):
        routing, ids = batch.jagged_field("routed_experts"), batch.jagged_field("input_ids")
        values = routing.values
        unrouted = (values < 0).all(dim=-1).all(dim=-1)
        partly = (values < 0).any(dim=-1).any(dim=-1) & ~unrouted
        last = ids.offsets[1:] - 1
        print(f"[rollout] step {step} routing {tuple(values.shape)} {values.dtype}, unrouted {int(unrouted.sum())} "
              f"of {len(unrouted)} tokens for {len(last)} samples, partly unrouted {int(partly.sum())}, experts "
              f"{int(values[~unrouted].min())}..{int(values[~unrouted].max())}", flush=True)
        assert values.dtype == torch.int16 and tuple(values.shape[1:]) == (LAYERS, TOP_K)
        assert torch.equal(routing.offsets, ids.offsets)
        assert not bool(partly.any())
        assert torch.equal(unrouted.nonzero().flatten(), last)
        assert int(values[~unrouted].min()) >= 0 and int(values[~unrouted].max()) < EXPERTS


def later(metrics: list[dict], key: str, pick=statistics.mean) -> float:
    return pick(m[key] for m in metrics[1:])  # the first step also warms kernels up


def test_r3_with_vllm_replays_the_engines_routing_on_every_token(gpu_ray, tmp_path):
    import vllm

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    r3, tensors, r3_built = run(tmp_path / "r3", "rollout")
    free, _, free_built = run(tmp_path / "none", "none")
    agreement = [m["actor/routing_agreement"] for m in r3]
    replayed = [m["actor/routing_replayed"] for m in r3]
    # The fastest later step of each run: a one-off stall (a recompile on a new shape) would swamp a 5 % cost.
    step_r3, step_free = later(r3, "timing_s/step", min), later(free, "timing_s/step", min)
    mismatch_r3, mismatch_free = later(r3, "rollout/logprob_mismatch"), later(free, "rollout/logprob_mismatch")
    print(f"R3 routing agreement (trainer's own top-k = engine's) {min(agreement):.4f}..{max(agreement):.4f}, "
          f"replayed {min(replayed):.4f}; logprob_mismatch R3 {mismatch_r3:.5f} vs none {mismatch_free:.5f}; "
          f"step time R3 {step_r3:.2f}s vs none {step_free:.2f}s (fastest later step), ratio {step_r3 / step_free:.3f} "
          f"(gen {later(r3, 'timing_s/gen'):.2f}s vs {later(free, 'timing_s/gen'):.2f}s; build {r3_built:.0f}s / "
          f"{free_built:.0f}s; {LAYERS} MoE layers, {EXPERTS} experts top-{TOP_K}, B×n {B}×{N}, {RESPONSE} tokens)",
          flush=True)
    runs = (("R3", r3), ("none", free))
    by_step = {name: [round(m["rollout/logprob_mismatch"], 4) for m in steps] for name, steps in runs}
    seconds = {name: [round(m["timing_s/step"], 2) for m in steps] for name, steps in runs}
    print(f"logprob_mismatch by step {by_step} (step 1 runs on the weights from disk, later ones on synced weights: a "
          f"jump after step 1 in both runs points at the MoE weight sync, not at R3); step seconds {seconds}",
          flush=True)
    check_layout(tensors)
    assert replayed == [1.0] * STEPS  # the trainer routed every engine-routed token by the engine's experts
    assert min(agreement) > 0.5, agreement  # a routing off by a token would agree by chance (~1/120 at 16 top-2)
    assert all("actor/routing_agreement" not in m for m in free)
    assert max(by_step["R3"]) < 1.1, by_step  # same weights, same routing: only bf16 kernels differ
