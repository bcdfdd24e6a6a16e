"""Rotary embeddings of a packed (THD) row in one pass over the row instead of one pass per document.

Without TransformerEngine, Megatron's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`) splits the row by
`cu_seqlens` and rotates each document on its own: for q and k of every layer, a handful of small ops per document
forward and again backward. An RL micro-batch packs many short responses (64 of 20 tokens in the tiny demo), so
that loop was ~25% of a tiny actor update on CPU (cProfile). Here each token looks up the frequencies of its
position inside its document and the whole row is rotated by the same elementwise formula
(`_apply_rotary_pos_emb_bshd`), so outputs and gradients are bit-identical to the loop's.
Context parallelism and rows whose frequencies already cover the packed row keep Megatron's path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_megatron_thd: Any = None


def install() -> None:
    """Route Megatron's unfused THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    global _megatron_thd
    from megatron.core.models.common.embeddings import rope_utils

    if _megatron_thd is None:
        _megatron_thd = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd


def positions_in_documents(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every token of a packed row inside its own document ([0, 1, …, 0, 1, …])."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts


# (offsets tensor, device) → positions on that device. Megatron hands every layer's q and k the same offsets
# tensor of a micro-batch; without TE it is a host tensor (mrl.engine.megatron.packing), and a blocking host → GPU
# copy per call would synchronise the host with the GPU twice per layer. One cached copy per micro-batch instead.
_positions_cache: tuple[Tensor, torch.device, Tensor] | None = None


def _device_positions(cu_seqlens: Tensor, total: int, device: torch.device) -> Tensor:
    global _positions_cache
    cached = _positions_cache
    if cached is not None and cached[0] is cu_seqlens and cached[1] == device:
        return cached[2]
    positions = positions_in_documents(cu_seqlens, total).to(device, non_blocking=True)
    _positions_cache = (cu_seqlens, device, positions)  # holding the key keeps its identity unique
    return positions


def apply_rotary_pos_emb_thd(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    cp_group: Any = None,
    multi_latent_attention: bool | None = None,
) -> Tensor:
    """Megatron's `_apply_rotary_pos_emb_thd` signature: t [T, heads, d], freqs [max_len, 1, 1, d]."""
    from megatron.core.models.common.embeddings import rope_utils

    total = t.size(0)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    megatron_path = (
        cp_group is None or cp_group.size() != 1 or multi_latent_attention is not None
        or freqs.size(0) == total or int(cu_seqlens[-1]) != total or int(lengths.max()) > freqs.size(0)
    )
    if megatron_path:
        return _megatron_thd(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                             mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                             multi_latent_attention=multi_latent_attention)
    per_token = freqs[_device_positions(cu_seqlens, total, freqs.device)]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), per_token, rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
    ).squeeze(1)
