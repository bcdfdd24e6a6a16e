"""Distributed checkpoints of an engine (model, optimizer, LR schedule) with Megatron's dist-checkpointing.

Every tensor is saved with its global shape and this rank's offsets (the model's `sharded_state_dict`), so a
checkpoint written under one TP/PP/DP layout loads under another: each rank reads exactly the slices its new
shards cover. The distributed optimizer's state is saved in "fully sharded model space" (per-parameter, not
per-DP-bucket), the only form that survives a change of layout. Model chunks are keyed `model`, or `model0`,
`model1`, … with virtual pipeline stages, as Megatron-LM does, so checkpoints stay readable by its tools.
Each rank also writes its random generator states (`rng/rank_<r>.pt`, Megatron's model-parallel tracker
included); they are restored only under the same world size, where rank r is the same shard again.
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
        extra = {"sharding_type": _OPTIMIZER_SHARDING, "metadata": {}} if _is_distributed(optimizer) else {}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, **extra)
    return state


def save(path: str, chunks: list[Any], optimizer: Any = None, scheduler: Any = None) -> None:
    """Collective: every rank of the engine calls it with its own (unwrapped) model chunks. Works before the
    first optimizer step too (the moments are then zeros and the step counter 0)."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    if _is_distributed(optimizer):
        _ensure_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()  # plain (common) state: identical on every rank
    dist_checkpointing.save(state, path)
    _save_rng(path)


def _rng_file(path: str) -> str:
    import torch.distributed as dist

    return os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")


def _save_rng(path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from mrl.utils.rng import rng_state

    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    state = {"world_size": dist.get_world_size(), "process": rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    torch.save(state, _rng_file(path))


def _load_rng(path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from mrl.utils.rng import set_rng_state

    if not os.path.isfile(_rng_file(path)):
        return
    state = torch.load(_rng_file(path), weights_only=False)
    if state["world_size"] != dist.get_world_size():
        return  # another layout: rank r holds another shard, its old streams mean nothing here
    set_rng_state(state["process"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _is_distributed(optimizer: Any) -> bool:
    return optimizer is not None and getattr(optimizer.config, "use_distributed_optimizer", False)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (possibly chained) distributed optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give a fresh Adam its (zero) moments and step counter, exactly what torch's AdamW creates lazily on its
    first step. Megatron's distributed optimizer `state_dict` (saving, and building the load request) reads
    `step` from every parameter's state and asserts there is one value."""
    import torch

    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0)
                    )


def _load_distributed_optimizer(optimizer: Any, state: dict[str, Any]) -> None:
    """Megatron 0.19's distributed optimizer with torch's AdamW (no Apex/TE) cannot load its own
    `fully_reshardable` state: the parameter-state loader copies every tensor of the live state, `step`
    included, from a source that never holds `step` (KeyError 'step'), and `load_state_dict` puts one shared
    `step` tensor into every parameter's state, which AdamW's in-place `step += 1` would then advance once per
    parameter. So: load the non-parameter state (param groups, step) first, set `step` aside while the
    moments and fp32 params are copied in, then give each parameter its own copy of the step."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    # A chained optimizer (e.g. dense + expert parameters) keys its parts 0, 1, …; a single one is unwrapped.
    states = [state] if len(optimizers) == 1 else [state[k] for k in sorted(state)]
    for opt, part in zip(optimizers, states):
        param_state = part.pop("param_state")
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.detach().clone()


def load(path: str, chunks: list[Any], optimizer: Any = None, scheduler: Any = None) -> None:
    """Collective: fill model chunks, optimizer and scheduler from a checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    if _is_distributed(optimizer):
        _ensure_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, is_loading=True)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    loaded = dist_checkpointing.load(state, path)
    for key in (k for k in loaded if k.startswith("model")):
        index = 0 if key == "model" else int(key[len("model") :])
        chunks[index].load_state_dict(loaded[key], strict=False)
    if _is_distributed(optimizer):
        _load_distributed_optimizer(optimizer, loaded["optimizer"])
    elif optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        # Megatron's scheduler loads by stepping `num_steps` forward from where it stands: start from 0, so an
        # engine that already trained is not advanced twice.
        scheduler.num_steps = 0
        scheduler.load_state_dict(loaded["scheduler"])
    _load_rng(path)
