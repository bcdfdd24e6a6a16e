"""The weight-sync interface and its control channel.

Trainer side (rank 0 of the sync group): `WeightSender.prepare()` returns the spec every receiver needs (a plain
dict: it crosses Ray and vLLM's msgpack RPC), the rollout receivers are started with it, then
`init_process_group()` (rendezvous), `send_weights(stream)` and `finalize()`. Rollout side (ranks 1 … N):
`WeightReceiver(spec, rank)`, `init_process_group()`, `receive_weights()` (an iterator of per-bucket lists of
(hf_name, tensor), valid until the next item is requested: the caller loads them in place in between) and
`finalize()`.

Control messages (bucket metadata, acknowledgements, errors) travel through a TCPStore hosted by the sender, so the
same code runs without Ray or vLLM (the GPU benchmark) and every wait has the deadline `weight_sync.timeout_s`.
When a wait expires the error names the stage, the ranks that did not answer and that knob.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

import torch

TIMEOUT_KNOB = "weight_sync.timeout_s"
# Polling of the control store (see Control.wait): pauses double from the first, but never exceed a twentieth of
# the time already waited (a hand-over in a pipelined sync is noticed within ~5% of its wait) nor the maximum.
_FIRST_PAUSE_S, _MAX_PAUSE_S, _PAUSE_FRACTION = 1e-5, 1e-3, 0.05


class WeightSyncTimeout(TimeoutError):
    pass


class WeightSyncPeerError(RuntimeError):
    pass


def timeout_error(transport: str, stage: str, missing: Iterable[Any], timeout_s: float) -> WeightSyncTimeout:
    return WeightSyncTimeout(
        f"weight sync ({transport}): stage '{stage}' timed out after {timeout_s:g} s; ranks that did not answer: "
        f"{sorted(missing)} (rank 0 is the trainer, 1… the rollout workers). Raise {TIMEOUT_KNOB} if the transfer "
        "is only slow, otherwise look at those ranks' logs"
    )


class Control:
    """Keys of one sync session in a TCPStore: every wait polls for a peer's error and honours one deadline."""

    def __init__(self, spec: dict[str, Any], rank: int, store: Any = None, connect_s: float | None = None) -> None:
        from torch.distributed import TCPStore

        self.spec, self.rank = spec, rank
        self.transport = spec["transport"]
        self.timeout_s = float(spec["timeout_s"])
        self.prefix = spec["session"]
        self.store = store or TCPStore(
            spec["host"], spec["port"], None, False, timeout=datetime.timedelta(seconds=connect_s or self.timeout_s)
        )

    @classmethod
    def host(cls, transport: str, world_size: int, timeout_s: float, host: str = "127.0.0.1") -> Control:
        from torch.distributed import TCPStore

        # A TCPStore given only a port listens on every interface; bound by us it listens on `host` alone, so the
        # weight-update endpoint is not reachable from other machines unless weight_sync.host says so.
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.bind((host, 0))
        listener.listen(1024)
        store = TCPStore(host, listener.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.fileno())
        spec = {"transport": transport, "host": host, "port": store.port, "world_size": world_size,
                "timeout_s": timeout_s, "session": ""}
        control = cls(spec, 0, store)
        control.new_session()
        control.listener = listener  # the store serves on this socket: keep it open as long as the store
        return control

    def new_session(self) -> None:
        """Key the next sync's messages apart from the last one's (a sender whose group outlives a sync)."""
        self.prefix = f"mrl_ws_{uuid.uuid4().hex[:12]}"
        self.spec = {**self.spec, "session": self.prefix}

    def key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def set(self, value: Any, *parts: Any) -> None:
        self.store.set(self.key(*parts), json.dumps(value))

    def get(self, stage: str, *parts: Any, sender: int = 0) -> Any:
        self.wait(stage, {sender: self.key(*parts)})
        return json.loads(self.store.get(self.key(*parts)))

    def fail(self, error: BaseException) -> None:
        """Tell every peer that this rank gave up (they stop waiting at once instead of at the deadline)."""
        with contextlib.suppress(Exception):  # the store itself may be what failed
            self.store.set(self.key("error"), f"rank {self.rank}: {type(error).__name__}: {error}")

    def raise_peer_error(self, stage: str) -> None:
        """Raise the error a peer reported (`fail`), if one did."""
        if self.store.check([self.key("error")]):
            message = self.store.get(self.key("error")).decode()
            raise WeightSyncPeerError(f"weight sync ({self.transport}) stage '{stage}': {message}")

    def wait(self, stage: str, keys: dict[int, str], timeout_s: float | None = None) -> None:
        """Wait until every key exists ({rank that writes it: key}); raise naming the ranks whose key is missing."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + limit
        pending = dict(keys)
        pause = _FIRST_PAUSE_S
        while True:
            for r in [r for r, k in pending.items() if self.store.check([k])]:
                pending.pop(r)
            if not pending:
                return
            self.raise_peer_error(stage)
            if time.monotonic() > deadline:
                raise timeout_error(self.transport, stage, pending, limit)
            # Polling, not store.wait: a waiter must also notice a peer's error, and short pauses keep a
            # pipelined sync's hand-overs quick while long waits cost little CPU.
            time.sleep(pause)
            waited = time.monotonic() - start
            pause = min(pause * 2, _MAX_PAUSE_S, max(_FIRST_PAUSE_S, _PAUSE_FRACTION * waited))

    def join(self) -> None:
        """Rendezvous: the sender waits for every receiver (so a missing one is named up front) and then lets
        them go. Receivers give the sender twice the limit: its own wait is the one that names who is missing."""
        self.set(1, "joined", self.rank)
        if self.rank == 0:
            ranks = range(1, self.spec["world_size"])
            try:
                self.wait("rendezvous", {r: self.key("joined", r) for r in ranks})
            except WeightSyncTimeout as error:
                self.fail(error)
                raise
            self.set(1, "go")
        else:
            self.wait("rendezvous", {0: self.key("go")}, timeout_s=2 * self.timeout_s)


class WeightSender(ABC):
    """Trainer rank 0's side of one weight sync (see the module docstring for the order of calls)."""

    transport = ""

    def __init__(
        self, world_size: int, bucket_bytes: int, timeout_s: float, host: str = "127.0.0.1", keep_group: bool = False
    ) -> None:
        if bucket_bytes < 1024:
            raise ValueError(f"weight-sync bucket size must be >= 1 KiB, got {bucket_bytes} bytes")
        self.world_size, self.bucket_bytes, self.timeout_s, self.host = world_size, bucket_bytes, timeout_s, host
        self.keep_group = keep_group
        self.control: Control | None = None

    @property
    def keeps_group(self) -> bool:
        """Whether a successful `finalize` keeps store, group and buffers for the next sync (transports that have
        a group to keep say so)."""
        return False

    def prepare(self) -> dict[str, Any]:
        """Start the control store (or, on a kept link, a new session in it) and allocate buffers; return the spec
        for the receivers."""
        if self.control is None:
            self.control = Control.host(self.transport, self.world_size, self.timeout_s, self.host)
        else:
            self.control.new_session()
        return {**self.control.spec, "bucket_bytes": self.bucket_bytes, **self._prepare()}

    def _prepare(self) -> dict[str, Any]:
        return {}

    def init_process_group(self) -> None:
        self.control.join()

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send the stream; returns the number of tensors sent. A failure is reported to the receivers."""
        try:
            return self._send(named_tensors)
        except BaseException as error:
            self.control.fail(error)
            raise

    @abstractmethod
    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def finalize(self, wait: bool = True) -> None:
        """Wait until every receiver has finished (`wait`; skipped after a failure), then free buffers, the group
        and last the store (receivers read their final keys from it). A sender that `keeps_group` keeps all three
        after a sync that succeeded and only clears the sync's keys; any failure, or `wait=False`, tears down."""
        if self.control is None:
            return
        kept = False
        try:
            if wait:
                self.wait_done()
                kept = self.keeps_group
        finally:
            if kept:
                self._clear_session()
            else:
                self._finalize()
                self.control = None

    def _clear_session(self) -> None:
        return None

    def wait_done(self) -> None:
        """Wait until every receiver reports it has loaded the whole stream."""
        ranks = range(1, self.world_size)
        self.control.wait("finalize", {r: self.control.key("done", r) for r in ranks})

    def _finalize(self) -> None:
        return None


class WeightReceiver(ABC):
    """One rollout worker's side (rank >= 1 of the sync group)."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        if not 1 <= rank < spec["world_size"]:
            raise ValueError(f"weight-sync receiver rank {rank} outside 1..{spec['world_size'] - 1}")
        self.spec, self.rank = spec, rank
        self.control = Control(spec, rank)

    def init_process_group(self) -> None:
        self.control.join()

    def receive_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        try:
            yield from self._receive()
        except BaseException as error:
            if not isinstance(error, GeneratorExit):
                self.control.fail(error)
            raise

    @abstractmethod
    def _receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    @classmethod
    def for_sync(cls, spec: dict[str, Any], rank: int) -> WeightReceiver:
        """This process's receiver for the sync of `spec` (transports that keep a group reuse theirs)."""
        return cls(spec, rank)

    def finalize(self) -> None:
        self.control.set(1, "done", self.rank)

    def close(self) -> None:
        """Release what this receiver holds after a failed sync (nothing unless the transport keeps a group)."""
        return None


def sync_device() -> None:
    """Wait for this process's queued device copies (before a buffer is announced or given back)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
