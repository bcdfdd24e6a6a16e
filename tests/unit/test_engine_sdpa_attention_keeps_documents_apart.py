"""SdpaAttention on a packed THD row equals causal attention computed on each document alone (fp32, 1e-5), with
GQA, in values and in gradients; the unpacked [s, b, h, d] path equals it too."""

import math

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

import itertools

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from mrl.engine.megatron.attention import SdpaAttention
from mrl.utils.distributed import free_port

HEADS, GROUPS, DIM = 4, 2, 8


@pytest.fixture(scope="module")
def attention():
    # A real one-rank gloo group stands in for the TP group: the module only asks it for its size.
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        use_cpu_initialization=True,
        attention_dropout=0.0,
    )
    module = SdpaAttention(
        cfg, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=dist.group.WORLD)
    )
    yield module
    if own:
        dist.destroy_process_group()


def reference(q, k, v):
    """Explicit causal attention of one document: [s, h, d] with K/V groups repeated to the query heads."""
    s = q.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)


def test_packed_row_equals_each_document_alone(attention):
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]  # the last segment plays the pad segment
    t = sum(lengths)
    q = torch.randn(t, HEADS, DIM, requires_grad=True)
    k = torch.randn(t, GROUPS, DIM, requires_grad=True)
    v = torch.randn(t, GROUPS, DIM, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    out = attention(q, k, v, None, packed_seq_params=params)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    got = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())

    q.grad = k.grad = v.grad = None
    bounds = cu.tolist()
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b]) for a, b in itertools.pairwise(bounds)])
    (ref * weights).sum().backward()
    for g, r in zip(got, (ref.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_changing_one_document_leaves_the_others_unchanged(attention):
    torch.manual_seed(1)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    q, k, v = torch.randn(13, HEADS, DIM), torch.randn(13, GROUPS, DIM), torch.randn(13, GROUPS, DIM)
    before = attention(q, k, v, None, packed_seq_params=params)
    k2, v2 = k.clone(), v.clone()
    k2[:6] += 1.0
    v2[:6] -= 2.0
    after = attention(q, k2, v2, None, packed_seq_params=params)
    assert not torch.allclose(before[:6], after[:6])
    assert torch.equal(before[6:], after[6:])


def test_unpacked_batch_matches_reference(attention):
    torch.manual_seed(2)
    s, b = 7, 2
    q, k, v = torch.randn(s, b, HEADS, DIM), torch.randn(s, b, GROUPS, DIM), torch.randn(s, b, GROUPS, DIM)
    out = attention(q, k, v, None)
    assert out.shape == (s, b, HEADS * DIM)
    for i in range(b):
        torch.testing.assert_close(out[:, i], reference(q[:, i], k[:, i], v[:, i]), atol=1e-5, rtol=1e-5)


def packed_bf16_grads(attention, lengths, seed):
    """Output and q/k/v gradients of a bf16 packed row, and the same inputs in fp64 (for the reference)."""
    torch.manual_seed(seed)
    t = sum(lengths)
    inputs = [torch.randn(t, h, DIM, dtype=torch.float64) for h in (HEADS, GROUPS, GROUPS)]
    weights = torch.randn(t, HEADS * DIM, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in inputs)
    out = attention(q, k, v, None, packed_seq_params=params)
    (out.double() * weights).sum().backward()
    return (out.detach(), q.grad, k.grad, v.grad), inputs, weights, cu.tolist()


def per_document_sdpa(q, k, v, bounds):
    """Each document alone through torch's SDPA (what the module ran before the fp32 backward, in bf16)."""
    out = []
    for a, b in itertools.pairwise(bounds):
        x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(b - a, -1))
    return torch.cat(out)


def test_bf16_short_documents_take_an_fp32_backward_closer_to_exact(attention):
    """CPU bf16: the forward is SDPA's bit for bit; the gradients (fp32 backward from the forward's log-sum-exp)
    are within bf16 rounding of the fp64 reference and no further from it than SDPA's own bf16 backward."""
    lengths = [17, 1, 40, 9]
    got, inputs, weights, bounds = packed_bf16_grads(attention, lengths, seed=3)

    exact = [x.clone().requires_grad_() for x in inputs]
    ref = torch.cat([reference(*(x[a:b] for x in exact)) for a, b in itertools.pairwise(bounds)])
    (ref * weights).sum().backward()
    sdpa = [x.to(torch.bfloat16).requires_grad_() for x in inputs]
    sdpa_out = per_document_sdpa(*sdpa, bounds)
    (sdpa_out.double() * weights).sum().backward()

    assert torch.equal(got[0], sdpa_out.detach())
    for mine, theirs, exact_grad in zip(got[1:], (x.grad for x in sdpa), (x.grad for x in exact)):
        err, sdpa_err = ((g.double() - exact_grad).abs().max() for g in (mine, theirs))
        assert err <= 2e-2 * exact_grad.abs().max()
        assert err <= sdpa_err and not torch.equal(mine, theirs)  # and it is not SDPA's bf16 backward


def test_bf16_documents_from_the_length_threshold_keep_the_sdpa_backward(attention, monkeypatch):
    from mrl.engine.megatron import attention as module

    monkeypatch.setattr(module, "CPU_FP32_BACKWARD_BELOW", 10)
    lengths = [6, 12]  # the first below the threshold, the second at or above it
    got, inputs, weights, bounds = packed_bf16_grads(attention, lengths, seed=4)
    sdpa = [x.to(torch.bfloat16).requires_grad_() for x in inputs]
    (per_document_sdpa(*sdpa, bounds).double() * weights).sum().backward()
    for mine, theirs in zip(got[1:], (x.grad for x in sdpa)):
        assert torch.equal(mine[6:], theirs[6:])  # the long document: SDPA's bf16 backward, bit for bit
        assert not torch.equal(mine[:6], theirs[:6])  # the short one: the fp32 backward
