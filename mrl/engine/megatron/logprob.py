"""Per-token log-probs and entropy from hidden states, vocab-parallel and chunked over tokens.

For hidden states h [T, H] (identical on every TP rank) and this rank's rows W_r [V/tp, H] of the output layer,
z = h W_rᵀ are this rank's logits. With m = max over all ranks, s = Σ_all exp(z − m), lse = m + log s:

    log p(y)  = z_y − lse                      (z_y lives on the rank owning y; the others add 0)
    H         = lse − Σ_v p_v z_v
    ∂log p(y)/∂z = onehot(y) − p               ∂H/∂z = −p ⊙ (z − E_p[z]),  E_p[z] = lse − H

Each rank only ever holds a [chunk, V/tp] block of logits: the forward keeps h, W, y and per-token (lse, H), and
the backward recomputes the logits chunk by chunk. The gradient w.r.t. h is this rank's partial sum; the caller
feeds h through Megatron's `copy_to_tensor_model_parallel_region` (or the sequence-parallel gather) whose backward
sums it over TP, exactly as for the output ColumnParallelLinear it replaces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# 256 tokens × 152k vocab: 0.58 GiB peak on the forward at hidden 1024 (H200, tools/bench/engine.py), 1/16 of the
# materialised path; 1024 gave 0.25×. The GEMMs stay large enough to keep the log-prob path off the critical path.
DEFAULT_CHUNK_TOKENS = 256


def _all_reduce(x: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _chunk_stats(h: Tensor, w: Tensor, labels: Tensor, vocab_start: int, group: Any) -> tuple[Tensor, ...]:
    """Logits z [c, V/tp] (fp32) and global (lse, target logit, Σ p z) of one chunk."""
    z = torch.nn.functional.linear(h, w).float()
    m = z.max(dim=-1).values
    _all_reduce(m, dist.ReduceOp.MAX, group)
    e = torch.exp(z - m[:, None])
    s = e.sum(-1)
    ez = (e * z).sum(-1)
    local = labels - vocab_start
    owned = (local >= 0) & (local < z.shape[-1])
    target = torch.where(owned, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1), 0.0)
    packed = torch.stack([s, ez, target])
    _all_reduce(packed, dist.ReduceOp.SUM, group)
    s, ez, target = packed
    lse = m + torch.log(s)
    return z, lse, target, ez / s


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, labels: Tensor, vocab_start: int, group: Any, chunk: int):
        logp, ent, lse = (torch.empty(h.shape[0], dtype=torch.float32, device=h.device) for _ in range(3))
        for a in range(0, h.shape[0], chunk):
            b = min(a + chunk, h.shape[0])
            _, lse_c, target, mean_z = _chunk_stats(h[a:b], w, labels[a:b], vocab_start, group)
            logp[a:b], ent[a:b], lse[a:b] = target - lse_c, lse_c - mean_z, lse_c
        # Unused outputs (entropy, usually) then reach backward as None and cost nothing.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, w, labels, lse, ent)
        ctx.vocab_start, ctx.group, ctx.chunk = vocab_start, group, chunk
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None):
        h, w, labels, lse, ent = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        for a in range(0, h.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, h.shape[0])
            z = torch.nn.functional.linear(h[a:b], w).float()
            p = torch.exp(z - lse[a:b, None])
            dz = torch.zeros_like(z)
            if g_logp is not None:
                dz -= g_logp[a:b, None] * p
                local = labels[a:b] - ctx.vocab_start
                owned = (local >= 0) & (local < z.shape[-1])
                rows = torch.nonzero(owned).squeeze(-1)
                dz[rows, local[rows]] += g_logp[a:b][rows]
            if g_ent is not None:
                mean_z = lse[a:b] - ent[a:b]
                dz -= g_ent[a:b, None] * p * (z - mean_z[:, None])
            if grad_h is not None:
                grad_h[a:b] = (dz.to(w.dtype) @ w).to(h.dtype)
            if grad_w is not None:
                grad_w += dz.t() @ h[a:b].float()
        return grad_h, (grad_w.to(w.dtype) if grad_w is not None else None), None, None, None, None


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    tp_group: Any = None,
    vocab_start: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """(log p(labels), entropy) per token, fp32 [T], for replicated `hidden` [T, H] and the local vocab shard
    `weight` [V/tp, H] starting at global id `vocab_start`; differentiable w.r.t. hidden and weight."""
    return _VocabParallelLogProb.apply(hidden, weight, labels, vocab_start, tp_group, chunk_tokens)


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
    rank = parallel_state.get_tensor_model_parallel_rank()
    s, b, h = hidden_states.shape
    labels = context["labels"].transpose(0, 1).reshape(-1)  # [b, s] → s-major like the hidden states
    logp, ent = vocab_parallel_logprobs(
        hidden_states.reshape(s * b, h),
        weight,
        labels,
        tp_group=group,
        vocab_start=rank * weight.shape[0],
        chunk_tokens=context.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
    )
    return logp.view(s, b).t(), ent.view(s, b).t()
