"""Critic: per-token values are the value head applied to the HF model's final hidden state at the previous
position, and a TP=2 (sequence-parallel) critic trains exactly like the TP=1 one (values, losses, grad norms,
1e-5 fp32) under a value loss."""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512


def samples():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(4):
        n = int(torch.randint(5, 13, (1,), generator=g))
        mask = torch.zeros(n)
        mask[2:] = 1
        out.append(
            {
                "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                "response_mask": mask,
                "returns": torch.randn(n, generator=g),
            }
        )
    return out


def value_loss(outputs, mb, normalizer):
    from mrl.algo.aggregation import agg_loss

    return agg_loss(0.5 * (outputs["values"] - mb["returns"]) ** 2, mb["response_mask"], "token-mean", normalizer), {}


def run(rank: int, world: int, path: str) -> dict:
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.critic import MegatronCritic
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown

    out = {}
    try:
        for name, cfg in (
            ("tp1", MegatronConfig()),
            ("tp2_sp", MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
        ):
            critic = MegatronCritic(
                path, cfg, OptimConfig(lr=1e-3), micro_batch_size=None, max_tokens_per_micro_batch=24
            )
            critic.initialize()
            head = next(c.value_head.weight for c in critic.unwrapped() if c.post_process).detach().clone()
            data = samples()
            values = critic.infer(JaggedBatch.from_sequences(data))["values"]
            mesh = critic.mesh()
            mine = JaggedBatch.from_sequences(data[mesh.dp_rank :: mesh.dp_size])
            steps = []
            for _ in range(2):
                m = critic.forward_backward(mine, value_loss)
                m.update(critic.optimizer_step())
                steps.append(m)
            out[name] = {"head": head, "values": values, "steps": steps}
    finally:
        teardown()
    return out


def test_critic_values_match_hf_hidden_states_and_tp2(tmp_path):
    from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen3", tmp_path / "model", tokenizer=False, vocab_size=VOCAB))
    results = launch(run, 2, path, timeout_s=600)
    hf = build_tiny_hf_model("qwen3", vocab_size=VOCAB)
    r = results[0]["tp1"]
    expected = []
    for s in samples():
        with torch.no_grad():
            hidden = hf(s["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        v = torch.zeros(len(s["input_ids"]))
        v[1:] = (hidden[:-1] @ r["head"].t()).squeeze(-1)
        expected.append(v)
    torch.testing.assert_close(r["values"], torch.cat(expected), atol=1e-5, rtol=1e-5)
    for rank in range(2):
        a, b = results[rank]["tp1"], results[rank]["tp2_sp"]
        torch.testing.assert_close(b["head"], a["head"])
        torch.testing.assert_close(b["values"], a["values"], atol=1e-5, rtol=1e-5)
        for sa, sb in zip(a["steps"], b["steps"]):
            assert abs(sa["loss"] - sb["loss"]) < 1e-5, (sa, sb)
            assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * max(1.0, sa["grad_norm"]), (sa, sb)
        assert a["steps"][1]["loss"] < a["steps"][0]["loss"]
