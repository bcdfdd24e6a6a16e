"""Core attention on torch SDPA for Megatron's local (non-TransformerEngine) layer spec, packing-aware.

Megatron's `DotProductAttention` refuses packed sequences and materialises the S×S scores. `SdpaAttention` takes
its place in the spec (same constructor and forward signature) and computes, per head h and document d,

    out[d, h] = softmax(q[d, h] k[d, g(h)]ᵀ · scale + causal) v[d, g(h)],   g(h) = h // (heads / kv_groups)

with `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels where available). In
THD format (`packed_seq_params.qkv_format == "thd"`, tensors [t, heads, dim]) documents are the `cu_seqlens`
segments and never see each other, and no T×T mask is ever built:
- CUDA, fp16/bf16: one call of PyTorch's variable-length flash-attention kernel over the whole packed row
  (`aten._flash_attention_forward/backward` with `cu_seqlens`, as `torch.nn.attention.varlen` uses them), which
  takes grouped K/V natively and needs no host synchronisation;
- otherwise (CPU, fp32): one causal SDPA call per document, exact against the reference attention. On CPU in
  bf16/fp16 a document shorter than `CPU_FP32_BACKWARD_BELOW` runs the same flash forward but its backward in fp32
  from the forward's log-sum-exp (`_CpuFlashFp32Backward`): faster there, and closer to exact.
GQA never repeats K/V in memory (`enable_gqa=True` for SDPA). Under tensor parallelism Megatron hands this module
the local heads (heads/TP, groups/TP) already, so nothing here depends on the TP size beyond the head counts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

# Use the variable-length flash kernel for packed rows where it applies, and the compiled RMSNorm where enabled
# (tools/bench/engine.py switches each off to measure it).
FLASH_VARLEN = True
COMPILE_NORM = True
# PyTorch's CPU flash backward is slower in bf16 than in fp32 for short documents (2 cores, 8 heads of 64: 64
# tokens 2.9x, 128: 2.2x, 256: 1.2x, 384: 1.05x; from 512 on bf16 is faster), so shorter ones run it in fp32.
CPU_FP32_BACKWARD_BELOW = 384


class _FlashVarlen(torch.autograd.Function):
    """Causal (or full) attention over the documents `cu` of a packed [t, heads, d] row; K/V may hold fewer heads."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float, causal: bool):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale, ctx.causal = max_len, scale, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            ctx.max_len,
            ctx.max_len,
            0.0,
            ctx.causal,
            rng,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None


