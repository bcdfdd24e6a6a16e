"""The one-copy sender's bookkeeping (mrl/weight_sync/handles.py `share_buckets`), with CPU tensors and a recording
`share` (CUDA IPC itself runs in tests/gpu): a storage its tensors only view (a contiguous parameter buffer) is
shared once per sync however many buckets use it; a storage a tensor fills (the export's own tensors) is shared
in its bucket, marked transient, and shared again if a later bucket needs it; entries describe each tensor as a
strided view of its storage, which the receiver's `view_of` turns back into the tensor; a bucket's transient
tensors are held until the ring slot is reused, after a wait for its receivers, and a slot that holds nothing is
reused without one; small tensors of their own storage are copied into the staging buffer of their
bucket's slot, which is shared once per sync and kept mapped (no mapping dropped per bucket); fused QKV's row blocks
travel as views of linear_qkv (kept, never staged) and reach the loader as blocks, or flattened into HF tensors."""

import base64

import torch

from bridges.export import ROW_BLOCKS, TpSlice
from bridges.mapping import QKV, ModelShape
from mrl.weight_sync.handles import HandleReader, share_buckets, view_of


class Recorder:
    """A `share` that keeps each shared storage (as the receiver would map it) under its handle."""

    def __init__(self) -> None:
        self.storages: list[torch.Tensor] = []

    def __call__(self, storage_bytes: torch.Tensor) -> bytes:
        self.storages.append(storage_bytes)
        return str(len(self.storages) - 1).encode()

    def mapped(self, meta: dict) -> dict[int, torch.Tensor]:
        return {int(i): self.storages[int(base64.b64decode(h))] for i, h in meta["storages"].items()}


def test_buckets_share_kept_storages_once_and_transient_ones_per_bucket():
    flat = torch.arange(64.0)  # Megatron's parameter buffer: every parameter a view
    own = torch.ones(4, 4)  # a tensor the export created
    stream = [("a", flat[:16].view(4, 4)), ("q", own), ("b", flat[16:32].view(4, 4).t()),
              ("c", flat[32:48].view(4, 4), TpSlice(0, 1, 2)), ("q2", own.view(2, 8))]
    share, reused, held = Recorder(), [], [[], []]
    counts: dict = {}
    buckets = list(share_buckets(iter(stream), 2 * 64, lambda k: reused.append(k), held, counts, share,
                                 stage_below=0))
    shared = [t.untyped_storage().data_ptr() for t in share.storages]
    assert [len(m["entries"]) for _, m in buckets] == [2, 2, 1]  # 64 bytes a tensor, two per bucket
    assert shared.count(flat.untyped_storage().data_ptr()) == 1  # kept: once for the sync
    assert shared.count(own.untyped_storage().data_ptr()) == 2  # transient: in bucket 0 and again in bucket 2
    assert counts == {"buckets": 3, "handles": 3, "staged_bytes": 0, "reuse_waits": 1}
    (_, m0), (_, m1), (_, m2) = buckets
    assert m0["transient"] == [1] and m1["transient"] == [] and m2["transient"] == [2]
    assert set(m0["storages"]) == {"0", "1"} and m1["storages"] == {} and set(m2["storages"]) == {"2"}
    mapped = {**share.mapped(m0), **share.mapped(m2)}
    got = {e[0]: view_of(mapped[e[5]], e) for _, m in buckets for e in m["entries"]}
    assert all(torch.equal(got[item[0]], item[1]) for item in stream)
    assert m1["entries"][0] == ["b", "float32", [4, 4], [1, 4], 16, 0]  # a transposed view at its offset
    assert m1["entries"][1] == ["c", "float32", [4, 4], [4, 1], 32, 0, [0, 1, 2]]
    assert m2["entries"][0] == ["q2", "float32", [2, 8], [8, 1], 0, 2]
    assert reused == [2]  # bucket 2 reuses bucket 0's slot, which held `q`; bucket 1 held views only: no wait
    # a slot's tensors are dropped once its bucket was waited for; the last bucket's stay until the sender's end
    assert [t.shape for t in held[0]] == [(2, 8)] and held[1] == []


