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

With `tp_slices` (a weight sync into an engine whose TP ranks sit on the same devices as the trainer's, in the
same order) the dense TP-split tensors skip step 1: each rank yields its own slice of the HF tensors, tagged
with a `TpSlice`, and with PP > 1 the owning stage broadcasts slices, not merged tensors, so every device moves
about 1/TP of those bytes. Vocabulary-parallel tensors (the engine pads the vocabulary its own way) and experts
stay whole.

With `row_blocks` (the one-copy ipc sender, which shares the trainer's memory instead of copying the stream) a
fused QKV's q/k/v come as strided views [query groups, rows per group, *rest] of linear_qkv, tagged `ROW_BLOCKS`,
instead of the copies that make them contiguous HF tensors: the receiver copies each block into its rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bridges.mapping import FusedQKV, GatedMLP, Mapping, ModelShape, Shard
from bridges.names import LocalTensor, with_expert

if TYPE_CHECKING:
    from bridges.bridge import Bridge


# This rank's tensors by canonical name, each with its shard (built once per model, like the plan).
LocalIndex = dict[str, tuple[LocalTensor, Shard]]

# Megatron-core's vocabulary-parallel tensors: engines split the (padded) vocabulary differently.
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class TpSlice:
    """A tensor of the stream sent as TP rank `rank`'s slice (of `size`) along `dim` of the HF tensor."""

    dim: int
    rank: int
    size: int

    def full_shape(self, shape: Sequence[int]) -> list[int]:
        full = list(shape)
        full[self.dim] *= self.size
        return full


@dataclass(frozen=True)
class RowBlocks:
    """A tensor of the stream sent as [blocks, rows, *rest]: the HF tensor is its flatten(0, 1)."""


ROW_BLOCKS = RowBlocks()


def stream_tags(tags: Sequence[object]) -> tuple[TpSlice | None, bool]:
    """The TP slice (or None) and whether the tensor comes as row blocks, from a stream item's tags (item[2:])."""
    tp = next((t for t in tags if isinstance(t, TpSlice)), None)
    return tp, any(isinstance(t, RowBlocks) for t in tags)


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
    tp_size: int = 1
    stage: int = 0  # this rank's pipeline stage
    pp_size: int = 1


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
    shape = bridge.chunk_shape(chunks)
    local_experts = (getattr(config, "num_moe_experts", None) or 0) // ep_size
    mine = []
    for tensor in bridge.local_tensors(chunks):
        unit = _describe(bridge, tensor, bridge.shard_of(tensor), stage, (ep_rank, ep_size, local_experts), dtype)
        if unit is not None:
            mine.append(unit)
    pp_size, tp_size = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    if pp_size == 1:
        return Plan(mine, ep_size, local_experts, dtype, shape, tp_size, stage, pp_size)
    per_stage: list[list[Unit] | None] = [None] * pp_size
    dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    units = [u for stage_units in per_stage for u in stage_units or []]
    return Plan(units, ep_size, local_experts, dtype, shape, tp_size, stage, pp_size)


def sliceable(bridge: Bridge, unit: Unit, plan: Plan) -> bool:
    """Whether `tp_slices` sends this unit as TP slices: a dense tensor split over TP by one of the primitives
    whose HF outputs split the same way (plain column/row, fused QKV, gate-up), not vocabulary-parallel, not an
    expert (engines' fused-MoE loaders are not checked against expert slices), not a QKV split below one KV head
    per rank."""
    mapping = bridge.table[unit.mapping_index]
    expert = unit.is_expert or ".experts." in unit.name
    if isinstance(mapping, FusedQKV) and plan.shape.num_query_groups % plan.tp_size:
        return False  # fewer KV heads than TP: Megatron's blocks are not the engine's per-rank heads
    return (plan.tp_size > 1 and not expert and mapping.tp_dim is not None
            and type(mapping) in (Mapping, FusedQKV, GatedMLP) and unit.name not in VOCAB_PARALLEL)


def _local_shape(unit: Unit, plan: Plan, mapping: Mapping) -> tuple[int, ...]:
    shape = list(unit.full_shape)
    shape[mapping.tp_dim] //= plan.tp_size  # type: ignore[index]
    return tuple(shape)


def plan_for(bridge: Bridge, chunks: Sequence[torch.nn.Module], dtype: torch.dtype | None) -> Plan:
    # Keyed by the chunk objects: a bridge serves one model; a rebuilt model gets a new plan.
    key = (tuple(id(c) for c in chunks), dtype)
    if key not in bridge._export_plans:
        bridge._export_plans[key] = build_plan(bridge, chunks, dtype)
    return bridge._export_plans[key]


# Collectives the export has run in this process (TP/EP gathers, PP broadcasts): an export that ran none can be
# replayed by this rank alone (ViewRecipe) without its peers falling out of step.
_collectives = [0]


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    _collectives[0] += 1
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _copies(unit: Unit, plan: Plan) -> int:
    return plan.ep_size if unit.is_expert and unit.local_expert is not None else 1


def _owned(bridge: Bridge, unit: Unit, local: LocalIndex, plan: Plan, sliced: bool) -> list[torch.Tensor]:
    """On the owning stage: the unit's unsharded Megatron tensor(s), one per EP rank for experts (TP/EP gathers);
    `sliced`: this rank's TP shard as it is."""
    from megatron.core import parallel_state as ps

    mapping = bridge.table[unit.mapping_index]
    own = unit.name
    if unit.is_expert and unit.local_expert is not None:
        own = with_expert(own, unit.indices[-1] + ps.get_expert_model_parallel_rank() * plan.local_experts)
    tensor, shard = local[own]
    # A parameter may name what is exported in its place (LoRA: the base weight merged with its adapter).
    export_value = getattr(tensor.tensor, "export_value", None)
    full = export_value() if export_value is not None else tensor.tensor.detach()
    if sliced:
        return [full]
    if mapping.tp_dim is not None and shard.size > 1:
        group = ps.get_expert_tensor_parallel_group() if tensor.is_expert else ps.get_tensor_model_parallel_group()
        full = mapping.merge(_gather(full, group, shard.size), plan.shape)
    copies = _copies(unit, plan)
    return _gather(full, ps.get_expert_model_parallel_group(), copies) if copies > 1 else [full]


def _materialise(
    bridge: Bridge, units: Sequence[Unit], local: LocalIndex, plan: Plan, sliced: Sequence[bool]
) -> list[list[torch.Tensor]]:
    """The unsharded tensors (this rank's TP slices where `sliced`) of a bucket's units on every rank.

    With PP > 1 the units of one owning stage (and dtype) travel as one flat broadcast per bucket, so a bucket
    costs a few collectives instead of one per tensor.
    """
    from megatron.core import parallel_state as ps

    stage = plan.stage
    out: list[list[torch.Tensor] | None] = [
        _owned(bridge, unit, local, plan, cut) if unit.stage == stage else None for unit, cut in zip(units, sliced)
    ]
    if plan.pp_size == 1:
        return out  # type: ignore[return-value]
    group = ps.get_pipeline_model_parallel_group()
    owners: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, unit in enumerate(units):
        owners.setdefault((unit.stage, unit.dtype), []).append(i)
    for (owner, dtype), members in owners.items():
        shapes = [_local_shape(unit, plan, bridge.table[unit.mapping_index]) if sliced[i] else unit.full_shape
                  for i in members for unit in [units[i]] for _ in range(_copies(unit, plan))]
        numels = [torch.Size(s).numel() for s in shapes]
        if owner == stage:
            owned = [t.reshape(-1) for i in members for t in out[i]]  # type: ignore[union-attr]
            flat = owned[0] if len(owned) == 1 else torch.cat(owned)  # a lone tensor is sent without a copy
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=_device())
        _collectives[0] += 1
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
    bridge: Bridge, unit: Unit, fulls: list[torch.Tensor], plan: Plan, sliced: bool, row_blocks: bool
) -> Iterator[tuple]:
    mapping = bridge.table[unit.mapping_index]
    shape, tag = plan.shape, ()
    if sliced:  # this rank's slice: the geometry of its own query groups, and which slice it is
        from megatron.core import parallel_state as ps

        tp, rank = plan.tp_size, ps.get_tensor_model_parallel_rank()
        shape = ModelShape(shape.num_heads // tp, shape.num_query_groups // tp, shape.head_dim)
        tag = (TpSlice(mapping.tp_dim, rank, tp),)  # type: ignore[arg-type]
    blocks = row_blocks and isinstance(mapping, FusedQKV)
    to_hf = mapping.to_hf_blocks if blocks else mapping.to_hf  # type: ignore[attr-defined]
    tag = (*tag, ROW_BLOCKS) if blocks else tag
    names = iter(unit.hf_names)  # every EP rank's HF names, in the order of `fulls`
    for full in fulls:
        for tensor in to_hf(full, shape):
            yield next(names), tensor if plan.dtype in (None, tensor.dtype) else tensor.to(plan.dtype), *tag


@dataclass
class ViewRecipe:
    """An export that ran no collective and yielded only views of the parameters' storages (TP 1 or TP slices,
    one stage, no dtype cast, no LoRA merge: what the one-copy sender shares), kept as geometry: while every
    parameter keeps its address and shape, the stream is one `as_strided` per tensor, not the walk's per-tensor
    mapping work (host time per tensor is what bounds a one-copy sync). It holds the Parameter objects, never a
    storage, so memory the trainer offloads is freed as before."""

    params: list[torch.nn.Parameter]
    addresses: list[tuple[int, int, torch.Size]]
    items: list[tuple]  # (index of a parameter of the same storage, name, shape, stride, offset, *tags)
    _owners: dict[int, int] = field(default_factory=dict, repr=False)  # storage address -> a parameter's index

    @staticmethod
    def signature(params: Sequence[torch.Tensor]) -> list[tuple[int, int, torch.Size]]:
        """Each parameter's storage, offset in it and shape: the items' offsets are into those storages."""
        return [(p.untyped_storage().data_ptr(), p.storage_offset(), p.shape) for p in params]

    @classmethod
    def start(cls, local: LocalIndex) -> ViewRecipe:
        params = [t.tensor for t, _ in local.values()]
        recipe = cls(params, cls.signature(params), [])
        recipe._owners = {p.untyped_storage().data_ptr(): i for i, p in enumerate(params)}
        return recipe

    def add(self, stream: Iterable[tuple]) -> bool:
        """Keep the geometry of each tensor of `stream`; False at the first that is not a view of a parameter's
        storage in its dtype (a merge, a cast, a copy: the walk must run every time). Keeps no tensor, so a walk
        being recorded frees its buckets as before."""
        for name, tensor, *tags in stream:
            owner = self._owners.get(tensor.untyped_storage().data_ptr())
            if owner is None or tensor.dtype != self.params[owner].dtype:
                return False
            self.items.append((owner, name, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), *tags))
        return True

    @classmethod
    def record(cls, local: LocalIndex, stream: Iterable[tuple]) -> ViewRecipe | None:
        recipe = cls.start(local)
        return recipe if recipe.add(stream) else None

    def valid(self) -> bool:
        """False once a parameter moved (offload, a rebuilt buffer): then the walk runs again."""
        return self.signature(self.params) == self.addresses

    def replay(self) -> Iterator[tuple]:
        params = [p.detach() for p in self.params]  # detached aliases for this stream only, not kept
        for owner, name, shape, stride, offset, *tags in self.items:
            yield (name, params[owner].as_strided(shape, stride, offset), *tags)


