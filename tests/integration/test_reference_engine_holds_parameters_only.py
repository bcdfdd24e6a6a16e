"""The reference policy (a forward-only engine, `optim=None`) holds its parameters and nothing else: no DDP
gradient buffer, no trainable parameter, no optimizer state, measured on CPU at TP=2; its log-probs equal those of
a trainable engine of the same weights (the path the reference took when it still carried a gradient buffer).
`mrl plan` agrees: at Qwen3-8B shapes (TP=2, bf16) its reference row is parameters only, and at the tiny shape
its parameter bytes are the engine's."""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512
GiB = 1024**3


def sequences() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g)} for n in (7, 12, 5, 9)]


def run(rank: int, world: int, path: str) -> dict:
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.offload import grad_tensors, param_tensors
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown

    cfg = MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    batch = JaggedBatch.from_sequences(sequences())
    try:
        ref = MegatronEngine(path, cfg, None, micro_batch_size=2)
        ref.initialize()
        actor = MegatronEngine(path, cfg, OptimConfig(lr=1e-3), micro_batch_size=2)
        actor.initialize()
        return {
            "ref_grad_bytes": sum(t.numel() * t.element_size() for t in grad_tensors(ref.model)),
            "ref_main_grads": sum(hasattr(p, "main_grad") for c in ref.model for p in c.parameters()),
            "ref_param_bytes": sum(t.numel() * t.element_size() for t in param_tensors(ref.model)),
            "ref_sizes": ref.state_sizes(),
            "actor_grad_bytes": sum(t.numel() * t.element_size() for t in grad_tensors(actor.model)),
            "ref_log_probs": ref.infer(batch)["log_probs"],
            "actor_log_probs": actor.infer(batch)["log_probs"],
        }
    finally:
        teardown()


def test_reference_engine_has_no_gradient_buffer_and_the_same_log_probs(tmp_path):
    from mrl.config.model_shape import shape_from_config
    from mrl.config.startup.loader import load_config
    from mrl.models.tiny import make_tiny_hf_model, tiny_hf_config
    from mrl.tools.memory import engine_memory

    path = str(make_tiny_hf_model("qwen3", tmp_path / "model", tokenizer=False, vocab_size=VOCAB))
    results = launch(run, 2, path, timeout_s=600)
    layout = load_config("tiny/grpo", ["ref.megatron.tensor_model_parallel_size=2"], check=False).ref.megatron
    shape = shape_from_config(tiny_hf_config("qwen3", VOCAB).to_dict())
    planned = engine_memory("ref", shape, layout, 2, train=False, micro_tokens=1)
    assert planned.grads == planned.optimizer == 0
    for r in results:
        assert r["actor_grad_bytes"] > 0  # the measurement sees a trainable engine's buffer
        assert r["ref_grad_bytes"] == 0 and r["ref_main_grads"] == 0
        assert r["ref_sizes"] == {"optimizer_state_bytes": 0, "trainable_params": 0}
        # TP=2 splits all but the replicated norms, which the plan splits too: a fraction of a percent apart.
        assert r["ref_param_bytes"] == pytest.approx(planned.params, rel=0.02)
        torch.testing.assert_close(r["ref_log_probs"], r["actor_log_probs"], atol=0, rtol=0)


def test_plan_counts_parameters_only_for_the_reference_at_8b():
    from mrl.tools.plan import make_plan, render

    plan = make_plan("qwen3/8b_grpo", ["actor.use_kl_loss=true"])
    ref = next(e for e in plan.memory.training if e.role == "ref")
    actor = next(e for e in plan.memory.training if e.role == "actor")
    assert ref.grads == ref.optimizer == ref.activations == 0
    assert ref.params == actor.params  # bf16 at TP=2 like the actor: about 7.6 GiB, and no more
    assert 7 * GiB < ref.total < 8 * GiB
    line = next(line for line in render(plan).splitlines() if line.strip().startswith("ref "))
    assert "grads     0.00 GiB  optimizer     0.00 GiB  activations     0.00 GiB" in line
