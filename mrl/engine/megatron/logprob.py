"""Per-token log-probs and entropy from hidden states, vocab-parallel and chunked, never all fp32 logits at once.

For hidden states h [T, H] (identical on every TP rank) and this rank's rows W_r [V/tp, H] of the output layer,
z = h W_rᵀ are this rank's logits. With m = max over all ranks, s = Σ_all exp(z − m), lse = m + log s:

    log p(y)  = z_y − lse                      (z_y lives on the rank owning y; the others add 0)
    H         = lse − Σ_v p_v z_v
    ∂log p(y)/∂z = onehot(y) − p               ∂H/∂z = −p ⊙ (z − E_p[z]),  E_p[z] = lse − H

Forward: token chunks of `chunk_tokens` rows; each chunk's logits [chunk, V/tp] live only while its statistics
are reduced over TP. Backward: vocabulary blocks of about the same size, [T, V_b] each, so the weight gradient
of a block is one GEMM written once (token chunks would re-read and re-write the whole [V/tp, H] fp32 weight
gradient per chunk: memory traffic that outweighed the GEMMs on the H200) and only the small [T, H] hidden
gradient accumulates. The logits the backward needs are kept from the forward, in the GEMM's dtype (bf16 under
bf16 training: what the stock output layer holds too), while they fit in `keep_logits_bytes`; above that the
backward recomputes each block's GEMM (4 vocabulary GEMMs instead of 3). The gradient w.r.t. h is this rank's
partial sum; the caller feeds h through Megatron's `copy_to_tensor_model_parallel_region` (or the
sequence-parallel gather) whose backward sums it over TP, exactly as for the output ColumnParallelLinear.

With `compiled` (the engine's `megatron.compile_fusions`; None: on CUDA only) the elementwise work of a chunk
or block (exp, sums, the logit gradient) runs as one torch.compile'd kernel each, reading the bf16 logits once
instead of making several fp32 passes; otherwise it runs eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

# Tokens per forward chunk (and logits per backward block: chunk × V). On the H200 (tools/bench/engine.py, 1.5B
# shape, 2×4096 tokens, whole actor step) 256 / 1024 / 4096 ran at 27.7k / 31.2k / 32.8k tokens/s with peaks of
# 36.9 / 37.4 / 39.1 GiB: fewer, larger vocabulary GEMMs (39.1 fell to 36.9 GiB once a chunk is freed before the
# next GEMM and the gradient overwrites the kept logits, at the same speed). With the compiled elementwise kernels a
# chunk's only large buffer is its [chunk, V/tp] logits (1.2 GiB in bf16 at 4096 × 152k); on CPU the eager path
# holds a few fp32 copies of it.
DEFAULT_CHUNK_TOKENS = 4096
# Logits kept for the backward per micro-batch and rank: 16k tokens at a 152k vocabulary in bf16 is 4.6 GiB.
DEFAULT_KEEP_LOGITS_BYTES = 4 << 30
# torch.compile the elementwise parts where `compiled` asks for it (tools/bench/engine.py switches it off to
# measure the difference).
COMPILE_ELEMENTWISE = True


def _all_reduce(x: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _chunk_sums(z: Tensor, m: Tensor, local: Tensor) -> Tensor:
    """[3, c] fp32: Σ exp(z − m), Σ exp(z − m)·z and z at the local label (0 where this rank does not own it)."""
    zf = z.float()
    e = torch.exp(zf - m[:, None])
    owned = (local >= 0) & (local < z.shape[-1])
    target = torch.where(owned, zf.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1), 0.0)
    return torch.stack([e.sum(-1), (e * zf).sum(-1), target])


def _logit_grad_(
    z: Tensor, lse: Tensor, mean_z: Tensor, local: Tensor, g_logp: Tensor | None, g_ent: Tensor | None
) -> Tensor:
    """∂loss/∂z of a [T, V_b] block (the formula of the module docstring), written over z and returned: the
    block's logits are not needed afterwards, and the gradient then takes no memory of its own (compiled on CUDA,
    this is one kernel reading and writing z in place)."""
    zf = z.float()
    p = torch.exp(zf - lse[:, None])
    dz = torch.zeros_like(zf)
    if g_logp is not None:
        cols = torch.arange(z.shape[-1], device=z.device)
        dz = dz + torch.where(cols[None, :] == local[:, None], g_logp[:, None], 0.0) - g_logp[:, None] * p
    if g_ent is not None:
        dz = dz - g_ent[:, None] * p * (zf - mean_z[:, None])
    return z.copy_(dz)


@functools.cache
def _compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    return torch.compile(fn, dynamic=True)


def _kernel(fn: Callable[..., Tensor], x: Tensor, compiled: bool | None) -> Callable[..., Tensor]:
    on = x.is_cuda if compiled is None else compiled
    return _compiled(fn) if COMPILE_ELEMENTWISE and on else fn


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        w: Tensor,
        labels: Tensor,
        vocab_start: int,
        group: Any,
        chunk: int,
        keep_bytes: int,
        compiled: bool | None,
    ):
        t, v = h.shape[0], w.shape[0]
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep = needs_grad and t * v * w.element_size() <= keep_bytes
        kept = torch.empty(t, v, dtype=w.dtype, device=w.device) if keep else None
        logp, ent, lse = (torch.empty(t, dtype=torch.float32, device=h.device) for _ in range(3))
        local = labels - vocab_start
        sums = _kernel(_chunk_sums, h, compiled)
        for a in range(0, t, chunk):
            b = min(a + chunk, t)
            z = torch.mm(h[a:b], w.t(), out=kept[a:b]) if kept is not None else torch.mm(h[a:b], w.t())
            m = _all_reduce(z.max(dim=-1).values.float(), dist.ReduceOp.MAX, group)
            s, ez, target = _all_reduce(sums(z, m, local[a:b]), dist.ReduceOp.SUM, group)
            lse_c = m + torch.log(s)
            logp[a:b], ent[a:b], lse[a:b] = target - lse_c, lse_c - ez / s, lse_c
            del z  # before the next chunk's GEMM allocates: one chunk of logits alive at a time, not two
        # Unused outputs (entropy, usually) then reach backward as None and cost nothing.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, w, labels, lse, ent, kept)
        ctx.vocab_start, ctx.chunk, ctx.compiled = vocab_start, chunk, compiled
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None):
        h, w, labels, lse, ent, kept = ctx.saved_tensors
        t, v = h.shape[0], w.shape[0]
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        local = labels - ctx.vocab_start
        mean_z = lse - ent
        logit_grad = _kernel(_logit_grad_, h, ctx.compiled)
        # Vocabulary blocks holding about as many logits as a forward chunk, in multiples of 128 columns.
        block = min(v, max(128, -(-ctx.chunk * v // max(t, 1) // 128) * 128))
        for a in range(0, v, block):
            b = min(a + block, v)
            # The kept logits are overwritten by their gradient: this backward runs once (no retain_graph in
            # training), and the peak stays at the kept logits instead of kept + one gradient block.
            z = kept[:, a:b] if kept is not None else torch.mm(h, w[a:b].t())
            dz = logit_grad(z, lse, mean_z, local - a, g_logp, g_ent)
            if grad_h is not None:
                grad_h += torch.mm(dz, w[a:b]).float()
            if grad_w is not None:
                torch.mm(dz.t(), h, out=grad_w[a:b])
            del z, dz  # before the next block's GEMM allocates
        return (grad_h.to(h.dtype) if grad_h is not None else None), grad_w, *[None] * 6


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    tp_group: Any = None,
    vocab_start: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
    compiled: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(log p(labels), entropy) per token, fp32 [T], for replicated `hidden` [T, H] and the local vocab shard
    `weight` [V/tp, H] starting at global id `vocab_start`; differentiable w.r.t. hidden and weight.
    `keep_logits_bytes`: the most memory the [T, V/tp] logits may take to be kept for the backward pass;
    `compiled`: elementwise kernels compiled (None: on CUDA)."""
    return _VocabParallelLogProb.apply(
        hidden, weight, labels, vocab_start, tp_group, chunk_tokens, keep_logits_bytes, compiled
    )