def export_stream(
    bridge: Bridge, chunks: Sequence[torch.nn.Module], *, dtype: torch.dtype | None = None, tp_slices: bool = False,
    row_blocks: bool = False,
) -> Iterator[tuple]:
    """(hf_name, tensor) per HF tensor; with `tp_slices`, (hf_name, slice, TpSlice) for the sliceable ones; with
    `row_blocks`, fused QKV's q/k/v as (hf_name, blocks, [TpSlice,] ROW_BLOCKS). An export that needs no
    collective and yields only parameter views is replayed from its ViewRecipe."""
    key = ("views", tuple(id(c) for c in chunks), dtype, tp_slices, row_blocks)
    recipe = bridge._export_plans.get(key)  # False: this export runs collectives or yields fresh tensors
    if recipe and recipe.valid():
        yield from recipe.replay()
        return
    ran = _collectives[0]
    recording = recipe is not False and ViewRecipe.start(_local_index(bridge, chunks))
    for bucket in _walk(bridge, chunks, None, dtype, tp_slices, row_blocks):
        if recording and (_collectives[0] != ran or not recording.add(bucket)):
            recording = bridge._export_plans[key] = False  # a layout's collectives and merges do not go away
        yield from bucket
    if recording:
        bridge._export_plans[key] = recording


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


