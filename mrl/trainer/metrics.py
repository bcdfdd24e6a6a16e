"""Observability of a run: named stage timers, derived step metrics (throughput, MFU, memory per phase,
staleness), the per-step rollout dump and `RunLogger`, which fans each step's metrics out to the loggers of
`trainer.logger` (mrl/trainer/loggers.py).

Metric names:
- `timing_s/<stage>`: wall seconds of a stage of the step (gen, reward, balance, old_log_prob, ref, teacher, values,
  adv, update_critic, update_actor, save_checkpoint, update_weights, validate) and of the whole `step`.
- `distill/kl`: with algorithm.distill, the mean over the step's model tokens of student − teacher log-prob of the
  sampled token, the sampled estimate of KL(student ‖ teacher) (mrl/algo/distill.py).
- `perf/tokens_per_s`, `perf/tokens_per_s_per_gpu`: prompt + response tokens of the training batch per second of
  the step, in all and per device (a device slot on CPU).
- `perf/mfu/<stage>`, `perf/mfu`: model FLOPs utilisation of a trainer stage, and of the whole step (generation
  counted as one forward pass over the batch), against `trainer.peak_tflops_per_device`.
- `memory/cuda_peak_gib/<phase>` (GPU) or `memory/rss_peak_gib/<phase>` (CPU): the largest over the workers of the
  peak CUDA memory allocated, or the peak resident set size, during a worker phase.
- `train/skipped_step`: 1 when the step trained nothing because dynamic sampling kept no prompt group within
  `data.max_sample_rounds` rounds (mrl/trainer/ppo_trainer.py `skip_step`), else 0.
- `staleness/mean`, `staleness/max`: trainer version − the oldest weight version of a trajectory's tokens (0 in sync
  mode).
- `reward/<data_source>/error_rate`: the share of reward calls for that source since the previous step that failed
  (exception, timeout, non-finite score; each scored 0); past `reward.max_error_rate` the run stops
  (mrl/reward/errors.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl.trainer.loggers import StepLogger, make_loggers


class StageTimer:
    """Wall seconds per named stage of one step (a stage entered twice, e.g. a refill round, accumulates)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


# ---- model FLOPs and MFU ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of a model's passes, by PaLM's convention (Chowdhery et al. 2022, appendix B): a token in a sequence
    of T tokens costs 2·N + 4·L·H·Q·T forward and three times that (6·N + 12·L·H·Q·T) forward + backward, with N
    the parameters a token passes through (MoE: active experts only; without the input embedding, a lookup), L
    layers, H heads of width Q (H·Q = `attention_width`; MLA: the mean of its QK and V head widths)."""

    params: int
    layers: int
    attention_width: float

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> ModelFlops:
        from mrl.config.model_shape import shape_from_config

        shape = shape_from_config(c)
        heads = c["num_attention_heads"]
        if c.get("kv_lora_rank"):
            head = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) / 2
        else:
            head = c.get("head_dim") or c["hidden_size"] // heads
        # Tied embeddings: the output projection is still a matmul per token, with the embedding's weights.
        lm_head = shape.output_params or shape.embedding_params
        params = shape.active_params - shape.embedding_params - shape.output_params + lm_head
        return cls(params, shape.num_layers, heads * head)

    @classmethod
    def from_model_path(cls, path: str) -> ModelFlops | None:
        """From `<path>/config.json` (or the built-in shape of that name); None where neither exists."""
        from mrl.config.model_shape import resolve_model_config

        try:
            return cls.from_hf_config(resolve_model_config(path)[0])
        except (FileNotFoundError, KeyError):
            return None

    def forward(self, lengths: Sequence[int]) -> float:
        """Forward FLOPs of sequences of these lengths."""
        return sum(t * (2.0 * self.params + 4.0 * self.layers * self.attention_width * t) for t in lengths)


# Dense bf16 tensor-core peaks in TFLOP/s, matched as words in the device name (longest first, so H200 ≠ H20).
PEAK_TFLOPS = {"GB200": 2500.0, "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0,
               "A100": 312.0, "A800": 312.0, "L40S": 362.0, "MI300X": 1307.0, "CPU": 1.0}


def peak_flops(device_name: str, tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured `tflops`, else the table's entry for `device_name`, else None."""
    if tflops:
        return tflops * 1e12
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"\b{key}\b", device_name, re.IGNORECASE):
            return PEAK_TFLOPS[key] * 1e12
    return None


