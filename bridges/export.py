"""Export: an HF-named tensor stream from any TP/PP/VPP/EP/ETP layout, optionally in byte-bounded buckets.

The plan (which Megatron tensor, owned by which pipeline stage, produces which HF tensors of which size) is
built once per (model, dtype) with one object all-gather over the pipeline group, then every rank walks the
same plan so the collectives line up:
1. the owning stage gathers the TP (expert-TP for experts) shards and merges them (`Mapping.merge`);
2. for experts it all-gathers the same local expert index over EP (rank r holds experts r*local + j);
3. with PP > 1 the owning stage broadcasts the merged tensors to the other stages, one flat broadcast per
   bucket and owning stage.
So every rank yields the full stream: what a colocated rollout replica on each rank needs. A destination that
needs only part (e.g. a standalone replica fed by one rank) filters the names; the collectives still run on
all ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bridges.mapping import ModelShape, Shard
from bridges.names import LocalTensor, with_expert

if TYPE_CHECKING:
    from bridges.bridge import Bridge


@dataclass(frozen=True)
class Unit:
    """One Megatron tensor (for experts: one local expert index, all EP ranks) and its HF outputs."""

    name: str  # canonical Megatron name on EP rank 0 / the owning stage
    stage: int  # owning pipeline stage
    mapping_index: int
    indices: tuple[int, ...]  # wildcard values on EP rank 0
    full_shape: tuple[int, ...]  # after the TP merge
    dtype: torch.dtype
    is_expert: bool
    local_expert: int | None
    hf_bytes: int  # bytes of all HF outputs (all EP ranks) at the export dtype
    hf_names: tuple[str, ...] = ()  # the HF tensors it yields, in order


@dataclass
class Plan:
    units: list[Unit]
    ep_size: int
    local_experts: int
    dtype: torch.dtype | None
    shape: ModelShape


def _describe(
    bridge: Bridge, tensor: LocalTensor, shard: Shard, stage: int, ep: tuple[int, int, int], dtype: torch.dtype | None
) -> Unit | None:
    resolved = bridge.resolve(tensor.name)
    if resolved is None:
        return None
    mapping = resolved.mapping
    ep_rank, ep_size, local_experts = ep
    indices = resolved.indices
    copies = 1
    if tensor.is_expert and tensor.local_expert is not None:
        # Describe the unit as EP rank 0 sees it; other ranks' experts differ only by the index offset.
        indices = (*indices[:-1], indices[-1] - ep_rank * local_experts)
        copies = ep_size
    if not mapping.export_names(indices):
        return None  # import-only (tied output layer)
    shape = list(tensor.tensor.shape)
    if mapping.tp_dim is not None:
        shape[mapping.tp_dim] *= shard.size
    out_dtype = dtype or tensor.tensor.dtype
    nbytes = copies * torch.Size(shape).numel() * torch.empty((), dtype=out_dtype).element_size()
    name = with_expert(tensor.name, indices[-1]) if tensor.local_expert is not None else tensor.name
    hf_names = tuple(
        n
        for r in range(copies)
        for n in mapping.export_names((*indices[:-1], indices[-1] + r * local_experts) if copies > 1 else indices)
    )
    return Unit(
        name,
        stage,
        bridge.table.index(mapping),
        indices,
        tuple(shape),
        tensor.tensor.dtype,
        tensor.is_expert,
        tensor.local_expert,
        nbytes,
        hf_names,
    )


def build_plan(bridge: Bridge, chunks: Sequence[torch.nn.Module], dtype: torch.dtype | None) -> Plan:
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    config = _config_of(chunks[0])
    shape = bridge.model_shape(config)
    local_experts = (getattr(config, "num_moe_experts", None) or 0) // ep_size
    mine = []
    for tensor in bridge.local_tensors(chunks):
        unit = _describe(bridge, tensor, bridge.shard_of(tensor), stage, (ep_rank, ep_size, local_experts), dtype)
        if unit is not None:
            mine.append(unit)
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return Plan(mine, ep_size, local_experts, dtype, shape)
    per_stage: list[list[Unit] | None] = [None] * pp_size
    dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    units = [u for stage_units in per_stage for u in stage_units or []]
    return Plan(units, ep_size, local_experts, dtype, shape)


def plan_for(bridge: Bridge, chunks: Sequence[torch.nn.Module], dtype: torch.dtype | None) -> Plan:
    # Keyed by the chunk objects: a bridge serves one model; a rebuilt model gets a new plan.
    key = (tuple(id(c) for c in chunks), dtype)
    if key not in bridge._export_plans:
        bridge._export_plans[key] = build_plan(bridge, chunks, dtype)
    return bridge._export_plans[key]


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _copies(unit: Unit, plan: Plan) -> int:
    return plan.ep_size if unit.is_expert and unit.local_expert is not None else 1


def _owned(bridge: Bridge, unit: Unit, local: dict[str, LocalTensor], plan: Plan) -> list[torch.Tensor]:
    """On the owning stage: the unit's unsharded Megatron tensor(s), one per EP rank for experts (TP/EP gathers)."""
    from megatron.core import parallel_state as ps

    mapping = bridge.table[unit.mapping_index]
    own = unit.name
    if unit.is_expert and unit.local_expert is not None:
        own = with_expert(own, unit.indices[-1] + ps.get_expert_model_parallel_rank() * plan.local_experts)
    tensor = local[own]
    shard = bridge.shard_of(tensor)
    full = tensor.tensor.detach()
    if mapping.tp_dim is not None and shard.size > 1:
        group = ps.get_expert_tensor_parallel_group() if tensor.is_expert else ps.get_tensor_model_parallel_group()
        full = mapping.merge(_gather(full, group, shard.size), plan.shape)
    copies = _copies(unit, plan)
    return _gather(full, ps.get_expert_model_parallel_group(), copies) if copies > 1 else [full]