def test_small_tensors_of_their_own_are_staged_in_their_slots_buffer_shared_once_per_sync():
    flat = torch.arange(32.0)
    stream = [("w", flat[:16].view(4, 4)), ("bias", torch.full((3,), 2.0)), ("q", torch.randn(2, 4).t()),
              ("big", torch.randn(64)), ("w2", flat[16:32]), ("bias2", torch.full((5,), 3.0)),
              ("bias3", torch.full((2,), 4.0))]
    share, held, ring, mapped, got, reused = Recorder(), [[], []], [], {}, {}, []
    counts: dict = {}
    # 300-byte buckets (and slots; staged offsets are 256-byte aligned): w, bias, q | big | w2, bias2, bias3
    buckets = share_buckets(iter(stream), 300, reused.append, held, counts, share, stage_below=128, ring=ring)
    for k, meta in buckets:
        mapped.update(share.mapped(meta))
        # read now: the sender refills a slot's staging buffer once that slot's bucket was waited for
        got.update({e[0]: view_of(mapped[e[5]], e).clone() for e in meta["entries"]})
        for index in meta["transient"]:
            mapped.pop(index)
        assert [e[0] for e in meta["entries"]] == [["w", "bias", "q"], ["big"], ["w2", "bias2", "bias3"]][k]
        assert meta["transient"] == ([] if k != 1 else [meta["entries"][0][5]])
    for name, tensor in stream:
        assert torch.equal(got[name], tensor), name
    ptrs = [t.untyped_storage().data_ptr() for t in share.storages]
    assert len(ring) == 1 and ring[0].numel() == 300  # bucket 1 staged nothing: slot 1 never allocated
    assert ptrs.count(ring[0].untyped_storage().data_ptr()) == 1  # shared once, used by buckets 0 and 2
    assert counts == {"buckets": 3, "handles": 3, "staged_bytes": 12 + 32 + 20 + 8, "reuse_waits": 2}
    assert reused == [2, 3]  # slot 0 staged in bucket 0, slot 1 held `big`
    assert held == [[], []]  # w2 is a view, staged tensors' copies are queued: bucket 2 holds nothing


def test_a_bucket_ends_early_when_its_staged_tensors_would_overflow_the_slot():
    stream = [(f"b{i}", torch.full((10,), float(i))) for i in range(4)]  # 40 bytes each, all staged
    (_, meta), = share_buckets(iter(stream), 1024, lambda k: None, [[], []], None, Recorder(), stage_below=64)
    assert [e[4] for e in meta["entries"]] == [0, 64, 128, 192]  # 256-byte aligned offsets, in float32 elements
    small = list(share_buckets(iter(stream), 600, lambda k: None, [[], []], None, Recorder(), stage_below=64))
    assert [len(m["entries"]) for _, m in small] == [3, 1]  # the fourth would start at byte 768 of a 600-byte slot


def test_row_blocks_are_shared_as_views_of_linear_qkv_and_read_as_blocks_or_hf_tensors(monkeypatch):
    import mrl.weight_sync.cuda_ipc as cuda_ipc

    shape = ModelShape(num_heads=4, num_query_groups=2, head_dim=2)
    flat = torch.arange(2 * 8 * 3 + 8, dtype=torch.float32)  # Megatron's parameter buffer
    qkv = flat[8:].view(16, 3)  # linear_qkv, a view at an offset: 2 groups of (2 q heads, k, v) x 2 rows
    mapping = QKV("qkv", "q", "k", "v")
    hf = dict(zip("qkv", mapping.to_hf(qkv, shape)))
    stream = [(n, b, TpSlice(0, 1, 2), ROW_BLOCKS) if n == "k" else (n, b, ROW_BLOCKS)
              for n, b in zip("qkv", mapping.to_hf_blocks(qkv, shape))]
    share = Recorder()
    counts: dict = {}
    (_, meta), = share_buckets(iter(stream), 1 << 20, lambda k: None, [[], []], counts, share, ring=[])
    assert counts == {"buckets": 1, "handles": 1, "staged_bytes": 0, "reuse_waits": 0}  # one storage, no staging
    q, k, _ = meta["entries"]
    assert q == ["q", "float32", [2, 4, 3], [24, 3, 1], 8, 0, None, 1] and k[6:] == [[0, 1, 2], 1]
    monkeypatch.setattr(cuda_ipc, "open_cuda_buffer", lambda handle: share.storages[int(handle)])
    kept = dict((n, (t, tags)) for n, t, *tags in HandleReader(keep_parts=True).read(meta))
    assert all(torch.equal(kept[n][0].flatten(0, 1), hf[n]) for n in "qkv")
    assert kept["q"][1] == [ROW_BLOCKS] and kept["k"][1] == [[0, 1, 2], ROW_BLOCKS]
    flattened = dict(HandleReader().read(meta))  # a loader of HF tensors: q, v as they are, k full-shaped
    assert torch.equal(flattened["q"], hf["q"]) and torch.equal(flattened["v"], hf["v"])
    assert flattened["k"].shape == (8, 3) and torch.equal(flattened["k"][4:], hf["k"])


def test_buckets_of_views_only_are_announced_without_waiting_for_the_receivers():
    flat = torch.arange(64.0)  # every tensor a view of the parameter buffer, as the export with row blocks gives
    stream = [(f"w{i}", flat[8 * i:8 * i + 8]) for i in range(8)]
    reused, counts = [], {}
    buckets = list(share_buckets(iter(stream), 64, reused.append, [[], []], counts, Recorder()))
    assert len(buckets) == 4 and reused == [] and counts["reuse_waits"] == 0 and counts["handles"] == 1
