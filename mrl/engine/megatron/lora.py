"""LoRA on megatron-core's parallel linear layers: y = W x + (alpha / r) · B A x, the base W frozen.

Adapters are sharded like the layer they wrap, so no layer sees a full-size adapter it does not need:
- column-parallel (linear_qkv, linear_fc1; W split on its output rows): A [r, in] whole on every TP rank,
  B [out/tp, r] split like W. The TP ranks' gradients of A are summed by an all-reduce of dL/d(Ax) (Megatron's
  copy-to-TP region), so A's gradient is whole and identical on every rank.
- row-parallel (linear_proj, linear_fc2; W split on its input columns): A [r, in/tp] split like W, B [out, r]
  whole. The partial A x are summed over TP (reduce-from-TP region) before B; with sequence parallelism B's
  output is then scattered along the sequence as the base's output is.
The adapter hangs off the base module as a child (`<layer>.lora.a`, `.b`) and runs in a forward hook, so base
parameter names (bridge mappings, checkpoints) are unchanged. B starts at zero: step 0 equals the base model.
Each adapter's A is drawn from a generator seeded by (init_seed, global layer number, target), whole, then
sliced: every TP/PP layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Megatron's names of the dense layers LoRA wraps: column-parallel (True) or row-parallel (False).
TARGETS = {"linear_qkv": True, "linear_proj": False, "linear_fc1": True, "linear_fc2": False}


class LoRAAdapter(nn.Module):
    def __init__(self, base: nn.Module, column: bool, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator, gated: bool = False) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.column = column
        self.scale = alpha / rank
        self.dropout = dropout
        self.active = True
        # a gated MLP's fc1 (SwiGLU): its rows are [gate; up] per TP shard (checkpoint resharding needs it)
        self.gated = gated
        self.tp_group = base.tp_group
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        weight = base.weight
        in_full, out_full = base.input_size, base.output_size
        # PEFT's default: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(in_full)
        a_full = torch.empty(rank, in_full, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        if column:
            a = a_full
            b = torch.zeros(out_full // tp, rank)
        else:
            a = a_full.chunk(tp, dim=1)[tp_rank]
            b = torch.zeros(out_full, rank)
        self.a = nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.b = nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
        # The split factor carries Megatron's TP attributes (grad-norm counting, checkpoint sharding); the whole
        # one is a TP duplicate, counted once.
        set_tensor_model_parallel_attributes(self.b if column else self.a, True, 0 if column else 1, 1)

    def delta(self) -> torch.Tensor:
        """scale · B A in the layout of this rank's shard of the base weight."""
        return (self.b.float() @ self.a.float()) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        group = self.tp_group
        if self.column:
            if self.sequence_parallel:
                # dL/dx of this path is already whole (from the summed dL/d(Ax)): split it, do not reduce it.
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
            if self.training and self.dropout:
                x = F.dropout(x, self.dropout)  # x is whole: the default generator, the same on every TP rank
            h = mappings.copy_to_tensor_model_parallel_region(F.linear(x, self.a), group=group)
            return F.linear(h, self.b) * self.scale
        if self.training and self.dropout:
            with get_cuda_rng_tracker().fork():  # x is this rank's slice: the TP-distinct generator
                x = F.dropout(x, self.dropout)
        h = mappings.reduce_from_tensor_model_parallel_region(F.linear(x, self.a), group=group)
        y = F.linear(h, self.b) * self.scale
        return mappings.scatter_to_sequence_parallel_region(y, group=group) if self.sequence_parallel else y


def _hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    adapter: LoRAAdapter = module.lora  # type: ignore[assignment]
    if not adapter.active:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def _merged(module: nn.Module) -> torch.Tensor:
    weight = module.weight.detach()
    adapter: LoRAAdapter = module.lora  # type: ignore[assignment]
    return (weight.float() + adapter.delta()).to(weight.dtype)


