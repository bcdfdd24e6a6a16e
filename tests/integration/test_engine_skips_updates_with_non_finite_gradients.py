"""A NaN in one micro-batch of one DP rank skips that optimizer update on every rank and leaves no trace.

DP=2 with the distributed optimizer: step 2 poisons one response token's advantage on rank 1 only, so its loss and
gradients are NaN there and finite on rank 0. Both ranks report `update_ok=False`, the exported weights are those
of step 1 bit for bit, the LR schedule did not advance, and the next clean step has exactly the loss a run
without the poisoned step has at its step 2 (Adam's moments and step counter were not touched either).
The same in fp16, where the skip comes from Megatron's loss scaler (its found-inf check), not from the engine's.
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512


def batch(poison: bool, rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(5 + rank)
    seqs = []
    for _ in range(3):
        n = int(torch.randint(6, 12, (1,), generator=g))
        mask = torch.zeros(n)
        mask[n // 2 :] = 1
        seqs.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "response_mask": mask,
                     "advantages": torch.randn(n, generator=g)})
    if poison and rank == 1:
        seqs[1]["advantages"][-1] = math.nan
    return seqs


def loss_fn(outputs, mb, normalizer):
    from mrl.algo.aggregation import agg_loss

    return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}


def make_engine(path: str, dtype: str = "float32"):
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine

    e = MegatronEngine(path, MegatronConfig(use_distributed_optimizer=True, params_dtype=dtype),
                       OptimConfig(lr=1e-3, lr_decay_style="linear"), micro_batch_size=1, total_steps=4)
    e.initialize()
    if dtype == "float16":
        # Megatron's dynamic loss scale starts at 2^32, which overflows (and skips) the first clean steps too;
        # start where clean steps fit, so the only overflow is the injected one.
        for opt in getattr(e.optimizer, "chained_optimizers", [e.optimizer]):
            opt.grad_scaler._scale.fill_(1024.0)
    return e


def step(e, poison: bool = False) -> dict:
    from mrl.engine.megatron.packing import JaggedBatch

    out = e.forward_backward(JaggedBatch.from_sequences(batch(poison, e.mesh().dp_rank)), loss_fn)
    return {**out, **e.optimizer_step()}


def weights(e) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in e.export_weights()}


def poisoned_run(path: str, dtype: str) -> dict:
    clean = make_engine(path, dtype)
    clean_losses = [step(clean)["loss"], step(clean)["loss"]]
    e = make_engine(path, dtype)
    first = step(e)
    before, scheduler_steps = weights(e), e.scheduler.num_steps
    poisoned = step(e, poison=True)
    after = weights(e)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"clean": clean_losses, "first": first["loss"], "first_ok": first["update_ok"], "poisoned": poisoned,
            "unchanged": unchanged, "scheduler_advanced": e.scheduler.num_steps != scheduler_steps, "next": step(e)}


def run(rank: int, world: int, path: str) -> dict:
    from mrl.engine.megatron.parallel import teardown

    try:  # each engine trains before the next is built: Megatron's parallel state is one per process
        return {dtype: poisoned_run(path, dtype) for dtype in ("float32", "float16")}
    finally:
        teardown()


def test_non_finite_gradients_skip_the_update_on_every_rank(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen3", tmp_path / "model", tokenizer=False, vocab_size=VOCAB))
    for r in (by_dtype for rank in launch(run, 2, path, timeout_s=600) for by_dtype in rank.values()):
        assert r["first_ok"] and r["first"] == r["clean"][0]
        assert r["poisoned"]["update_ok"] is False and math.isnan(r["poisoned"]["loss"])
        assert r["unchanged"] and not r["scheduler_advanced"]
        assert r["next"]["update_ok"] is True and r["next"]["loss"] == r["clean"][1], (r["next"], r["clean"])
