"""One-copy loading into a vLLM model: each HF-named tensor is copied straight into the part of the engine parameter
that the model's own `load_weights` would write (weight_sync.one_copy; mrl/weight_sync/handles.py brings the
tensors as views of the trainer's memory).

The destinations come from the model itself: `packed_modules_mapping` names the HF shards of a fused module
(qkv_proj ← q/k/v, gate_up_proj ← gate/up) and the layer's `output_partition_sizes`, TP rank and KV-head replicas
give each shard's rows in the parameter and the rows of the full tensor that belong to this rank, as vLLM's
weight loaders compute them. Only layers whose post-load processing leaves the loaded tensors as they are qualify
(`direct_loadable`: CUDA; unquantized linear and embedding methods, KV-cache scale methods, and block FP8 on the
CUTLASS or Triton GEMM, whose scales `weight_scale_inv` land block row by block row as vLLM's loaders place them);
any tensor without a destination goes through `model.load_weights`, which on such a model is also one copy per
tensor. The worker extension uses it for every transport sync of such a model, whether the tensors are views of the
trainer's memory (weight_sync.one_copy) or of a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mrl.weight_sync.handles import copy_all, parts, whole


@dataclass(frozen=True)
class Destination:
    """Rows `start … start+length` along `dim` of parameter `param` receive rows `src_start …` of the full HF tensor
    along the same dim (`length` None: the whole parameter takes the whole tensor). `zero_rest`: the parameter's
    rows past the tensor are padding the loader zeroes (vocabulary)."""

    param: str
    dim: int | None = None
    start: int = 0
    length: int | None = None
    src_start: int = 0
    zero_rest: bool = False

    def source(self, tensor: torch.Tensor, tp_slice: list | None = None, blocks: bool = False) -> torch.Tensor | None:
        """This rank's part of the full tensor, or of a TP slice [dim, rank, size] of it (None if the slice does not
        hold it). `blocks`: the tensor comes as row blocks [blocks, rows, *rest] (handles.py); its part is whole
        blocks, or rows of one block as [1, rows, *rest] (None if they span a cut block)."""
        if self.dim is None or self.length is None:
            return None if tp_slice else tensor
        if blocks and (self.dim != 0 or self.zero_rest):
            return None
        rows = tensor.shape[1] if blocks else 1  # HF rows per index along dim
        extent = tensor.shape[self.dim] * rows
        if self.zero_rest and extent != self.length:
            return None  # not the unpadded vocabulary: the loader's own check reports it
        start = self.src_start
        if not tp_slice and start == 0 and self.length == extent:
            return tensor  # the whole tensor: no view to make (host time per tensor is what a sync adds)
        if tp_slice:
            dim, rank, _ = tp_slice
            first = rank * extent
            if dim != self.dim or not first <= start <= start + self.length <= first + extent:
                return None
            start -= first
        if start % rows or self.length % rows:  # e.g. one query group split over TP ranks
            block, offset = divmod(start, rows)
            return tensor.narrow(0, block, 1).narrow(1, offset, self.length) if offset + self.length <= rows else None
        return tensor.narrow(self.dim, start // rows, self.length // rows)

    def view(self, param: torch.Tensor) -> torch.Tensor:
        return param if self.dim is None or self.length is None else param.narrow(self.dim, self.start, self.length)


def direct_loadable(model: torch.nn.Module) -> str | None:
    """None if every layer of `model` loads by a plain copy (its post-load processing, if any, leaves the loaded
    tensors as they are); else why not."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return f"platform {current_platform.device_type}: its unquantized layers repack weights after loading"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not _loads_as_is(method):
            kernel = getattr(method, "fp8_linear", None)
            return (f"layer {name} uses {type(method).__name__}"
                    + (f" on {type(kernel).__name__}" if kernel is not None else "") + " (post-load processing)")
    if missing := unplaced_block_fp8(model, destination_map(model)):
        return f"no destination for {missing[0]} and {len(missing) - 1} more block-FP8 parameters"
    return None


def unplaced_block_fp8(model: torch.nn.Module, destinations: dict[str, Destination]) -> list[str]:
    """Parameters of block-FP8 layers that no destination writes. After vLLM's post-load step their own loaders
    cannot write them any more (plain Parameters), so a direct load must place every one of them itself."""
    placed = {d.param for d in destinations.values()}
    return [f"{name}.{leaf}" for name, module in model.named_modules() if getattr(module, "weight_block_size", None)
            for leaf, _ in module.named_parameters(recurse=False) if f"{name}.{leaf}" not in placed]