class _CpuFlashFp32Backward(torch.autograd.Function):
    """Attention of a [b, heads, s, d] batch on CPU: PyTorch's flash forward in the input's precision (what SDPA
    runs, bit for bit), and its flash backward on fp32 copies with the forward's log-sum-exp and output. Against
    an fp64 reference the bf16 gradients of K and V come out about twice as close as the bf16 backward's."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(x.float() for x in (grad, q, k, v, out)), lse, 0.0, ctx.causal, scale=ctx.scale
        )
        return *(g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None


@functools.cache
def _flash_supports(head_dim: int) -> bool:
    # PyTorch's flash kernels: Ampere or newer, head sizes up to 256 in multiples of 8; otherwise per-document SDPA.
    return torch.cuda.get_device_capability()[0] >= 8 and head_dim % 8 == 0 and head_dim <= 256


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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
            dropout_p=self.training_dropout,
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
            if self._use_flash_varlen(query):
                q, k, v = (_last_dim_contiguous(x) for x in (query, key, value))
                cu, max_len = packed_seq_params.cu_seqlens_q, int(packed_seq_params.max_seqlen_q)
                out = _FlashVarlen.apply(q, k, v, cu, max_len, self.scale, causal)
                return out.reshape(query.shape[0], self.hidden_per_partition)
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

    @property
    def training_dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def _use_flash_varlen(self, query: Tensor) -> bool:
        half = query.dtype in (torch.float16, torch.bfloat16)
        usable = FLASH_VARLEN and query.is_cuda and half and not self.training_dropout
        return usable and _flash_supports(query.shape[-1])

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, causal: bool) -> Tensor:
        # Split and concatenate (one autograd node each) rather than slicing per document and writing into an
        # output buffer: each slice's backward allocated and accumulated a full-size gradient (3.3x slower
        # backward at 64 documents on CPU), with bit-identical results.
        lengths = torch.diff(cu_seqlens).tolist()
        fp32_backward_below = 0
        if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and not self.training_dropout:
            fp32_backward_below = CPU_FP32_BACKWARD_BELOW
        out = []
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
            if q.shape[0] == 0:
                out.append(q.new_empty(0, self.hidden_per_partition))
                continue
            # [len, h, d] → [1, h, len, d]: one document as a batch of one (4-D inputs reach the flash kernels)
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            if q.shape[2] < fp32_backward_below:
                o = _CpuFlashFp32Backward.apply(q, k, v, self.scale, causal)
            else:
                o = self._sdpa(q, k, v, None, causal)
            out.append(o[0].transpose(0, 1).reshape(q.shape[2], -1))
        return torch.cat(out)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@functools.cache
def _compiled_rms_norm() -> Any:
    return torch.compile(_rms_norm, dynamic=True)


class CompiledRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (what Megatron's local spec builds) whose forward and backward can run as one compiled
    kernel each: eager autograd decomposes the norm's backward into ~10 elementwise kernels per call, and the
    local spec runs four norms per layer (input, pre-MLP, and Qwen3's q/k). Same parameter, same formula (fp32
    statistics). `compiled` (set by the engine from `megatron.compile_fusions`); None compiles on CUDA only."""

    compiled: bool | None = None

    def forward(self, x: Tensor) -> Tensor:
        if not (COMPILE_NORM and (x.is_cuda if self.compiled is None else self.compiled)):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        # Always 2-D: one compiled graph serves the [s, b, hidden] and the [t, heads, head_dim] (q/k) norms; each
        # extra input rank would be another recompilation, and dynamo falls back to eager after eight.
        return _compiled_rms_norm()(x.reshape(-1, x.shape[-1]), self.weight, eps).view(x.shape)


def compile_norms(modules: list[torch.nn.Module], enabled: bool) -> None:
    """Run every `CompiledRMSNorm` under `modules` compiled (or eager), whatever the device."""
    for module in modules:
        for norm in module.modules():
            if isinstance(norm, CompiledRMSNorm):
                norm.compiled = enabled


class LocalNorm:
    """Megatron's `WrappedTorchNorm` builder (same arguments) that builds `CompiledRMSNorm` for RMSNorm and accepts
    sequence parallelism (mrl.engine.megatron.model.build_sequence_parallel_norm), on CPU and CUDA alike."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from mrl.engine.megatron.model import build_sequence_parallel_norm

        norm = build_sequence_parallel_norm(lambda: WrappedTorchNorm(config, hidden_size, eps, **kwargs), config)
        if type(norm) is torch.nn.RMSNorm:
            # A subclass adding no state: re-classing keeps the weight and any attribute put on it (the CPU
            # layer's `sequence_parallel` tag) exactly as Megatron built them.
            norm.__class__ = CompiledRMSNorm
        return norm


def sdpa_layer_spec(config: TransformerConfig, *, vp_stage: int | None = None):
    """The local (non-TE) decoder block spec of this stage (mrl.engine.megatron.model.layer_spec) with
    `SdpaAttention` wherever Megatron's `DotProductAttention` was (MLA layers keep their own core attention) and
    `CompiledRMSNorm` wherever the spec builds torch's RMSNorm."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mrl.engine.megatron.model import layer_spec

    spec = layer_spec(config, use_te=False, vp_stage=vp_stage)
    norms = [spec]
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = SdpaAttention
        norms += [layer.submodules, attention]
    for holder in norms:
        for name in ("layer_norm", "input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
            if getattr(holder, name, None) is WrappedTorchNorm:
                setattr(holder, name, LocalNorm)
    return spec
