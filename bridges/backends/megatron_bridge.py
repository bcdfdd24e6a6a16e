"""`bridge.backend=megatron_bridge`: NVIDIA Megatron-Bridge behind the interface of `bridges.bridge.Bridge`.

Import-optional: Megatron-Bridge (0.6.x) needs Python >= 3.12 and imports TransformerEngine unconditionally, so
it cannot be installed on the CPU development machine and this adapter is UNTESTED here. It is written
against the documented API (`AutoBridge.from_hf_pretrained`, `to_megatron_provider`, `load_hf_weights`,
`export_hf_weights`, `save_hf_pretrained`); where Megatron-Bridge is installed (GPU clusters with TE), the engine
can pick it for architectures our tables do not cover.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mrl.utils.buckets import group_by_bytes

_PROVIDER_MODEL_KWARGS = {
    "vocab_size": "vocab_size",
    "max_sequence_length": "seq_length",
    "position_embedding_type": "position_embedding_type",
    "rotary_base": "rotary_base",
    "share_embeddings_and_output_weights": "share_embeddings_and_output_weights",
}


def _auto_bridge() -> Any:
    try:
        from megatron.bridge import AutoBridge
    except ImportError as error:
        raise ImportError(
            "bridge.backend=megatron_bridge needs the megatron-bridge package (Python >= 3.12 and "
            "TransformerEngine); use bridge.backend=mrl otherwise"
        ) from error
    return AutoBridge


class MegatronBridgeBackend:
    """Same methods as `Bridge`; the HF folder is taken from `hf_config.name_or_path`."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self._bridge = _auto_bridge().from_hf_pretrained(hf_config.name_or_path)
        self._provider: Any = None

    def transformer_config(self, **runtime: Any) -> Any:
        """Megatron-Bridge's model provider (a TransformerConfig subclass) with our runtime fields applied."""
        provider = self._bridge.to_megatron_provider(load_weights=False)
        for name, value in runtime.items():
            setattr(provider, name, value)
        if hasattr(provider, "finalize"):
            provider.finalize()
        self._provider = provider
        return provider

    def model_kwargs(self) -> dict[str, Any]:
        provider = self._provider or self.transformer_config()
        return {ours: getattr(provider, theirs) for ours, theirs in _PROVIDER_MODEL_KWARGS.items()}

    def check_coverage(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Megatron-Bridge validates its own mappings while loading."""

    def load_hf(self, chunks: Sequence[torch.nn.Module], folder: str | os.PathLike[str]) -> None:
        self._bridge.load_hf_weights(list(chunks), str(folder))

    def export(
        self, chunks: Sequence[torch.nn.Module], *, dtype: torch.dtype | None = None, tp_slices: bool = False,
        row_blocks: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors only (`tp_slices` and `row_blocks` are requests a weight sync may make; whole tensors
        always satisfy them)."""
        for name, tensor in self._bridge.export_hf_weights(list(chunks)):
            yield name, tensor if dtype is None else tensor.to(dtype)

    def export_buckets(
        self, chunks: Sequence[torch.nn.Module], bucket_bytes: int, *, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Greedy byte buckets over the stream (no precomputed plan: Megatron-Bridge streams one task at a time)."""
        return group_by_bytes(self.export(chunks, dtype=dtype), bucket_bytes)

    def save_hf(
        self,
        chunks: Sequence[torch.nn.Module],
        folder: str | os.PathLike[str],
        *,
        source: str | os.PathLike[str] | None = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 * 1024**3,
    ) -> None:
        self._bridge.save_hf_pretrained(list(chunks), str(folder))


__all__ = ["MegatronBridgeBackend"]
