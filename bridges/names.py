"""Canonical global Megatron names for the parameters of a sharded model chunk.

Local names differ from the canonical ones in three ways, undone here so that mapping tables are written once:
- layer indices are local to the pipeline stage / virtual chunk; the layer's `layer_number` (1-based, global)
  gives the global index;
- expert indices are local to the expert-parallel rank; the global id adds `ep_rank * local_experts`;
- TransformerEngine specs fuse norms into the next linear and group experts; their names are rewritten to
  the local-spec names (`input_layernorm.weight`, `local_experts.{j}.linear_fc1.weight`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# TE name → local-spec name. Written from megatron-core 0.19's TE layer specs; untested here (no TE on CPU).
_TE_ALIASES = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.self_attention\.linear_q_down_proj\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.self_attention\.linear_q_up_proj\.layer_norm_(weight|bias)$"), r".self_attention.q_layernorm.\1"),
    (re.compile(r"\.self_attention\.linear_kv_up_proj\.layer_norm_(weight|bias)$"), r".self_attention.kv_layernorm.\1"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"),
    (
        re.compile(r"\.mlp\.experts\.linear_fc(\d)\.(weight|bias)(\d+)$"),
        r".mlp.experts.local_experts.\3.linear_fc\1.\2",
    ),
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalTensor:
    """A parameter (or persistent buffer) of this rank under its canonical global name."""

    name: str
    local_name: str
    tensor: torch.Tensor
    is_expert: bool
    local_expert: int | None  # index among this rank's experts (EP gathers the same index from every rank)


def canonical_name(local_name: str, layer_numbers: dict[int, int], expert_offset: int) -> str:
    """Global local-spec name of a chunk's parameter; `layer_numbers` maps local layer index → global index."""
    name = local_name
    for pattern, repl in _TE_ALIASES:
        name = pattern.sub(repl, name)
    found = _LAYER.match(name)
    if found:
        name = f"decoder.layers.{layer_numbers[int(found.group(1))]}." + name[found.end() :]
    found = _EXPERT.search(name)
    return with_expert(name, int(found.group(1)) + expert_offset) if found else name


def with_expert(name: str, expert: int) -> str:
    """`name` with its expert index replaced."""
    found = _EXPERT.search(name)
    if found is None:
        raise ValueError(f"{name!r} is not an expert parameter")
    return name[: found.start()] + f".mlp.experts.local_experts.{expert}." + name[found.end() :]


def _persistent_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set and buf.is_floating_point():
                yield (f"{prefix}.{name}" if prefix else name), buf


def local_tensors(chunk: torch.nn.Module, ep_rank: int, ep_size: int) -> list[LocalTensor]:
    """Every parameter and persistent floating-point buffer of a model chunk, canonically named."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    model = chunk
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    layer_numbers: dict[int, int] = {}
    if hasattr(model, "decoder"):
        for i, layer in enumerate(model.decoder.layers):
            if isinstance(layer, TransformerLayer):
                layer_numbers[i] = layer.layer_number - 1
    num_experts = getattr(model.config, "num_moe_experts", None) or 0
    local_experts = num_experts // ep_size
    out = []
    for local_name, tensor in _persistent_tensors(model):
        name = canonical_name(local_name, layer_numbers, ep_rank * local_experts)
        # Megatron marks expert parameters with allreduce=False: they are split over expert-TP, not TP.
        is_expert = getattr(tensor, "allreduce", True) is False
        found = _EXPERT.search(name)
        local_expert = int(found.group(1)) - ep_rank * local_experts if (found and is_expert) else None
        out.append(LocalTensor(name, local_name, tensor, is_expert, local_expert))
    return out