def _local_index(bridge: Bridge, chunks: Sequence[torch.nn.Module]) -> LocalIndex:
    # Parameter objects outlive steps (optimizers and offloading change their data, not their identity), so
    # the name index is built once per model like the plan; rebuilding it cost as much as the stream itself.
    key = ("local", tuple(id(c) for c in chunks))
    if key not in bridge._export_plans:
        bridge._export_plans[key] = {t.name: (t, bridge.shard_of(t)) for t in bridge.local_tensors(chunks)}
    return bridge._export_plans[key]


def _walk(
    bridge: Bridge, chunks: Sequence[torch.nn.Module], bucket_bytes: int | None, dtype: torch.dtype | None,
    tp_slices: bool = False, row_blocks: bool = False,
) -> Iterator[list[tuple]]:
    plan = plan_for(bridge, chunks, dtype)
    key = ("bounds", id(plan), bucket_bytes)
    if key not in bridge._export_plans:
        bridge._export_plans[key] = bucket_bounds(plan, bucket_bytes)
    local = _local_index(bridge, chunks)
    with torch.no_grad():
        for start, stop in bridge._export_plans[key]:
            units = plan.units[start:stop]
            sliced = [tp_slices and sliceable(bridge, unit, plan) for unit in units]
            bucket: list[tuple] = []
            for unit, cut, fulls in zip(units, sliced, _materialise(bridge, units, local, plan, sliced)):
                bucket.extend(_hf_tensors(bridge, unit, fulls, plan, cut, row_blocks))
            yield bucket
