"""Core attention on torch SDPA for Megatron's local (non-TransformerEngine) layer spec, packing-aware.

Megatron's `DotProductAttention` refuses packed sequences and materialises the S×S scores. `SdpaAttention` takes
its place in the spec (same constructor and forward signature) and computes, per head h and document d,

    out[d, h] = softmax(q[d, h] k[d, g(h)]ᵀ · scale + causal) v[d, g(h)],   g(h) = h // (heads / kv_groups)

with `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels where available). In
THD format (`packed_seq_params.qkv_format == "thd"`, tensors [t, heads, dim]) documents are the `cu_seqlens`
segments and never see each other; each runs as its own causal SDPA call, so no T×T mask is ever built. GQA uses
`enable_gqa=True`, so K/V are not repeated in memory. Under tensor parallelism Megatron hands this module the
local heads (heads/TP, groups/TP) already, so nothing here depends on the TP size beyond the head counts.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor


class SdpaAttention(MegatronModule):
    """Drop-in `core_attention` for `get_gpt_layer_local_spec`; see the module docstring for the formula."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SdpaAttention does not implement context parallelism; it needs TransformerEngine")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("SdpaAttention supports full causal attention with a vanilla softmax only")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        head_dim = config.kv_channels
        self.hidden_per_partition = self.heads * head_dim
        # Megatron's apply_query_key_layer_scaling divides and re-multiplies by the layer number: a no-op in
        # exact arithmetic, so only the plain 1/sqrt(d) (or the given scale) matters here.
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        # q [..., heads, s, d], k/v [..., groups, s, d]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.groups != self.heads,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """THD: [t, heads, d] → [t, heads·d]; otherwise [s, b, heads, d] → [s, b, heads·d]."""
        if attention_bias is not None:
            raise ValueError("SdpaAttention does not take an attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params.cu_seqlens_q, causal)
        # [s, b, h, d] → [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            # Megatron masks are True where attention is NOT allowed; SDPA's boolean masks are the opposite.
            mask = ~attention_mask.bool()
            causal = False
        out = self._sdpa(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_per_partition)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, causal: bool) -> Tensor:
        bounds = cu_seqlens.tolist()
        out = query.new_empty(query.shape[0], self.hidden_per_partition)
        for start, end in itertools.pairwise(bounds):
            if end == start:
                continue
            # [len, h, d] → [1, h, len, d]: one document as a batch of one (4-D inputs reach the flash kernels)
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out[start:end] = self._sdpa(q, k, v, None, causal)[0].transpose(0, 1).reshape(end - start, -1)
        return out


def sdpa_layer_spec(config: TransformerConfig, *, vp_stage: int | None = None):
    """The local (non-TE) decoder block spec of this stage (mrl.engine.megatron.model.layer_spec) with
    `SdpaAttention` wherever Megatron's `DotProductAttention` was; MLA layers keep their own core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mrl.engine.megatron.model import layer_spec

    spec = layer_spec(config, use_te=False, vp_stage=vp_stage)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = SdpaAttention
    return spec
