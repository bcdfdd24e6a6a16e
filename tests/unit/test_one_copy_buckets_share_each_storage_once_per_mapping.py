"""The one-copy sender's bookkeeping (mrl/weight_sync/handles.py `share_buckets`), with CPU tensors and a recording
`share` (CUDA IPC itself runs in tests/gpu): a storage its tensors only view (a contiguous parameter buffer) is
shared once per sync however many buckets use it; a storage a tensor fills (the export's own tensors) is shared
in its bucket, marked transient, and shared again if a later bucket needs it; entries describe each tensor as a
strided view of its storage; a bucket's tensors are held until the ring slot is reused."""

import base64

import torch

from bridges.export import TpSlice
from mrl.weight_sync.handles import share_buckets


def test_buckets_share_kept_storages_once_and_transient_ones_per_bucket():
    flat = torch.arange(64.0)  # Megatron's parameter buffer: every parameter a view
    own = torch.ones(4, 4)  # a tensor the export created
    stream = [("a", flat[:16].view(4, 4)), ("q", own), ("b", flat[16:32].view(4, 4).t()),
              ("c", flat[32:48].view(4, 4), TpSlice(0, 1, 2)), ("q2", own.view(2, 8))]
    shared, reused, held = [], [], [[], []]
    counts: dict = {}

    def share(storage_bytes: torch.Tensor) -> bytes:
        shared.append(storage_bytes.untyped_storage().data_ptr())
        return str(len(shared)).encode()

    buckets = list(share_buckets(iter(stream), 2 * 64, lambda k: reused.append(k), held, counts, share))
    assert [len(m["entries"]) for _, m in buckets] == [2, 2, 1]  # 64 bytes a tensor, two per bucket
    assert shared.count(flat.untyped_storage().data_ptr()) == 1  # kept: once for the sync
    assert shared.count(own.untyped_storage().data_ptr()) == 2  # transient: in bucket 0 and again in bucket 2
    assert counts == {"buckets": 3, "handles": 3}
    (_, m0), (_, m1), (_, m2) = buckets
    assert m0["transient"] == [1] and m1["transient"] == [] and m2["transient"] == [2]
    assert set(m0["storages"]) == {"0", "1"} and m1["storages"] == {} and set(m2["storages"]) == {"2"}
    assert base64.b64decode(m0["storages"]["0"]) == b"1"
    assert m1["entries"][0] == ["b", "float32", [4, 4], [1, 4], 16, 0]  # a transposed view at its offset
    assert m1["entries"][1] == ["c", "float32", [4, 4], [4, 1], 32, 0, [0, 1, 2]]
    assert m2["entries"][0] == ["q2", "float32", [2, 8], [8, 1], 0, 2]
    assert reused == [2, 3]  # bucket 2 reuses bucket 0's slot, the end bucket 1's
    # a slot's tensors are dropped once its bucket was waited for; the last bucket's stay until the sender's end
    assert [t.shape for t in held[0]] == [(2, 8)] and held[1] == []