def output_processor(
    hidden_states: Tensor, output_layer: Any, output_weight: Tensor | None, context: Any, **_: Any
) -> tuple[Tensor, Tensor]:
    """GPTModel `output_processor` hook: (log-probs, entropy) of `context["labels"]` [1, T] instead of logits.

    Replaces the output ColumnParallelLinear's forward: gather the sequence-parallel shards (or mark the input
    as TP-replicated), then run the chunked vocab-parallel computation against the same weight.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    weight = output_weight if output_weight is not None else output_layer.weight
    group = parallel_state.get_tensor_model_parallel_group()
    if output_layer.sequence_parallel:
        hidden_states = mappings.gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
    else:
        hidden_states = mappings.copy_to_tensor_model_parallel_region(hidden_states)
    temperature = context.get("temperature", 1.0)
    if temperature != 1.0:
        hidden_states = hidden_states / temperature
    rank = parallel_state.get_tensor_model_parallel_rank()
    vocab_start = rank * weight.shape[0]
    vocab = context.get("vocab_size")
    if vocab is not None and vocab_start + weight.shape[0] > vocab:
        # Rows past the HF vocabulary pad it to a multiple of TP: they are no tokens, so they take no mass (as
        # logits of -inf would) and their rows get no gradient.
        weight = weight[: vocab - vocab_start]  # start-up: every rank holds real rows
    s, b, h = hidden_states.shape
    labels = context["labels"].transpose(0, 1).reshape(-1)  # [b, s] → s-major like the hidden states
    logp, ent = vocab_parallel_logprobs(
        hidden_states.reshape(s * b, h),
        weight,
        labels,
        tp_group=group,
        vocab_start=vocab_start,
        chunk_tokens=context.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
        keep_logits_bytes=context.get("keep_logits_bytes", DEFAULT_KEEP_LOGITS_BYTES),
        compiled=context.get("compiled"),
    )
    return logp.view(s, b).t(), ent.view(s, b).t()