# Passes over the batch per trainer stage, in forward-pass units (a backward pass costs two forwards). The
# distillation teacher's stage is left out: its FLOPs are another model's, which the policy's shape does not give.
STAGE_PASSES = {"old_log_prob": 1, "ref": 1, "values": 1, "update_critic": 3, "update_actor": 3}


def mfu_metrics(flops: ModelFlops, lengths: Sequence[int], seconds: dict[str, float], peak: float, *,
                trainer_devices: int, run_devices: int, actor_epochs: int = 1,
                stage_share: dict[str, float] | None = None) -> dict[str, float]:
    """`perf/mfu/<stage>` for each timed trainer stage (on the trainer's devices), and `perf/mfu` over the whole
    step (`seconds["step"]`, on all the run's devices), which counts generation as one forward pass over the batch
    (KV-cached decoding computes each token once). `stage_share`: the share of the batch a stage computed (the
    old log-prob pass skips the rows the first update trains on-policy)."""
    forward = flops.forward(lengths)
    out, total = {}, 0.0
    for stage, passes in STAGE_PASSES.items():
        if stage in seconds:
            share = (stage_share or {}).get(stage, 1.0)
            done = forward * passes * share * (actor_epochs if stage == "update_actor" else 1)
            total += done
            out[f"perf/mfu/{stage}"] = done / (max(seconds[stage], 1e-9) * trainer_devices * peak)
    if "gen" in seconds:
        total += forward
    if "step" in seconds:
        out["perf/mfu"] = total / (max(seconds["step"], 1e-9) * run_devices * peak)
    return out


def perf_metrics(lengths: Sequence[int], seconds: dict[str, float], memory: list[dict[str, Any]],
                 flops: ModelFlops | None, peak_tflops: float | None, *, trainer_devices: int, run_devices: int,
                 actor_epochs: int = 1, stage_share: dict[str, float] | None = None) -> dict[str, float]:
    """Throughput, the workers' peak memory per phase and MFU (where the model's shape and the device's peak FLOP/s
    are known) of one step: `lengths` of the batch's sequences, `seconds` per stage (and "step"), `memory` from
    every worker's `memory_stats()`."""
    out = throughput_metrics(lengths, seconds["step"], run_devices)
    out.update(memory_metrics(memory))
    out.update(state_metrics(memory))
    peak = peak_flops(memory[0]["device"], peak_tflops) if memory else None
    if flops is not None and peak is not None:
        out.update(mfu_metrics(flops, lengths, seconds, peak, trainer_devices=trainer_devices,
                               run_devices=run_devices, actor_epochs=actor_epochs, stage_share=stage_share))
    return out


def throughput_metrics(lengths: Sequence[int], step_seconds: float, devices: int) -> dict[str, float]:
    per_s = sum(lengths) / max(step_seconds, 1e-9)
    return {"perf/tokens_per_s": per_s, "perf/tokens_per_s_per_gpu": per_s / max(devices, 1)}


# ---- memory per phase and staleness -----------------------------------------------------------------------------

