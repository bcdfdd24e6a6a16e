"""A small local launcher: run a function in N spawned processes that form one torch.distributed world.

For tests and tools on one machine. Each process gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in
its environment (so `mrl.engine.megatron.parallel.init_distributed()` needs no arguments) and one CPU thread,
and calls `fn(rank, world_size, *args)`; the launcher returns the per-rank results in rank order. Rank 0 binds
the port it hands the others, so nothing else on the host can take it before the rendezvous.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from mrl.utils.noise import quiet_library_logs


class LaunchError(RuntimeError):
    """A rank raised, died or timed out; the message carries the failing rank's traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _encode(value: Any) -> bytes:
    # torch.save copies tensors into the message. The queue's own pickler would pass shared-memory handles that
    # die with this process (it exits right after), and plain pickle would name megatron-core's replacement of
    # torch.storage._load_from_bytes, making the parent import Megatron (~10 s) just to read a result.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: Sequence[Any],
    env: dict[str, str],
    results: Any,
    threads: int,
    port: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if "MASTER_PORT" not in env:
        _share_rendezvous_port(rank, world_size, port)
    quiet_library_logs()
    # Many ranks share few cores; intra-op threads would oversubscribe them.
    torch.set_num_threads(threads)
    try:
        results.put((rank, True, _encode(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _share_rendezvous_port(rank: int, world_size: int, port: Any) -> None:
    """Rank 0 starts the store server on a port the OS picks and publishes it; the others wait for it (a rank 0
    that dies first makes the launcher stop them)."""
    if rank == 0:
        from mrl.controller.worker import serve_rendezvous

        port.value = serve_rendezvous(os.environ["MASTER_ADDR"], world_size)
    while port.value == 0:
        time.sleep(0.01)
    os.environ["MASTER_PORT"] = str(port.value)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run picklable `fn(rank, world_size, *args)` on `world_size` spawned local processes; return results by rank.

    Raises LaunchError as soon as one rank fails (its traceback in the message), when a process exits without
    a result, or after `timeout_s`; the other processes are then terminated.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    base_env = {"MASTER_ADDR": "127.0.0.1", **(env or {})}
    port = ctx.Value("i", 0)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, args, base_env, results, threads_per_rank, port),
            name=f"mrl-rank{rank}",
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise LaunchError(f"{fn.__name__}: ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    # Give a dying rank's own report a moment to arrive: it is more useful than the exit code.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise LaunchError(f"{fn.__name__}: ranks exited without a result: {codes}") from None
                else:
                    continue
            if not ok:
                raise LaunchError(f"{fn.__name__} failed on rank {rank}/{world_size}:\n{value}")
            out[rank] = _decode(value)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 1.0))
        return [out[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
