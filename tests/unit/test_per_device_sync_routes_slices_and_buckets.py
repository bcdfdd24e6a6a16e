"""The pure parts of the per-device `ipc` sync: which slot's trainer rank feeds which engine worker, when TP slices
pair, how a TP slice crosses a bucket and comes out full-shaped with the slice in place, the step metrics, and the
cores a multi-rank vLLM-CPU engine is bound to."""

from __future__ import annotations

import time

import torch

from bridges.export import TpSlice
from mrl.rollout.device_sync import SentBytes, tp_slices_pair, workers_on_slots
from mrl.rollout.replica import Footprint, server_rank
from mrl.weight_sync.buckets import BucketReader, completed, fill_buckets
from mrl.weight_sync.state_machine import device_sync_metrics
from mrl.workers.cpu_threads import cores_per_rank


def test_replica_workers_sit_on_consecutive_slots_by_replica_rank():
    ids = ["hybrid-1-abcdef", "hybrid-0-123456"]
    assert [server_rank(i) for i in ids] == [1, 0]
    assert workers_on_slots(ids, 2) == {
        2: [("hybrid-1-abcdef", 0)], 3: [("hybrid-1-abcdef", 1)],
        0: [("hybrid-0-123456", 0)], 1: [("hybrid-0-123456", 1)],
    }
    assert workers_on_slots(ids, 1) == {1: [("hybrid-1-abcdef", 0)], 0: [("hybrid-0-123456", 0)]}


def test_slices_pair_only_when_engine_tp_equals_trainer_tp_without_engine_pp_or_dp():
    assert tp_slices_pair(Footprint(tp=2), 2)
    assert not tp_slices_pair(Footprint(tp=1), 2)
    assert not tp_slices_pair(Footprint(tp=2, pp=2), 2)
    assert not tp_slices_pair(Footprint(tp=2, dp=2), 2)
    assert not tp_slices_pair(Footprint(tp=1), 1)  # TP 1: the whole tensor is the slice


def test_a_tp_slice_crosses_the_bucket_and_arrives_full_shaped_with_the_slice_in_place():
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    rows, cols = full[2:4], full[:, 4:]  # rank 1 of 3 along dim 0; rank 1 of 2 along dim 1 (a strided view)
    stream = [("a", rows, TpSlice(0, 1, 3)), ("b", cols, TpSlice(1, 1, 2)), ("c", full)]
    buffers = [torch.zeros(4096, dtype=torch.uint8)]
    ((_, slot, entries, _),) = list(fill_buckets(stream, buffers, lambda k: None))
    assert completed(entries) == 3
    named = dict(BucketReader().read(buffers[slot], entries))
    assert named["a"].shape == (6, 8) and torch.equal(named["a"][2:4], rows)
    assert named["b"].shape == (6, 8) and torch.equal(named["b"][:, 4:], cols)
    assert torch.equal(named["c"], full)


def test_sent_bytes_split_slices_from_whole_tensors_and_metrics_take_the_busiest_device():
    sent = SentBytes(receivers=["r/0"])
    items = [("a", torch.zeros(4), TpSlice(0, 0, 2)), ("b", torch.zeros(2))]
    assert list(sent.count(iter(items))) == items
    assert (sent.tensors, sent.sliced, sent.whole) == (2, 16, 8)
    idle = SentBytes().metrics()
    metrics = device_sync_metrics([sent.metrics(), idle])
    produce_s = metrics.pop("timing_s/sync/produce")
    assert 0.0 < produce_s == sent.produce_s  # the busiest rank's, not a sum
    assert metrics == {"weight_sync/device_bytes_max": 24.0, "weight_sync/bytes_total": 24.0,
                       "weight_sync/tensors": 2.0, "weight_sync/bytes_sliced": 16.0, "weight_sync/bytes_whole": 8.0,
                       "weight_sync/bytes_one_copy": 0.0, "weight_sync/senders": 1.0, "timing_s/sync/ack_wait": 0.0,
                       "timing_s/sync/setup": 0.0, "timing_s/sync/send": 0.0, "timing_s/sync/replica_wait": 0.0,
                       "timing_s/sync/quantize": 0.0}
    sent.one_copy = True  # shared as the trainer's own memory: every byte it sent went by one copy
    assert device_sync_metrics([sent.metrics(), idle])["weight_sync/bytes_one_copy"] == 24.0
    assert device_sync_metrics([{}, {"replica_tensors": [3]}]) == {}  # a result without bytes reports none


def test_multi_rank_vllm_cpu_engines_get_disjoint_core_groups():
    groups = cores_per_rank(2).split("|")
    assert len(groups) == 2
    cores = [set(g.split(",")) for g in groups]
    assert not (cores[0] & cores[1]) or len(cores[0] | cores[1]) == 1  # shared only on a one-core host


def test_sent_bytes_times_the_stream_it_counts_not_the_consumer():
    def slow_export():
        for name in "abc":
            time.sleep(0.02)  # export and quantise happen inside the stream's generators
            yield name, torch.zeros(2)

    sent = SentBytes()
    for _ in sent.count(slow_export()):
        time.sleep(0.05)  # the transport's own work on each tensor is not the stream's
    assert sent.tensors == 3
    assert 0.06 <= sent.produce_s < 0.15
