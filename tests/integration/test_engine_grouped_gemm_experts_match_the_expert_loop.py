"""MoE experts through grouped GEMMs (mrl/engine/megatron/grouped_experts.py) train exactly like Megatron's loop over
experts (SequentialMLP), in bf16 at EP 2 (2 ranks, a tiny Qwen3-MoE with 4 local experts each, top-2 routing): the
same log-probs before training, the same loss, and the same weights after one optimizer step, every expert's
included. At EP 1 (DP 2, every expert on each rank) the grouped experts behind the in-rank dispatcher (counts kept
on the device, gathers instead of atomics) train like the loop behind Megatron's stock all-to-all dispatcher.
(DeepSeek-V3's MLA layers cannot take the engine's packed micro-batches without TransformerEngine.) The grouped run
calls grouped_mm twice per MoE layer and pass; the loop is the same class with that branch turned off and calls it
never.

On CPU (torch 2.13's grouped_mm fallback) the two agree bit for bit; the assertions allow bf16 rounding so that the
test states the contract, not one kernel's accumulation order."""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512


def batch(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(11 + rank)
    seqs = []
    for _ in range(3):
        n = int(torch.randint(8, 16, (1,), generator=g))
        mask = torch.zeros(n)
        mask[n // 2:] = 1
        seqs.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "response_mask": mask,
                     "advantages": torch.randn(n, generator=g)})
    return seqs


def loss_fn(outputs, mb, normalizer):
    from mrl.algo.aggregation import agg_loss

    return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}


def train_once(path: str, rank: int, ep: int) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.grouped_experts import GroupedGemmExperts, InRankTokenDispatcher
    from mrl.engine.megatron.packing import JaggedBatch

    e = MegatronEngine(path, MegatronConfig(expert_model_parallel_size=ep, params_dtype="bfloat16"),
                       OptimConfig(lr=1e-3), micro_batch_size=1, total_steps=2)
    e.initialize()
    experts = [m for chunk in e.model for m in chunk.modules() if isinstance(m, GroupedGemmExperts)]
    in_rank = [m for chunk in e.model for m in chunk.modules()
               if isinstance(m, MoELayer) and isinstance(m.token_dispatcher, InRankTokenDispatcher)]
    data = JaggedBatch.from_sequences(batch(rank))
    grouped_mm, calls = torch.nn.functional.grouped_mm, []

    def counted(*args, **kwargs):  # the real kernel, counted: which path ran
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    torch.nn.functional.grouped_mm = counted
    try:
        before = e.infer(data)["log_probs"]
        out = {**e.forward_backward(data, loss_fn), **e.optimizer_step()}
    finally:
        torch.nn.functional.grouped_mm = grouped_mm
    return {"experts": len(experts), "in_rank_dispatchers": len(in_rank), "grouped_mm_calls": len(calls),
            "log_probs": before, "loss": out["loss"],
            "update_ok": out["update_ok"], "weights": {n: t.detach().float().clone() for n, t in e.export_weights()}}


def run(rank: int, world: int, paths: dict[str, str]) -> dict:
    from mrl.engine.megatron.grouped_experts import GroupedGemmExperts, InRankTokenDispatcher
    from mrl.engine.megatron.parallel import teardown

    grouped_branch, in_rank_rule = GroupedGemmExperts._grouped, InRankTokenDispatcher.applies
    results = {}
    try:  # each engine trains before the next is built: Megatron's parallel state is one per process
        for ep, path in paths.items():
            GroupedGemmExperts._grouped = lambda self, hidden: False
            InRankTokenDispatcher.applies = staticmethod(lambda dispatcher: False)
            loop = train_once(path, rank, ep)
            GroupedGemmExperts._grouped, InRankTokenDispatcher.applies = grouped_branch, in_rank_rule
            results[ep] = {"loop": loop, "grouped": train_once(path, rank, ep)}
    finally:
        GroupedGemmExperts._grouped, InRankTokenDispatcher.applies = grouped_branch, in_rank_rule
        teardown()
    return results


def test_grouped_gemm_experts_train_like_the_loop_at_ep2_and_ep1(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen3_moe", tmp_path / "qwen3_moe", tokenizer=False, vocab_size=VOCAB,
                                  dtype=torch.bfloat16))
    for rank, by_ep in enumerate(launch(run, 2, {2: path, 1: path}, timeout_s=600)):
        for ep, r in by_ep.items():
            loop, grouped = r["loop"], r["grouped"]
            family = f"qwen3_moe EP {ep}"
            # 2 GEMMs per MoE layer in each of infer and forward_backward
            assert grouped["experts"] > 0 and grouped["grouped_mm_calls"] >= 4 * grouped["experts"], (family, rank)
            assert loop["grouped_mm_calls"] == 0 and loop["in_rank_dispatchers"] == 0
            # one rank holds every expert only at EP 1
            assert grouped["in_rank_dispatchers"] == (grouped["experts"] if ep == 1 else 0), (family, rank)
            assert loop["update_ok"] and grouped["update_ok"]
            torch.testing.assert_close(grouped["log_probs"], loop["log_probs"], rtol=0, atol=2e-2)
            assert abs(grouped["loss"] - loop["loss"]) <= 1e-2 * max(1.0, abs(loop["loss"])), (family, rank)
            assert grouped["weights"].keys() == loop["weights"].keys()
            assert any(".experts." in name for name in loop["weights"])
            for name, want in loop["weights"].items():
                # one bf16 step of the trained weights (lr 1e-3) at most apart
                torch.testing.assert_close(grouped["weights"][name], want, rtol=0, atol=4e-3, msg=name)
            exact = all(torch.equal(grouped["weights"][n], w) for n, w in loop["weights"].items())
            print(f"{family} rank {rank}: loss {loop['loss']:.6f} vs {grouped['loss']:.6f}, "
                  f"weights after the step bit-identical: {exact}")
