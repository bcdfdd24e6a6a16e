"""The one-copy path's host work per tensor, on CPU tensors (the launches it saves are measured by
tools/bench/weight_sync.py on the GPU): `copy_all` gives every destination its source whatever the mix, and
joins pairs that continue each other on both sides (gate and up from Megatron's fused fc1 into a fused gate_up)
into one copy, batching only small contiguous ones; `share_buckets` ramps its first buckets up from
`first_bucket` so the receiver starts early; a `ViewRecipe` replays a stream of parameter views as the same views,
refuses streams with a fresh or recast tensor, and goes stale once a parameter moves."""

from types import SimpleNamespace

import pytest
import torch

from bridges.export import ROW_BLOCKS, ViewRecipe
from mrl.weight_sync import handles
from mrl.weight_sync.handles import copy_all, share_buckets


def test_copy_all_fills_every_destination_and_joins_what_continues_on_both_sides(monkeypatch):
    fc1 = torch.randn(8, 4)  # Megatron's fused gate/up rows
    qkv = torch.randn(2, 6, 4)  # two query groups of q(4) k(1) v(1) rows
    norm = torch.randn(4, dtype=torch.float32)
    gate_up = torch.zeros(8, 4)
    q = torch.zeros(2, 4, 4)
    norm_dst = torch.zeros(4, dtype=torch.bfloat16)  # a cast: never joined or batched
    small = torch.zeros(4)
    pairs = [(gate_up[:4], fc1[:4]), (gate_up[4:], fc1[4:]), (q, qkv[:, :4]), (norm_dst, norm),
             (small, norm.clone())]
    monkeypatch.setattr(handles, "BATCH_BELOW", 64)  # bytes: the 16-byte pair is batched, the joined 128 not
    copies, batches = [], []
    real_copy, real_foreach = torch.Tensor.copy_, torch._foreach_copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda d, s, **kw: copies.append(d.shape) or real_copy(d, s, **kw))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, **kw: batches.append(len(d)) or real_foreach(d, s, **kw))
    copy_all(pairs)
    assert torch.equal(gate_up, fc1) and torch.equal(q, qkv[:, :4]) and torch.equal(small, norm)
    assert torch.equal(norm_dst, norm.to(torch.bfloat16))
    # gate+up as one 32-element copy; the row blocks and the cast alone; the small contiguous one batched
    assert sorted(map(tuple, copies)) == [(2, 4, 4), (4,), (32,)] and batches == [1]


def test_copy_all_does_not_join_across_storages_or_gaps():
    a, b = torch.randn(4), torch.randn(4)
    dst = torch.zeros(8)
    source = torch.randn(9)
    copy_all([(dst[:4], a), (dst[4:], b)])  # destinations continue, sources are two storages
    assert torch.equal(dst, torch.cat([a, b]))
    copy_all([(dst[:4], source[:4]), (dst[4:], source[5:])])  # a gap of one element in the sources
    assert torch.equal(dst, torch.cat([source[:4], source[5:]]))


@pytest.mark.parametrize(("first", "want"), [(0, [1024, 1024]), (256, [256, 512, 1024, 256])])
def test_share_buckets_ramps_from_the_first_bucket_limit(first, want):
    flat = torch.zeros(512)  # 2048 bytes of parameter views, 256 bytes each
    stream = [(f"t{i}", flat[i * 64:(i + 1) * 64]) for i in range(8)]
    buckets = list(share_buckets(iter(stream), 1024, lambda k: None, [[], []], None, lambda t: b"h",
                                 first_bucket=first))
    sizes = [sum(torch.Size(e[2]).numel() * 4 for e in meta["entries"]) for _, meta in buckets]
    assert sizes == want
    assert handles.FIRST_BUCKET_BYTES > 0  # the sender's default ramps


def _local(*params: torch.nn.Parameter) -> dict:
    return {f"p{i}": (SimpleNamespace(tensor=p), None) for i, p in enumerate(params)}


def test_view_recipe_replays_views_and_goes_stale_when_a_parameter_moves():
    flat = torch.arange(40.0)  # one buffer behind both parameters, as Megatron's DDP keeps them
    w = torch.nn.Parameter(flat[:24].view(6, 4))
    b = torch.nn.Parameter(flat[24:30])
    stream = [("gate", w.detach()[:3]), ("up", w.detach()[3:]), ("q", w.detach().view(2, 3, 4)[:, :2], ROW_BLOCKS),
              ("bias", b.detach())]
    recipe = ViewRecipe.record(_local(w, b), stream)
    assert recipe is not None and recipe.valid()
    replayed = list(recipe.replay())
    for (name, tensor, *tags), (rname, rtensor, *rtags) in zip(stream, replayed, strict=True):
        assert (rname, rtags) == (name, tags) and not rtensor.requires_grad
        assert (rtensor.shape, rtensor.stride(), rtensor.data_ptr()) == (tensor.shape, tensor.stride(),
                                                                           tensor.data_ptr())
    with torch.no_grad():
        w[0, 0] = 100.0  # training changes values, not memory: the replay sees them
    assert next(recipe.replay())[1][0, 0] == 100.0
    w.data = w.data.clone()  # offloaded and back, or a rebuilt buffer
    assert not recipe.valid()


def test_view_recipe_refuses_fresh_and_recast_tensors():
    w = torch.nn.Parameter(torch.randn(4, 4))
    assert ViewRecipe.record(_local(w), [("w", w.detach() * 2)]) is None  # e.g. a LoRA merge
    assert ViewRecipe.record(_local(w), [("w", w.detach().view(torch.int32))]) is None
