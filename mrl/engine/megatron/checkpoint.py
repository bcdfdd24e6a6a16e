"""Distributed checkpoints of an engine (model, optimizer, LR schedule) with Megatron's dist-checkpointing.

Every tensor is saved with its global shape and this rank's offsets (the model's `sharded_state_dict`), so a
checkpoint written under one TP/PP/DP layout loads under another: each rank reads exactly the slices its new
shards cover. The distributed optimizer's state is saved in "fully sharded model space" (per-parameter, not
per-DP-bucket), the only form that survives a change of layout. Model chunks are keyed `model`, or `model0`,
`model1`, … with virtual pipeline stages, as Megatron-LM does, so checkpoints stay readable by its tools.
"""

from __future__ import annotations

import os
from typing import Any

_OPTIMIZER_SHARDING = "fully_reshardable"


def _model_state(chunks: list[Any]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _sharded_state(chunks: list[Any], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    state = _model_state(chunks)
    if optimizer is not None:
        model_state: dict[str, Any] = {}
        for value in state.values():
            model_state.update(value)
        distributed = getattr(optimizer.config, "use_distributed_optimizer", False)
        extra = {"sharding_type": _OPTIMIZER_SHARDING, "metadata": {}} if distributed else {}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, **extra)
    return state


def save(path: str, chunks: list[Any], optimizer: Any = None, scheduler: Any = None) -> None:
    """Collective: every rank of the engine calls it with its own (unwrapped) model chunks."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    state = _sharded_state(chunks, optimizer, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()  # plain (common) state: identical on every rank
    dist_checkpointing.save(state, path)


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give a fresh Adam its (zero) moments and step counter. torch's AdamW creates them lazily on the first
    step, but Megatron's optimizer state_dict (used to build the load request) reads `step` from them."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0)
                    )


def load(path: str, chunks: list[Any], optimizer: Any = None, scheduler: Any = None) -> None:
    """Collective: fill model chunks, optimizer and scheduler from a checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    if optimizer is not None and getattr(optimizer.config, "use_distributed_optimizer", False):
        _ensure_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, is_loading=True)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    loaded = dist_checkpointing.load(state, path)
    for key in (k for k in loaded if k.startswith("model")):
        index = 0 if key == "model" else int(key[len("model") :])
        chunks[index].load_state_dict(loaded[key], strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
