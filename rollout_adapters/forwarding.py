"""Receive a weight-sync stream in the adapter process and forward it to an engine that is not ours to extend.

SGLang (an HTTP server) and TensorRT-LLM (AsyncLLM) take weights through their own update entry points, with one
entry per TP rank in each call. So the adapter process runs one `mrl.weight_sync` receiver per engine worker (the
ranks the trainer allotted this replica), each in its own thread (the transports' rendezvous and collectives are
blocking, and every rank must reach them), and a round barrier gathers bucket k of every rank into one call whose
rank-j entry is what rank j received: with TP slices (mrl/weight_sync/buckets.py) that is rank j's own slice.
A rank whose stream has ended contributes an empty list to later rounds (per-device senders may cut their streams
into different numbers of buckets).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

Named = list[tuple[str, torch.Tensor]]


def worker_pairs(spec: dict[str, Any] | list, rank: int, workers: int) -> list[tuple[dict[str, Any], int]]:
    """One (spec, group rank) per engine worker: worker i is rank `rank` + i of the one sender's group, or, given a
    list (a per-device sync), what entry i says."""
    if isinstance(spec, list):
        if len(spec) != workers:
            raise ValueError(f"weight sync: {len(spec)} (spec, rank) pairs for an engine of {workers} workers")
        return [(dict(s), int(r)) for s, r in spec]
    return [(spec, rank + i) for i in range(workers)]


def worker_device(spec: dict[str, Any], worker: int) -> int | None:
    """The CUDA device (index in this process) of engine worker `worker`: the GPU whose UUID the spec names (`ipc`
    buffers live there), else the worker's index among the visible GPUs; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    wanted = spec.get("gpu")
    if wanted is None:
        return worker % torch.cuda.device_count()
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == wanted:
            return index
    raise ValueError(f"weight_sync.transport={spec['transport']}: engine worker {worker}'s buffers are on GPU "
                     f"{wanted}, which this adapter process does not see")


class RoundBarrier:
    """Gathers one bucket from every rank still receiving, then calls `forward(per_rank)` once for them all (in the
    thread that completed the round); a failure anywhere wakes every rank with it."""

    def __init__(self, ranks: int, forward: Callable[[list[Named]], None]) -> None:
        self.ranks, self.forward = ranks, forward
        self.cond = threading.Condition()
        self.active = set(range(ranks))
        self.pending: dict[int, Named] = {}
        self.round = 0
        self.error: BaseException | None = None

    def deliver(self, rank: int, named: Named) -> None:
        with self.cond:
            self._raise()
            self.pending[rank] = named
            mine = self.round
            self._flush_if_ready()
            while self.round == mine and self.error is None:
                self.cond.wait()
            self._raise()

    def leave(self, rank: int, error: BaseException | None = None) -> None:
        """Rank `rank` has no more buckets (its stream ended, or it failed with `error`)."""
        with self.cond:
            self.active.discard(rank)
            if error is not None and self.error is None:
                self.error = error
            self._flush_if_ready()
            self.cond.notify_all()

    def _flush_if_ready(self) -> None:
        if self.error is not None or not self.pending or not self.active <= set(self.pending):
            return
        batch = [self.pending.get(r, []) for r in range(self.ranks)]
        self.pending = {}
        try:
            self.forward(batch)
        except BaseException as error:
            self.error = error
        self.round += 1
        self.cond.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight forwarding stopped: {type(self.error).__name__}: {self.error}") from self.error


def receive_and_forward(
    pairs: Sequence[tuple[dict[str, Any], int]],
    forward: Callable[[list[Named]], None],
    prepare: Callable[[list[Named]], list[Named]] | None = None,
) -> int:
    """Receive every pair's stream (blocking; run it off the event loop) and forward bucket by bucket; returns the
    tensors worker 0 loaded. `prepare` maps a rank's bucket before the barrier (e.g. copies the transport's views
    into memory the adapter owns and can share)."""
    from mrl.weight_sync import receive_into, report_failure

    barrier = RoundBarrier(len(pairs), forward)
    counts: list[int] = [0] * len(pairs)
    errors: list[BaseException | None] = [None] * len(pairs)

    def run(worker: int, spec: dict[str, Any], rank: int) -> None:
        def load(named: Named) -> None:
            barrier.deliver(worker, prepare(named) if prepare is not None else named)

        started = False
        try:
            device = worker_device(spec, worker)
            if device is not None:
                torch.cuda.set_device(device)  # per thread: the receiver and `prepare` work on this device
            started = True
            counts[worker] = receive_into(spec, rank, load)  # reports its own failures to the sender
        except BaseException as error:
            if not started:
                report_failure(spec, rank, error)  # else the sender would wait for this rank to its deadline
            errors[worker] = error
            barrier.leave(worker, error)
            return
        barrier.leave(worker)

    threads = [threading.Thread(target=run, args=(w, s, r), name=f"mrl-weight-forward-{w}", daemon=True)
               for w, (s, r) in enumerate(pairs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The first failure is the cause; the others are the barrier passing it on.
    first = barrier.error or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return counts[0]


def owned_copy(named: Named) -> Named:
    """Copies the adapter owns, kept alive until the engine's call returns: the transport's tensors are views of its
    buffers (refilled after this bucket; CUDA IPC-imported memory cannot be shared again). With CUDA they go onto
    this thread's device (the worker's), so the engine gets CUDA IPC handles whatever the transport."""
    if not torch.cuda.is_available():
        return [(name, tensor.clone()) for name, tensor in named]
    moved = [(name, tensor.to(torch.cuda.current_device(), copy=True)) for name, tensor in named]
    torch.cuda.current_stream().synchronize()  # the engine's process reads them through its own streams
    return moved
