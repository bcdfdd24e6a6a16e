"""The nccl transport (gloo on CPU) with keep_group: syncs to the same receivers reuse one group, its buffers and
its store (one group built per process however many syncs), each stream arriving bit for bit and each finished
sync's keys deleted from the store; a sync that fails tears the group down on both sides and the next sync builds
a new one that works."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from mrl.weight_sync import WeightSyncPeerError, make_sender, nccl
from tests.integration.test_weight_sync_transports_deliver_bit_identical_streams import (
    BUCKET,
    _receive,
    raw,
    stream,
)

pytestmark = pytest.mark.integration


def counting_new_group(counter: list[int]):
    build = nccl.new_group

    def new_group(*args, **kwargs):
        counter[0] += 1
        return build(*args, **kwargs)

    return new_group


def _receiver(rank: int, inbox, out, groups) -> None:
    """A long-lived rollout worker: one receive per spec it is sent, then how many groups it has built."""
    built = [0]
    nccl.new_group = counting_new_group(built)
    while (job := inbox.get()) is not None:
        _receive(**job, rank=rank, out=out)
        groups.put(built[0])


@pytest.fixture
def receivers():
    ctx = mp.get_context("fork")
    inboxes, out, groups = [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(rank, inboxes[rank - 1], out, groups)) for rank in (1, 2)]
    for p in procs:
        p.start()
    yield inboxes, out, groups
    for inbox in inboxes:
        inbox.put(None)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def test_syncs_reuse_one_group_until_a_failure_rebuilds_it(receivers, monkeypatch):
    inboxes, out, groups = receivers
    built = [0]
    monkeypatch.setattr(nccl, "new_group", counting_new_group(built))
    sender = make_sender("nccl", 3, BUCKET, 60.0, keep_group=True)
    expected = [(name, t.dtype, tuple(t.shape), raw(t)) for name, t in stream()]

    def sync(failing_rank: int | None = None) -> tuple[dict, dict, list[int]]:
        """One sync: the spec, what each receiver got, and how many groups each receiving process has built."""
        spec = sender.prepare()
        for rank, inbox in enumerate(inboxes, start=1):
            inbox.put({"spec": spec, "fail": rank == failing_rank})
        try:
            sender.init_process_group()
            sender.send_weights(stream())
            sender.finalize()
        except BaseException:
            sender.finalize(wait=False)
            raise
        finally:
            received = dict(out.get(timeout=60) for _ in inboxes)
            built_there = [groups.get(timeout=60) for _ in inboxes]
        return spec, received, built_there

    first, received, built_there = sync()
    assert received == {1: expected, 2: expected} and built_there == [1, 1]
    second, received, built_there = sync()
    assert second["group"] == first["group"] and second["session"] != first["session"]
    assert received == {1: expected, 2: expected} and built_there == [1, 1] and built == [1]
    store = sender.control.store  # the finished syncs' keys are gone
    assert not store.check([f"{first['session']}/meta/0"]) and not store.check([f"{second['session']}/done/1"])

    with pytest.raises(WeightSyncPeerError, match="rank 2: RuntimeError: cannot load this bucket"):
        sync(failing_rank=2)
    assert sender.control is None and sender.group is None  # torn down

    fourth, received, built_there = sync()
    assert fourth["group"] != first["group"] and built == [2]
    assert received == {1: expected, 2: expected} and built_there == [2, 2]
    sender.finalize(wait=False)