def _loads_as_is(method: Any) -> bool:
    """Whether a layer's quant method keeps what its weight loaders wrote: unquantized layers; KV-cache scale methods
    (a sync brings no k/v scales: nothing is loaded into them); block FP8 on the CUTLASS or Triton GEMM, whose
    post-load step changes nothing on CUDA (it converts to e4m3fnuz on ROCm; DeepGEMM's re-lays the scales out and
    Marlin repacks the weights, so those take the layer-wise reload)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if isinstance(method, UnquantizedLinearMethod | UnquantizedEmbeddingMethod | BaseKVCacheMethod):
        return True
    return (type(method) is Fp8LinearMethod and method.block_quant and not method.use_marlin
            and type(method.fp8_linear) in (CutlassFp8BlockScaledMMKernel, TritonFp8BlockScaledMMKernel))


def _dims(layer: Any, leaf: str, param: torch.Tensor) -> tuple[int | None, int | None, int]:
    """(output dim, input dim, weight rows per index along the output dim) of a layer's parameter. Block FP8's
    post-load step re-registers its weight and `weight_scale_inv` as plain Parameters (`replace_parameter`), without
    vLLM's dim attributes: they are [N, K] and [ceil(N / bn), ceil(K / bk)] blocks, split as vLLM's loaders split
    them before that step."""
    out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    block = getattr(layer, "weight_block_size", None)
    if block and leaf in ("weight", "weight_scale_inv"):
        out_dim, in_dim = (0 if out_dim is None else out_dim), (1 if in_dim is None else in_dim)
    return out_dim, in_dim, int(block[0]) if block and leaf == "weight_scale_inv" else 1


def _shards(layer: Any, leaf_name: str, packed: dict[str, list[str]], block: int
            ) -> list[tuple[str, int, int, int]] | None:
    """(HF module name, offset, length, source start) of each shard of a fused column-parallel layer, this rank, in
    units of `block` rows (a block-FP8 scale's; partial edge blocks count whole, as vLLM's loader counts them)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    parts = packed.get(leaf_name)
    sizes = list(getattr(layer, "output_partition_sizes", []))
    if not parts or len(parts) != len(sizes):
        return None
    out, offset = [], 0
    for i, (part, size) in enumerate(zip(parts, sizes)):
        if isinstance(layer, QKVParallelLinear):
            shard_rank = layer.tp_rank if i == 0 else layer.tp_rank // layer.num_kv_head_replicas
        elif isinstance(layer, MergedColumnParallelLinear):
            shard_rank = layer.tp_rank
        else:
            return None
        blocks = -(-size // block)
        out.append((part, -(-offset // block), blocks, shard_rank * blocks))
        offset += size
    return out


def destination_map(model: torch.nn.Module) -> dict[str, Destination]:
    """HF tensor name → its destination in `model` (only the tensors whose loader is a plain narrowed copy)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    out: dict[str, Destination] = {}
    for pname, param in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        layer = modules.get(module_name)
        prefix, _, own = module_name.rpartition(".")
        out_dim, in_dim, block = _dims(layer, leaf, param)
        if isinstance(layer, QKVParallelLinear | MergedColumnParallelLinear):
            shards = _shards(layer, own, packed, block)
            if shards is None or out_dim is None:
                continue
            for part, offset, size, src in shards:
                hf = f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"
                out[hf] = Destination(pname, out_dim, offset, size, src)
        elif isinstance(layer, VocabParallelEmbedding):
            if layer.tp_size == 1 and leaf == "weight":
                out[pname] = Destination(pname, 0, 0, layer.org_vocab_size, 0, zero_rest=True)
        elif isinstance(layer, ColumnParallelLinear):
            if layer.tp_size == 1 or out_dim is None:
                out[pname] = Destination(pname)
            else:
                size = param.shape[out_dim]
                out[pname] = Destination(pname, out_dim, 0, size, layer.tp_rank * size)
        elif isinstance(layer, RowParallelLinear):
            if layer.tp_size == 1 or in_dim is None:
                out[pname] = Destination(pname)  # a row-parallel bias is whole on every rank
            else:
                size = param.shape[in_dim]
                out[pname] = Destination(pname, in_dim, 0, size, layer.tp_rank * size)
        elif isinstance(layer, ReplicatedLinear | RMSNorm):
            out[pname] = Destination(pname)
    return out


class DirectLoader:
    """Loads buckets of (name, tensor, *tags) (a TP slice, row blocks: handles.HandleReader with keep_parts) by
    copying into destination views; the rest through `model.load_weights`. Counts tensors and bytes of each way."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.map = destination_map(model)
        self.stats = {"direct_tensors": 0, "direct_bytes": 0, "loader_tensors": 0, "loader_bytes": 0}
        # (name, source shape) -> the parameter view it is copied into, made on first use: a sync's host time is
        # per tensor, and the views stay valid while the parameters keep their memory (checked by `begin`)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._addresses = self._param_addresses()

    def _param_addresses(self) -> list[int]:
        return [p.data.data_ptr() for p in self.params.values()]

    def begin(self) -> None:
        """A new sync: zero the counts; forget the views if a parameter's memory moved (its data was replaced)."""
        self.stats = dict.fromkeys(self.stats, 0)
        addresses = self._param_addresses()
        if addresses != self._addresses:
            self._views, self._addresses = {}, addresses

    def _view(self, name: str, dest: Destination, src: torch.Tensor, blocks: bool) -> torch.Tensor:
        key = (name, tuple(src.shape))
        if (view := self._views.get(key)) is None:
            view = dest.view(self.params[dest.param].data)
            if blocks and view.shape[:1] == (src.shape[0] * src.shape[1],):
                view = view.unflatten(0, src.shape[:2])  # row blocks land in [blocks, rows, *rest] of its rows
            if view.shape != src.shape:
                raise ValueError(f"one-copy load: {name} {tuple(src.shape)} does not fit {dest.param}"
                                 f"{tuple(view.shape)} at {dest}")
            self._views[key] = view
        return view

    def load(self, named: list[tuple]) -> None:
        rest, pairs = [], []
        for name, tensor, *tags in named:
            tp_slice, blocks = parts(tags)
            dest = self.map.get(name)
            src = dest.source(tensor, tp_slice, blocks) if dest is not None else None
            nbytes = tensor.numel() * tensor.element_size()
            if src is None:
                rest.append((name, whole(tensor, tp_slice, blocks)))
                self.stats["loader_tensors"] += 1
                self.stats["loader_bytes"] += nbytes
                continue
            pairs.append((self._view(name, dest, src, blocks), src))
            if dest.zero_rest and (param := self.params[dest.param].data).shape[0] > dest.start + src.shape[0]:
                param[dest.start + src.shape[0]:].zero_()
            self.stats["direct_tensors"] += 1
            self.stats["direct_bytes"] += nbytes
        copy_all(pairs)
        if rest:
            self.model.load_weights(weights=rest)