def _sharded_state_dict(module: nn.Module, own: Any, prefix: str = "", sharded_offsets: tuple = (),
                        metadata: dict | None = None) -> dict:
    """The base layer's sharded state with its adapter's entries resharded: the base treats every key but its
    weight and bias as TP-replicated, while B (column) or A (row) is split like the weight."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    state = own(prefix, sharded_offsets, metadata)
    adapter: LoRAAdapter = module.lora  # type: ignore[assignment]
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    adapter_state = {"lora.a": adapter.a, "lora.b": adapter.b}
    sharded = make_sharded_tensors_for_checkpoint(
        adapter_state, prefix, {"lora.b": 0} if adapter.column else {"lora.a": 1}, sharded_offsets,
        tp_group=adapter.tp_group, dp_cp_group=metadata["dp_cp_group"])
    if adapter.gated:  # B's rows are [gate; up] per TP shard, like the gated fc1 weight: Megatron's SwiGLU factory
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora.b"
        sharded[key] = apply_swiglu_sharded_factory(
            sharded[key], sharded_offsets, metadata.get("singleton_local_shards", False),
            tp_group=adapter.tp_group, dp_group=metadata["dp_cp_group"])
    state.update(sharded)
    return state


def apply(chunks: Sequence[nn.Module], settings: Any) -> list[LoRAAdapter]:
    """Freeze every parameter of `chunks` and add adapters to the target layers; returns the adapters.

    The base weight of each adapted layer gets `export_value` (the merged W + scale·B A of this rank's shard),
    which the bridge's export reads instead of the weight (bridges/export.py), so every weight-sync transport
    and the TP-slice path send merged weights unchanged.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    targets = list(settings.target_modules)
    adapters = []
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        for name, module in list(layer.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in targets or ".experts" in name or "shared_experts" in name:
                continue
            column = TARGETS[leaf]
            if not isinstance(module, ColumnParallelLinear if column else RowParallelLinear):
                raise NotImplementedError(
                    f"actor.lora: {name} is {type(module).__name__}; LoRA wraps megatron-core's local "
                    f"ColumnParallelLinear/RowParallelLinear (TransformerEngine layers are not wrapped yet)")
            seed = (int(settings.init_seed) * 1_000_003 + layer.layer_number) * len(TARGETS)
            generator = torch.Generator().manual_seed(seed + list(TARGETS).index(leaf))
            module.lora = LoRAAdapter(module, column, int(settings.rank), float(settings.alpha),
                                      float(settings.dropout), generator,
                                      gated=leaf == "linear_fc1" and bool(module.config.gated_linear_unit))
            module.register_forward_hook(_hook)
            module.weight.export_value = lambda m=module: _merged(m)
            module.weight.lora_adapter = module.lora  # the adapter-only export finds it by the weight's name
            module.sharded_state_dict = functools.partial(_sharded_state_dict, module, module.sharded_state_dict)
            adapters.append(module.lora)
    if not adapters:
        raise ValueError(f"actor.lora.target_modules={targets}: no layer of this model matches")
    return adapters


SETTINGS_FILE = "lora.json"


def write_settings(checkpoint_dir: str, settings: Any) -> None:
    """The adapters' settings beside an engine checkpoint that holds them."""
    fields = ("enable", "rank", "alpha", "dropout", "target_modules", "init_seed")
    values = {k: list(v) if k == "target_modules" else v for k in fields for v in [getattr(settings, k)]}
    with open(os.path.join(checkpoint_dir, SETTINGS_FILE), "w") as f:
        json.dump(values, f, indent=2)


def read_settings(checkpoint_dir: str) -> Any:
    """The LoRAConfig a checkpoint was trained with, or None (no adapters)."""
    from mrl.config.schema import LoRAConfig

    path = os.path.join(checkpoint_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return LoRAConfig(**json.load(f))


@contextlib.contextmanager
def disabled(adapters: Sequence[LoRAAdapter]) -> Iterator[None]:
    """The base model: every adapter skipped (the reference policy of a LoRA run)."""
    for adapter in adapters:
        adapter.active = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.active = True
