"""`nccl`: weight sync to standalone replicas through a process group of its own (gloo on CPU).

The group is trainer rank 0 plus every rollout worker, built from its own TCPStore with the c10d backend classes
directly (`ProcessGroupNCCL` / `ProcessGroupGloo`), like vLLM's StatelessProcessGroup: it never touches the
default group that Megatron (trainer) or vLLM (workers) already initialised. Buckets are broadcast from rank 0 with
two buffers per side: the sender packs bucket k+1 while bucket k is in flight; a receiver posts the receive of
bucket k+1 before it loads bucket k. Bucket metadata travels through the store; each receiver records its progress
there, so a stalled broadcast names the ranks that fell behind.

With `keep_group` (weight_sync.keep_group) the group, its buffers and the store outlive a sync that succeeded: the
next sync to the same members is a new session of keys in the same store over the same communicator (creating one
costs hundreds of milliseconds on two GPUs, more across nodes). Each receiving process keeps the receiver of its
rank; a spec naming another group (members changed, or a sync failed and the sender tore its side down) replaces
it. Any failure tears down both sides, so a broken communicator is never reused.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mrl.weight_sync.base import Control, WeightReceiver, WeightSender, sync_device, timeout_error
from mrl.weight_sync.buckets import BucketReader, completed, fill_buckets

NUM_BUFFERS = 2


def _device(spec_device: str | None = None) -> torch.device:
    if spec_device == "cuda" or (spec_device is None and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_group(store: Any, prefix: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> Any:
    """A process group of the sync's members: its own store prefix, no default-group registration."""
    from torch.distributed import PrefixStore

    store = PrefixStore(f"{prefix}/pg/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        with contextlib.suppress(AttributeError):  # private field: absent in some torch versions
            options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


def destroy_group(group: Any) -> None:
    """Release an NCCL communicator now, without a collective step (a gloo group just closes its sockets when
    dropped). Called after every peer reported done, so nothing is in flight."""
    abort = getattr(group, "abort", None)
    if group is not None and abort is not None and type(group).__name__ == "ProcessGroupNCCL":
        with contextlib.suppress(Exception):
            abort()


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def connect(group: Any, device: torch.device) -> None:
    """Create the communicator now: NCCL builds it lazily inside the first collective (hundreds of ms for two
    GPUs), which would otherwise be paid inside the first bucket's broadcast and mistaken for transfer time."""
    broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device)).wait()
    sync_device()


class NcclSender(WeightSender):
    transport = "nccl"

    def __init__(self, *args: Any, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device(device) if device is not None else _device()
        self.group: Any = None
        self.group_id = ""
        self.buffers: list[torch.Tensor] = []
        self.buckets_sent = 0

    @property
    def keeps_group(self) -> bool:
        return self.keep_group

    def _prepare(self) -> dict[str, Any]:
        if self.group is None:  # a new group (first sync, or after a teardown): named after this session
            self.group_id = self.control.prefix
            self.buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
                            for _ in range(NUM_BUFFERS)]
        return {"device": self.device.type, "group": self.group_id, "keep_group": self.keep_group}

    def init_process_group(self) -> None:
        super().init_process_group()
        if self.group is None:
            c = self.control
            self.group = new_group(c.store, self.group_id, 0, self.world_size, self.device, self.timeout_s)
            connect(self.group, self.device)

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        c, works = self.control, [None] * NUM_BUFFERS

        def before_reuse(k: int) -> None:
            self._wait(works[k % NUM_BUFFERS], k - NUM_BUFFERS)

        count = k = 0
        for k, slot, entries, used in fill_buckets(named_tensors, self.buffers, before_reuse):
            # No host sync before the announcement: the broadcast is queued behind the bucket's copies (the
            # process group orders its stream after the current one), so the host only runs ahead.
            c.set({"entries": entries, "bytes": used}, "meta", k)
            works[slot] = (broadcast(self.group, self.buffers[slot][:used]), k)
            count += completed(entries)
            k += 1
        c.set({"end": True}, "meta", k)
        self.buckets_sent = k
        for work in works:
            self._wait(work, None)
        return count

    def _wait(self, work: Any, bucket: int | None) -> None:
        if work is None:
            return
        handle, k = work
        try:
            handle.wait()
        except Exception as error:  # a receiver that gave up (it says why), the backend's timeout, a dead peer
            c = self.control
            c.raise_peer_error(f"broadcast of bucket {k}")
            behind = [r for r in range(1, self.world_size)
                      if not c.store.check([c.key("received", k, r)])]
            raise timeout_error(self.transport, f"broadcast of bucket {k}", behind, self.timeout_s) from error

    def _clear_session(self) -> None:
        """Delete the finished sync's keys from the kept store (it would otherwise grow by every sync's metadata)."""
        c, receivers = self.control, range(1, self.world_size)
        keys = [c.key("go"), c.key("joined", 0)] + [c.key("meta", k) for k in range(self.buckets_sent + 1)]
        keys += [c.key(stage, r) for stage in ("joined", "done") for r in receivers]
        keys += [c.key("received", k, r) for k in range(self.buckets_sent) for r in receivers]
        for key in keys:
            c.store.delete_key(key)

    def _finalize(self) -> None:
        self.buffers = []
        destroy_group(self.group)
        self.group = None


# Per receiving process and rank: the receiver whose group outlives its sync (keep_group).
_KEPT: dict[int, NcclReceiver] = {}


class NcclReceiver(WeightReceiver):
    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        super().__init__(spec, rank)
        self.device = _device(spec["device"])
        self.group: Any = None
        self.buffers = [torch.empty(spec["bucket_bytes"], dtype=torch.uint8, device=self.device)
                        for _ in range(NUM_BUFFERS)]

    @classmethod
    def for_sync(cls, spec: dict[str, Any], rank: int) -> NcclReceiver:
        kept = _KEPT.pop(rank, None)
        if kept is not None and kept.spec.get("group") == spec.get("group") and spec.get("keep_group"):
            kept.spec = spec  # same group, next session: new keys, same store connection, group and buffers
            kept.control = Control(spec, rank, store=kept.control.store)
            receiver = kept
        else:
            if kept is not None:
                kept.close()
            receiver = cls(spec, rank)
        if spec.get("keep_group"):
            _KEPT[rank] = receiver
        return receiver

    def init_process_group(self) -> None:
        super().init_process_group()
        if self.group is None:
            c = self.control
            self.group = new_group(c.store, self.spec["group"], self.rank, self.spec["world_size"], self.device,
                                   c.timeout_s)
            connect(self.group, self.device)

    def _post(self, k: int) -> tuple[dict[str, Any], Any]:
        meta = self.control.get(f"bucket {k} announced", "meta", k)
        if meta.get("end"):
            return meta, None
        return meta, broadcast(self.group, self.buffers[k % NUM_BUFFERS][: meta["bytes"]])

    def _receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        c, reader, k = self.control, BucketReader(), 0
        meta, work = self._post(0)
        while work is not None:
            work.wait()
            c.set(1, "received", k, self.rank)
            following = self._post(k + 1)  # the next bucket arrives while this one is loaded
            yield reader.read(self.buffers[k % NUM_BUFFERS], meta["entries"])
            sync_device()
            meta, work = following
            k += 1
        reader.check_complete()

    def finalize(self) -> None:
        sync_device()
        super().finalize()  # report done first: the sender destroys its side only after every receiver is done
        if not self.spec.get("keep_group"):
            self.close()

    def close(self) -> None:
        if _KEPT.get(self.rank) is self:
            del _KEPT[self.rank]
        self.buffers = []
        destroy_group(self.group)
        self.group = None
