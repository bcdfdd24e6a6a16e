"""On one GPU: 10 hybrid GRPO steps of a Qwen2.5-0.5B-shaped model (bf16, random weights, 128 responses of exactly
512 tokens, micro-batches of up to 48k tokens) whose training phase peaks above 40% of the device's memory,
with the engine at gpu_memory_utilization 0.5, complete without running out of memory: the hand-over gives
each phase the device (the first GPU run died here at wake-up: the memory fraction never reached vLLM and the
trainer's cached blocks were never released)."""

from __future__ import annotations

import pytest
from gpu_fixtures import REWARD_FN, device_total_gib

pytestmark = pytest.mark.gpu
STEPS = 10


def test_ten_steps_with_a_training_peak_above_40_percent(gpu_ray, tmp_path):
    import torch

    from mrl.config.startup.loader import load_config
    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, reverse_rows
    from mrl.models.tiny import QWEN2_5_SHAPES, make_tiny_hf_model
    from mrl.trainer.build import build_trainer, shutdown

    train, _ = reverse_rows(8, n_train=512, n_val=8, seed=0)
    model = make_tiny_hf_model("qwen2", tmp_path / "m", tokenizer=char_tokenizer(), init_std=0.02,
                               dtype=torch.bfloat16, **QWEN2_5_SHAPES["0.5b"])
    cfg = load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{write_rows(train, tmp_path / 'train.parquet')}]",
        "data.max_prompt_length=64", "data.max_response_length=512", "data.train_batch_size=16", "rollout.n=8",
        "rollout.ignore_eos=true", "rollout.gpu_memory_utilization=0.5", "rollout.enforce_eager=true",
        "actor.megatron.params_dtype=bfloat16", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=49152",
        "actor.ppo_mini_batch_size=16", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path / 'run'}",
        f"reward.reward_fn='{REWARD_FN}'", "actor.optim.lr=1e-6",
    ])
    trainer = build_trainer(cfg)
    try:
        history = trainer.fit()
    finally:
        shutdown(trainer)
    total = device_total_gib()
    peak = max(h["memory/cuda_peak_gib/update_actor"] for h in history)
    awake = [h["memory/handover/rollout_awake_used_gib"] for h in history]
    asleep = [h["memory/handover/rollout_asleep_used_gib"] for h in history]
    print(f"{len(history)} steps; training peak {peak:.1f} of {total:.0f} GiB ({peak / total:.0%}); device in use "
          f"with the engine awake {min(awake):.1f}..{max(awake):.1f}, asleep {min(asleep):.1f}..{max(asleep):.1f} "
          f"GiB; step {history[-1]['timing_s/step']:.1f} s")
    assert len(history) == STEPS
    assert peak > 0.4 * total
    assert min(awake) > 0.45 * total  # the engine really holds its fraction while it generates
