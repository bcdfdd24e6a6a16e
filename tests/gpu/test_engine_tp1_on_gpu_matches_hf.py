"""On one GPU (NCCL, TransformerEngine absent so the local spec with SdpaAttention): `infer` on packed
micro-batches equals log_softmax of the HF model's logits at the next tokens (fp32), packed and one-sample
micro-batches agree, and three optimizer steps of an RL loss run with finite, changing losses."""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.gpu

VOCAB = 512


def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(6):
        n = int(torch.randint(5, 40, (1,), generator=g))
        out.append(
            {
                "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                "response_mask": torch.ones(n),
                "advantages": torch.randn(n, generator=g),
            }
        )
    return out


def run(rank: int, world: int, path: str) -> dict:
    from mrl.algo.aggregation import agg_loss
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown

    def loss_fn(outputs, mb, normalizer):
        return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}

    try:
        batch = JaggedBatch.from_sequences(samples())
        out = {}
        for name, micro in (
            ("packed", {"micro_batch_size": None, "max_tokens_per_micro_batch": 96}),
            ("alone", {"micro_batch_size": 1}),
        ):
            engine = MegatronEngine(path, MegatronConfig(), OptimConfig(lr=1e-3), **micro)
            engine.initialize()
            out[name] = engine.infer(batch, entropy=True)["log_probs"].cpu()
        steps = []
        for _ in range(3):
            m = engine.forward_backward(batch, loss_fn)
            m.update(engine.optimizer_step())
            steps.append(m)
        out["steps"] = steps
        return out
    finally:
        teardown()


def test_tp1_gpu_infer_matches_hf_and_trains(tmp_path):
    from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen3", tmp_path / "m", tokenizer=False, vocab_size=VOCAB))
    result = launch(run, 1, path, timeout_s=600)[0]
    hf = build_tiny_hf_model("qwen3", vocab_size=VOCAB)
    ref = []
    for s in samples():
        with torch.no_grad():
            logp = torch.log_softmax(hf(s["input_ids"][None]).logits[0].float(), -1)
        token = torch.zeros(len(s["input_ids"]))
        token[1:] = logp[:-1].gather(-1, s["input_ids"][1:, None]).squeeze(-1)
        ref.append(token)
    ref = torch.cat(ref)
    err = (result["packed"] - ref).abs().max().item()
    print(f"max |logp - hf| on GPU: {err:.3e}; packed vs alone: {(result['packed'] - result['alone']).abs().max():.3e}")
    assert err < 1e-4
    torch.testing.assert_close(result["packed"], result["alone"], atol=1e-5, rtol=1e-5)
    losses = [s["loss"] for s in result["steps"]]
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3
    assert all(s["update_ok"] for s in result["steps"])