def _materialise(
    bridge: Bridge, units: Sequence[Unit], local: dict[str, LocalTensor], plan: Plan
) -> list[list[torch.Tensor]]:
    """The unsharded tensors of a bucket's units on every rank.

    With PP > 1 the units of one owning stage (and dtype) travel as one flat broadcast per bucket, so a bucket
    costs a few collectives instead of one per tensor.
    """
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    out: list[list[torch.Tensor] | None] = [
        _owned(bridge, unit, local, plan) if unit.stage == stage else None for unit in units
    ]
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return out  # type: ignore[return-value]
    group = ps.get_pipeline_model_parallel_group()
    owners: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, unit in enumerate(units):
        owners.setdefault((unit.stage, unit.dtype), []).append(i)
    for (owner, dtype), members in owners.items():
        shapes = [unit.full_shape for i in members for unit in [units[i]] for _ in range(_copies(unit, plan))]
        numels = [torch.Size(s).numel() for s in shapes]
        if owner == stage:
            owned = [t.reshape(-1) for i in members for t in out[i]]  # type: ignore[union-attr]
            flat = owned[0] if len(owned) == 1 else torch.cat(owned)  # a lone tensor is sent without a copy
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=_device())
        dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
        if owner != stage:
            pieces = iter(p.view(s) for p, s in zip(flat.split(numels), shapes))
            for i in members:
                out[i] = [next(pieces) for _ in range(_copies(units[i], plan))]
    return out  # type: ignore[return-value]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _config_of(chunk: torch.nn.Module):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.config


def _hf_tensors(
    bridge: Bridge, unit: Unit, fulls: list[torch.Tensor], plan: Plan
) -> Iterator[tuple[str, torch.Tensor]]:
    mapping = bridge.table[unit.mapping_index]
    for ep_rank, full in enumerate(fulls):
        indices = unit.indices
        if len(fulls) > 1:
            indices = (*indices[:-1], indices[-1] + ep_rank * plan.local_experts)
        for name, tensor in zip(mapping.export_names(indices), mapping.to_hf(full, plan.shape)):
            yield name, tensor if plan.dtype is None else tensor.to(plan.dtype)


def export_stream(
    bridge: Bridge, chunks: Sequence[torch.nn.Module], *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in _walk(bridge, chunks, None, dtype):
        yield from bucket


def export_buckets(
    bridge: Bridge, chunks: Sequence[torch.nn.Module], bucket_bytes: int, *, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    return _walk(bridge, chunks, bucket_bytes, dtype)


def bucket_bounds(plan: Plan, bucket_bytes: int | None) -> list[tuple[int, int]]:
    """[start, stop) unit ranges whose HF bytes fit `bucket_bytes` (None: one unit per bucket)."""
    bounds: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, unit in enumerate(plan.units):
        if bucket_bytes is None or (i > start and size + unit.hf_bytes > bucket_bytes):
            if i > start:
                bounds.append((start, i))
            start, size = i, 0
        size += unit.hf_bytes
    if start < len(plan.units):
        bounds.append((start, len(plan.units)))
    return bounds


def _walk(
    bridge: Bridge, chunks: Sequence[torch.nn.Module], bucket_bytes: int | None, dtype: torch.dtype | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    plan = plan_for(bridge, chunks, dtype)
    key = ("bounds", id(plan), bucket_bytes)
    if key not in bridge._export_plans:
        bridge._export_plans[key] = bucket_bounds(plan, bucket_bytes)
    # Parameter objects outlive steps (optimizers and offloading change their data, not their identity), so
    # the name index is built once per model like the plan; rebuilding it cost as much as the stream itself.
    local_key = ("local", tuple(id(c) for c in chunks))
    if local_key not in bridge._export_plans:
        bridge._export_plans[local_key] = {t.name: t for t in bridge.local_tensors(chunks)}
    local = bridge._export_plans[local_key]
    with torch.no_grad():
        for start, stop in bridge._export_plans[key]:
            units = plan.units[start:stop]
            bucket: list[tuple[str, torch.Tensor]] = []
            for unit, fulls in zip(units, _materialise(bridge, units, local, plan)):
                bucket.extend(_hf_tensors(bridge, unit, fulls, plan))
            yield bucket
