"""Pieces the end-to-end GPU tests share (their Ray cluster is conftest.py's `gpu_ray`): device memory read without
creating a CUDA context in the test process, trainers of the demo task built from `recipes/tiny/grpo.yaml`, and the
check that the engine holds the trainer's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REWARD_FN = "mrl.data.synthetic:exact_match_reward"


def device_memory_gib(index: int = 0) -> tuple[float, float]:
    """(GiB in use by every process, GiB in all) of the device, through NVML: no CUDA context is created here."""
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return info.used / 2**30, info.total / 2**30
    finally:
        pynvml.nvmlShutdown()


def device_used_gib(index: int = 0) -> float:
    return device_memory_gib(index)[0]


def device_total_gib(index: int = 0) -> float:
    return device_memory_gib(index)[1]


def demo_task(root: Path, warmup_steps: int = 75) -> dict[str, Any]:
    """The demo's reverse-a-string task and its supervised-warmed tiny model (mrl/demo.py `prepare`)."""
    from mrl.demo import prepare

    return prepare(root, length=4, warmup_steps=warmup_steps, seed=1)


def demo_trainer(paths: dict[str, Any], root: Path, *overrides: str, cls: Any = None) -> Any:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import build_trainer

    cfg = load_config("tiny/grpo", [
        f"model.path={paths['model']}", f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
        "data.max_response_length=8", "rollout.n=8", "trainer.seed=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{REWARD_FN}'",
        "actor.megatron.params_dtype=bfloat16", "rollout.enforce_eager=true", "actor.optim.lr=1e-3", *overrides,
    ])
    trainer = build_trainer(cfg)
    return trainer if cls is None else cls(trainer.config, trainer.parts, trainer.logger)


def engine_matches_export(trainer: Any) -> list[str]:
    """Engine parameters (read back) that differ in any bit from the actor's export (rollout_adapters/vllm/readback)."""
    from rollout_adapters.vllm.readback import hybrid_engine_mismatches

    return hybrid_engine_mismatches(trainer.parts.actor_rollout, trainer.parts.rollout)
