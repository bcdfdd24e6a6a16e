"""Where the rollout replicas go: one function for `mrl plan`, the start-up rules and the trainer's build.

A replica occupies TP × DP × PP device slots (its footprint; a prefill/decode replica TP_prefill + TP_decode ×
N_decode). Hybrid replicas sit on the trainer's slots,
standalone ones on their own pool (rollout.nnodes × rollout.n_gpus_per_node). `rollout.num_replicas` > 0 asks
for that many (on the first slots); 0 fills the slots, whose count must then be a multiple of the footprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def replica_count(num_devices: int, footprint_devices: int) -> int:
    """Replicas on `num_devices` slots; a remainder is a configuration error, not idle devices."""
    if footprint_devices < 1 or num_devices < footprint_devices or num_devices % footprint_devices:
        raise ValueError(f"rollout devices ({num_devices}) must be a positive multiple of the replica footprint "
                         f"TP×DP×PP = {footprint_devices}")
    return num_devices // footprint_devices


@dataclass(frozen=True)
class RolloutPlacement:
    pool_devices: int  # slots the rollout may use: the trainer's (hybrid, colocated) or the standalone pool's
    footprint: int  # TP × DP × PP of one replica
    devices: int  # slots the replicas take: num_replicas × footprint, or the whole pool
    standalone: bool

    @property
    def replicas(self) -> int:
        return self.devices // self.footprint if self.footprint >= 1 else 0

    def problem(self) -> tuple[str, str] | None:
        """(setting, rule) when the replicas cannot be placed, else None. `footprint`: the pool is no multiple of
        one replica (the caller names the layout size at fault)."""
        where = "the standalone pool's" if self.standalone else "the trainer's"
        knobs = "rollout" if self.standalone else "resources"
        slots = f"{self.pool_devices} device slots ({knobs}.nnodes × {knobs}.n_gpus_per_node)"
        if self.footprint < 1 or self.pool_devices < 1:
            return None  # a size below 1 is reported by its own range rule
        if self.devices > self.pool_devices:
            return ("rollout.num_replicas", f"{self.replicas} replicas of {self.footprint} devices exceed {where} "
                                            f"{slots}")
        if self.devices % self.footprint:
            return ("footprint", f"{where} {slots} must be a multiple of the replica "
                                 f"footprint TP×DP×PP = {self.footprint} (or set rollout.num_replicas)")
        return None


def rollout_placement(cfg: Any) -> RolloutPlacement:
    r, res = cfg.rollout, cfg.resources
    footprint = r.tensor_model_parallel_size * r.data_parallel_size * r.pipeline_model_parallel_size
    if r.pd.enabled:  # a PD replica: its prefill member's slots, then each decode member's
        footprint = r.pd.prefill_tp + r.pd.decode_tp * r.pd.n_decode
    standalone = r.mode == "standalone"
    pool = r.nnodes * r.n_gpus_per_node if standalone else res.nnodes * res.n_gpus_per_node
    return RolloutPlacement(pool, footprint, r.num_replicas * footprint if r.num_replicas > 0 else pool, standalone)
