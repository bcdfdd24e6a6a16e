"""Peak memory of named phases of a worker process (old_log_prob, update_actor, ...), for the trainer's
`memory/*` metrics.

On CUDA: the peak allocated by torch's caching allocator during the phase (reset at the phase start). On CPU: the
peak resident set size during the phase, read from Linux's VmHWM, which writing "5" to /proc/self/clear_refs resets
to the current RSS; where that file cannot be written the phase reports the RSS at its end instead. Both cost a
few microseconds per phase, so every call of a tracked method measures.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmHWM, VmRSS) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _reset_rss_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.kind = "cuda_peak" if self.cuda else "rss_peak"
        self.device = torch.cuda.get_device_name() if self.cuda else "CPU"
        self.phases: dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        high_water = not self.cuda and _reset_rss_high_water()
        try:
            yield
        finally:
            if self.cuda:
                peak = torch.cuda.max_memory_allocated()
            else:
                peak = _status_bytes("VmHWM" if high_water else "VmRSS")
            self.phases[phase] = max(self.phases.get(phase, 0), peak)

    def take(self) -> dict[str, Any]:
        """The peaks since the last `take` (bytes per phase), the kind of memory and the device name."""
        phases, self.phases = self.phases, {}
        return {"kind": self.kind, "device": self.device, "phases": phases}


def phase_memory(worker: Any) -> PhaseMemory:
    """The worker's tracker, created on first use (workers need no constructor change)."""
    if "_phase_memory" not in worker.__dict__:
        worker._phase_memory = PhaseMemory()
    return worker._phase_memory


def tracks_memory(phase: str) -> Callable[[F], F]:
    """Method decorator: record the peak memory of each call under `phase`. Put it under `@register`."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with phase_memory(self)(phase):
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def device_memory() -> dict[str, float]:
    """This device's memory in GiB: `used` by every process on it (the rollout engine beside the trainer too, as
    the driver reports it), this process's allocator `reserved` and `allocated`; {} on a CPU-only host."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"used": (total - free) / 2**30, "total": total / 2**30,
            "reserved": torch.cuda.memory_reserved() / 2**30, "allocated": torch.cuda.memory_allocated() / 2**30}


def release_cached_blocks() -> None:
    """Give the caching allocator's free blocks back to the device, so another process (the rollout engine, whose
    own allocator cannot see them) can have them. Freed tensors whose last reference sits in a cycle are collected
    first."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
