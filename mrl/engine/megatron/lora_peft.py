"""Adapter-only export (actor.lora.sync=adapter): the actor's LoRA A and B as an HF PEFT adapter folder.

An adapter's factor that is split over TP (B of a column-parallel layer, A of a row-parallel one) is split exactly
like the base weight's rows or columns, so the bridge mapping of that weight (TP merge, then the HF split of a
fused QKV into q/k/v or of fc1 into gate/up) turns it into the HF per-projection factors; the other factor is whole
on every TP rank and shared by those projections (q, k and v read the same A). PEFT names follow the HF names
(`base_model.model.<hf module>.lora_A.weight`); vLLM packs q/k/v and gate/up back into its fused layers itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

SYNC_MODES = ("merged", "adapter")
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def peft_name(hf_weight: str, factor: str) -> str:
    """(`model.layers.0.self_attn.q_proj.weight`, "A") -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A
    .weight`: PEFT's name of one factor of the adapter on that HF weight."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()  # an own copy: q, k and v must not share storage


def stage_tensors(bridge: Any, chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters, PEFT-named host tensors (the same on every TP rank; collective over TP)."""
    from bridges.export import _gather

    shape = bridge.chunk_shape(chunks)
    out: dict[str, torch.Tensor] = {}
    for local in bridge.local_tensors(chunks):
        adapter = getattr(local.tensor, "lora_adapter", None)
        if adapter is None:
            continue
        resolved = bridge.resolve(local.name)
        mapping = resolved.mapping
        split, whole = (adapter.b, adapter.a) if adapter.column else (adapter.a, adapter.b)
        split_name, whole_name = ("B", "A") if adapter.column else ("A", "B")
        split = split.detach()
        tp = adapter.tp_group.size()
        if tp > 1:
            split = mapping.merge(_gather(split, adapter.tp_group, tp), shape)
        for hf, part in zip(mapping.export_names(resolved.indices), mapping.to_hf(split, shape), strict=True):
            out[peft_name(hf, split_name)] = _host(part)
            out[peft_name(hf, whole_name)] = _host(whole)
    return out


def gather_tensors(bridge: Any, chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's adapters on global rank 0 ({} elsewhere); every rank of the actor must call it."""
    from megatron.core import parallel_state as ps

    mine = stage_tensors(bridge, chunks)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine if dist.get_rank() == 0 else {}
    group = ps.get_pipeline_model_parallel_group()
    first = dist.get_global_rank(group, 0)
    stages: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size(group))]
    dist.gather_object(mine, stages if dist.get_rank() == first else None, dst=first, group=group)
    if dist.get_rank() != 0:
        return {}
    return {name: t for stage in stages for name, t in stage.items()}  # type: ignore[union-attr]


def adapter_config(settings: Any, tensors: dict[str, torch.Tensor], base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json: rank and alpha as the trainer's (vLLM scales by lora_alpha / r, as we do)."""
    modules = sorted({name.split(".")[-3] for name in tensors})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": int(settings.rank), "lora_alpha": float(settings.alpha), "lora_dropout": float(settings.dropout),
        "target_modules": modules, "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True,
    }


class AdapterFolders:
    """Version-stamped PEFT folders under one root (`actor.lora.adapter_dir`, default a new folder on /dev/shm):
    the newest is kept (an engine may re-read it), the one it replaced is deleted."""

    def __init__(self, root: str = "") -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        # absolute: the engines resolve it in their own processes, whose working directory may differ
        self.root = os.path.abspath(root) if root else tempfile.mkdtemp(prefix="mrl-lora-", dir=shm)
        self.current: str | None = None

    def path(self, version: int) -> str:
        return os.path.join(self.root, f"v{int(version)}")

    def replace(self, new: str) -> None:
        old, self.current = self.current, new
        if old is not None and old != new:
            shutil.rmtree(old, ignore_errors=True)


def write_folder(folder: str, tensors: dict[str, torch.Tensor], settings: Any, base_model: str) -> int:
    """Write a PEFT adapter folder; returns the bytes of its tensors."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(adapter_config(settings, tensors, base_model), f, indent=2)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE))
    return sum(t.numel() * t.element_size() for t in tensors.values())
