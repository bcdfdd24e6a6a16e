"""Bridges by HF architecture name (`config.architectures[0]`), and the entry points that pick one.

Registration checks the table's shape (well-formed patterns, no Megatron pattern declared twice); whether the
table covers every Megatron parameter depends on the built model, so `Bridge.check_coverage` runs before every
import and by `verify(bridge, chunks)`, and fails with the list of unmapped names.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from bridges.bridge import Bridge

_BRIDGES: dict[str, type[Bridge]] = {}
_FAMILY_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


def register(*architectures: str) -> Callable[[type[Bridge]], type[Bridge]]:
    """Class decorator: make a bridge the one for these HF architecture names."""

    def add(cls: type[Bridge]) -> type[Bridge]:
        for arch in architectures:
            if arch in _BRIDGES and _BRIDGES[arch] is not cls:
                raise ValueError(f"{arch} already has a bridge: {_BRIDGES[arch].__name__}")
        cls.architectures = tuple(architectures)
        for arch in architectures:
            _BRIDGES[arch] = cls
        return cls

    return add


def verify(bridge: Bridge, chunks: Sequence[Any]) -> None:
    """Fail unless every Megatron parameter of `chunks` is covered, and each exactly once by pattern."""
    patterns = [m.megatron for m in bridge.table]
    doubled = sorted({p for p in patterns if patterns.count(p) > 1})
    if doubled:
        raise ValueError(f"{type(bridge).__name__} declares Megatron patterns more than once: {doubled}")
    bridge.check_coverage(chunks)


def register_verified(bridge: Bridge, chunks: Sequence[Any], *architectures: str) -> type[Bridge]:
    """Register `type(bridge)` only if its table covers `chunks` (a model built from `bridge`)."""
    verify(bridge, chunks)
    return register(*architectures)(type(bridge))


def _load_families() -> None:
    for module in _FAMILY_MODULES:
        importlib.import_module(f"bridges.families.{module}")


def architectures() -> list[str]:
    _load_families()
    return sorted(_BRIDGES)


def causal_lm_architecture(arch: str) -> str:
    """The causal LM whose bridge reads `arch`: a value model's folder (a trained critic, a token or sequence
    classifier as reward model) is the causal LM's body under a score head."""
    for head in ("ForTokenClassification", "ForSequenceClassification"):
        if arch.endswith(head):
            return arch.removesuffix(head) + "ForCausalLM"
    return arch


def bridge_for(hf_config: Any, *, backend: str = "mrl") -> Any:
    """The bridge of an HF config (by `architectures[0]`); `backend="megatron_bridge"` picks Megatron-Bridge."""
    if backend == "megatron_bridge":
        from bridges.backends.megatron_bridge import MegatronBridgeBackend

        return MegatronBridgeBackend(hf_config)
    if backend != "mrl":
        raise ValueError(f"bridge.backend must be 'mrl' or 'megatron_bridge', got {backend!r}")
    _load_families()
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch is None:
        # A config built in memory names no architecture; transformers' causal-LM class of its model type does.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""))
    if arch is not None:
        arch = causal_lm_architecture(arch)
    if arch not in _BRIDGES:
        raise KeyError(f"no bridge for HF architecture {arch!r}; known: {sorted(_BRIDGES)}")
    return _BRIDGES[arch](hf_config)


def bridge_from_hf(folder: str | os.PathLike[str], *, backend: str = "mrl") -> Any:
    """The bridge for the model in an HF folder (its config.json; never the hub)."""
    from transformers import AutoConfig

    return bridge_for(AutoConfig.from_pretrained(str(folder), local_files_only=True), backend=backend)
