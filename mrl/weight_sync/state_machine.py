"""The weight-sync sequence for standalone rollout replicas (trainer mode separate_async).

A standalone pool generates while the actor trains, so a sync interrupts live generation:

    abort          in-flight requests return "aborted" with their tokens so far and admission closes; partial-
                   rollout clients re-send them at once (they park in the paused servers)
    release_kv     free the KV cache (on GPUs the transport's buffers need the memory)
    update_weights the actor streams its weights through `weight_sync.transport` (the transport builds and tears
                   down its process group inside `update_weights`), stamped with the new version
    finalize       every replica must report the new version: a replica left behind would silently serve stale
                   weights stamped as new ones, so this raises instead
    resume_kv      re-allocate the KV cache
    resume         reopen admission: the parked requests continue on the new weights

Each stage is timed (`weight_sync/<stage>_s` metrics) and logged. The order is the adapter's pause contract
(rollout_adapters/base.py): the update itself never reopens a paused server, only `resume_generation` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

STAGES = ("abort", "release_kv", "update_weights", "finalize", "resume_kv", "resume")


@dataclass
class SyncReport:
    version: int
    aborted: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)  # bytes and tensors moved (device_sync_metrics)

    def metrics(self) -> dict[str, float]:
        out = {f"weight_sync/{stage}_s": s for stage, s in self.seconds.items()}
        out.update(self.sent)
        out["weight_sync/total_s"] = sum(self.seconds.values())
        out["weight_sync/aborted_requests"] = float(self.aborted)
        return out


class StandaloneWeightSync:
    """Runs the sequence above. `rollout` is the LLMServerManager of the standalone pool; `update_weights(version)`
    is the trainer-facing call that moves the bytes (`actor_rollout.update_weights`)."""

    def __init__(self, rollout: Any, update_weights: Callable[[int], Any]) -> None:
        self.rollout = rollout
        self.update_weights = update_weights
        self.history: list[SyncReport] = []

    def run(self, version: int) -> SyncReport:
        report = SyncReport(version)
        with self._stage(report, "abort"):
            report.aborted = sum(self.rollout.abort_all())
        with self._stage(report, "release_kv"):
            self.rollout.release_kv_cache()
        with self._stage(report, "update_weights"):
            result = self.update_weights(version)
        if isinstance(result, list):  # the actor's per-rank results (a test's stand-in may return None)
            report.sent = device_sync_metrics(result)
        with self._stage(report, "finalize"):
            self.finalize(version)
        with self._stage(report, "resume_kv"):
            self.rollout.resume_kv_cache()
        with self._stage(report, "resume"):
            self.rollout.resume_generation()
        log.info("weight sync to version %d: %d requests aborted, %.3f s", version, report.aborted,
                 sum(report.seconds.values()))
        self.history.append(report)
        return report

    def finalize(self, version: int) -> None:
        behind = {sid: h["version"] for sid, h in self.rollout.health().items() if h["version"] != version}
        if behind:
            raise RuntimeError(f"weight sync to version {version} did not reach every replica: {behind}")

    @contextmanager
    def _stage(self, report: SyncReport, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        report.seconds[name] = time.perf_counter() - start
        log.info("weight sync v%d: %s %.3f s", report.version, name, report.seconds[name])


# Parts of `timing_s/sync/update` (an ipc sync), each the slowest rank's: produce and ack_wait lie inside send, and
# quantize (rollout.quantization=fp8) inside produce.
IPC_SYNC_PARTS = ("setup", "send", "produce", "quantize", "ack_wait", "replica_wait")


def device_sync_metrics(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Step metrics from every rank's sync result (per device, rank 0's stream, or the adapters): bytes sent per
    device (the busiest one) and in all, split into TP slices and whole tensors, how many of them went by one copy
    (weight_sync.one_copy), and tensors sent; the slowest rank's host seconds in each part of an ipc sync
    (mrl.rollout.device_sync.SentBytes)."""
    ranks = [r for r in per_rank if isinstance(r, dict) and "bytes_whole" in r]
    if not ranks:
        return {}
    per_device = [r["bytes_sliced"] + r["bytes_whole"] for r in ranks]
    return {"weight_sync/device_bytes_max": float(max(per_device)),
            "weight_sync/bytes_total": float(sum(per_device)),
            "weight_sync/tensors": float(sum(r["tensors"] for r in ranks)),
            "weight_sync/bytes_sliced": float(sum(r["bytes_sliced"] for r in ranks)),
            "weight_sync/bytes_whole": float(sum(r["bytes_whole"] for r in ranks)),
            "weight_sync/bytes_one_copy": float(sum(r.get("bytes_one_copy", 0) for r in ranks)),
            "weight_sync/senders": float(sum(bool(r["receivers"]) for r in ranks)),
            **{f"timing_s/sync/{part}": float(max(r.get(f"{part}_s", 0.0) for r in ranks))
               for part in IPC_SYNC_PARTS}}