def memory_metrics(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The largest peak over the workers for each phase, from `PhaseMemory.take()` of every rank."""
    out: dict[str, float] = {}
    for rank in per_rank:
        for phase, nbytes in rank["phases"].items():
            key = f"memory/{rank['kind']}_gib/{phase}"
            out[key] = max(out.get(key, 0.0), nbytes / 2**30)
    return out


def state_metrics(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The actor's optimizer state (the largest rank's and all ranks' GiB) and trainable parameters (the model's),
    from the ranks' `memory_stats()` that carry them (LoRA vs full fine-tuning: the state shrinks with them)."""
    ranks = [r for r in per_rank if "optimizer_state_bytes" in r]
    if not ranks:
        return {}
    state = [r["optimizer_state_bytes"] / 2**30 for r in ranks]
    return {"memory/optimizer_state_gib": max(state), "memory/optimizer_state_gib_total": sum(state),
            "actor/trainable_params": float(sum(r["trainable_params"] for r in ranks))}


def staleness_metrics(trajectories: list[dict[str, Any]], trainer_version: int) -> dict[str, float]:
    """How many weight versions behind the trainer each trajectory's oldest token is (`min_version`, stamped by
    the rollout; -1 where a trajectory has no token)."""
    lags = [trainer_version - t["min_version"] for t in trajectories if t.get("min_version", -1) >= 0]
    if not lags:
        return {}
    return {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}


def agent_loop_metrics(trajectories: list[dict[str, Any]], prefix: str = "rollout") -> dict[str, float]:
    """Multi-turn shape of the trajectories (records of the agent loops): turns and tool calls per trajectory,
    error observations, seconds spent in tools, the share of response tokens that are observations, and the
    share of trajectories with at least one call answered without error (`tool_success_rate`)."""
    n = max(len(trajectories), 1)
    calls = sum(t.get("tool_calls", 0) for t in trajectories)
    errors = sum(t.get("tool_errors", 0) for t in trajectories)
    response = sum(t["response_len"] for t in trajectories)
    observation = response - sum(t["model_tokens"] for t in trajectories)
    return {
        f"{prefix}/turns_mean": sum(t.get("num_turns", 1) for t in trajectories) / n,
        f"{prefix}/tool_calls_mean": calls / n,
        f"{prefix}/tool_errors": float(errors),
        f"{prefix}/tool_error_rate": errors / max(calls, 1),
        f"{prefix}/tool_seconds": sum(t.get("tool_seconds", 0.0) for t in trajectories),
        f"{prefix}/observation_token_share": observation / max(response, 1),
        f"{prefix}/tool_success_rate": sum(t.get("tool_calls", 0) > t.get("tool_errors", 0)
                                           for t in trajectories) / n,
    }


# ---- the run's logger -------------------------------------------------------------------------------------------

class RunLogger:
    """Sends each step's metrics to the loggers named in `loggers` (console, jsonl, tensorboard, wandb) and keeps
    them in `history`; `dump_rollouts` writes sampled trajectories (prompt, response, reward, version) of each step
    to `rollouts.jsonl`. File loggers need `out_dir` (the run folder); `close()` flushes them."""

    def __init__(
        self,
        out_dir: str | Path | None,
        loggers: Sequence[str] = ("console", "jsonl"),
        *,
        dump_per_step: int = 8,
        total_steps: int | None = None,
        project: str = "mrl",
        experiment: str = "run",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dump_per_step = dump_per_step
        self.history: list[dict[str, Any]] = []
        self.loggers: list[StepLogger] = make_loggers(
            list(loggers), self.out_dir, total_steps=total_steps, project=project, experiment=experiment,
            config=config,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.history.append({"step": step, **metrics})
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()

    def dump_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.out_dir or self.dump_per_step == 0:
            return
        with open(self.out_dir / "rollouts.jsonl", "a") as f:
            for row in rows[: self.dump_per_step]:
                f.write(json.dumps({"step": step, **row}) + "\n")


def reward_part_metrics(trajectories: list[dict[str, Any]]) -> dict[str, float]:
    """`reward/<name>/mean` of each part of the reward (`rule` and every reward model) when reward.models is set."""
    names = trajectories[0].get("reward_parts", {}) if trajectories else {}
    return {f"reward/{name}/mean": sum(t["reward_parts"][name] for t in trajectories) / len(trajectories)
            for name in names}


def held_out_accuracy(trajectories: list[dict[str, Any]]) -> float:
    """Share of (greedy) trajectories the rule reward passes (score > 0): the verifiable check decides, whatever
    reward models add and whatever weight `reward.rule_weight` gives the rule in the training reward."""
    passed = sum(t.get("reward_parts", {}).get("rule", t["score"]) > 0 for t in trajectories)
    return passed / len(trajectories)
