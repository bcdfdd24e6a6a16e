"""On one GPU with the real vLLM (hybrid, `ipc` sync), rollout.quantization=fp8 with a bf16 trainer: the engine
starts from the block-FP8 copy of the model, and after every step's sync its parameters, read back through the
worker extension, equal the trainer's export quantised by mrl (e4m3 bytes and fp32 block scales) bit for bit; the
sync sends about half the bytes of the bf16 export and the rollout's log-probs stay close to the trainer's.

The model is a small Qwen2 whose layers are whole 128-row blocks (vLLM's block-FP8 layers need them), trained on the
demo's reverse-a-string task from random weights (the check is the sync, not learning)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu
STEPS = 3
SHAPE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=512,
             num_hidden_layers=2)


def task(root):
    import torch

    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, reverse_rows
    from mrl.models.tiny import make_tiny_hf_model

    train, val = reverse_rows(4, n_train=256, n_val=16, seed=1)
    model = make_tiny_hf_model("qwen2", root / "model", seed=1, tokenizer=char_tokenizer(), init_std=0.02,
                               dtype=torch.bfloat16, **SHAPE)
    return {"model": str(model), "train": str(write_rows(train, root / "train.parquet")),
            "val": str(write_rows(val, root / "val.parquet"))}


def engine_matches_quantised_export(trainer) -> tuple[list[str], int]:
    """Engine parameters that differ in any bit from the actor's export quantised by mrl, and the bytes of the
    unquantised export."""
    from mrl.weight_sync.fp8 import quantized_stream
    from rollout_adapters.vllm.readback import mismatched_params

    group = trainer.parts.actor_rollout
    group.onload()  # the export reads the actor's parameters, offloaded while the engine generates
    exported = group.export_to_host()[0]
    group.offload()
    engine = trainer.parts.rollout.read_weights()[0]
    return (mismatched_params(engine, dict(quantized_stream(exported.items()))),
            sum(t.numel() * t.element_size() for t in exported.values()))


def test_fp8_engine_holds_the_quantised_export_after_every_sync(gpu_ray, tmp_path):
    from gpu_fixtures import demo_trainer

    from mrl.trainer.build import shutdown

    trainer = demo_trainer(task(tmp_path / "task"), tmp_path / "fp8", "rollout.quantization=fp8",
                           f"trainer.total_training_steps={STEPS}")
    try:
        trainer.give_devices_to_rollout()  # what fit() does before the first step
        history, full = [], 0
        for _ in range(STEPS):
            history.append(trainer.step())
            bad, full = engine_matches_quantised_export(trainer)
            assert bad == [], f"step {trainer.global_steps}"
    finally:
        shutdown(trainer)
    mismatch = [h["rollout/logprob_mismatch"] for h in history]
    sent = [h["weight_sync/bytes_total"] for h in history]
    print(f"fp8 rollout: logprob_mismatch {min(mismatch):.5f}..{max(mismatch):.5f}, "
          f"mismatch_kl {[round(h.get('rollout/mismatch_kl', math.nan), 6) for h in history]}, bytes per sync {sent} "
          f"(unquantised export {full})")
    assert all(math.isfinite(m) for m in mismatch) and max(mismatch) < 1.5
    # The linear weights are about 80% of this model's bytes: 1 byte (+ 4 per 128×128 block) instead of 2
    assert all(s < 0.75 * full for s in sent), (sent, full)
