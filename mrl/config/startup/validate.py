"""Start-up validation: every cross-field rule of the configuration, run once before any worker starts.

A rule is a function `cfg -> iterable of Violation`, registered with `@rule`. `validate` runs all of them and
raises one `ConfigError` listing every violation, each naming the setting, its value and the rule, so that a bad
recipe is fixed in one round rather than discovered as a hang or a late crash on a cluster. Later features add
their rules in the module of their domain (or their own, with `@rule`), never as scattered asserts. The domains,
in the order their lines print: the general choices and sizes here, then the parallel layout against the model's
shape (layout_rules.py), resources and trainer modes (resource_rules.py), rollout (rollout_rules.py), algorithm
(algorithm_rules.py), LoRA (lora_rules.py), backends (backend_rules.py), single fields, keys, replica placement,
data files and free-form dict keys (field_rules.py), rewards (reward_rules.py). The command line prints each
violation as one `mrl: <setting>=<value>: <rule>` line (`ConfigError.lines`, mrl/cli.py).

This package sits above the components whose names the rules check (algorithms, agent loops, bridges, loggers);
what a rule needs from an engine or adapter is declared below it, in mrl/config (engine_fields.py,
engine_capabilities.py, model_shape.py).
"""

import contextvars
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mrl.config.errors import ConfigError, Violation

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
REPLICA_MODES = ("hybrid", "colocated", "standalone")
ROLLOUT_BACKENDS = ("vllm", "sglang", "trtllm", "hf")
TRANSPORTS = ("ipc", "nccl", "disk")
BRIDGE_BACKENDS = ("mrl", "megatron_bridge")
ENGINE_ROLES = ("actor", "ref", "critic")
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size")


Rule = Callable[[Any, bool], Iterable[Violation]]
RULES: list[Rule] = []
# Rules whose findings are notes, not errors: a setting that runs but costs more than its user may know. Each
# note is logged as one `mrl: note: <setting>=<value>: <why>` line once the configuration passes.
ADVICE: list[Rule] = []
_log = logging.getLogger("mrl.config")


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def advice(fn: Rule) -> Rule:
    ADVICE.append(fn)
    return fn


def validate(cfg: DictConfig | Any, check_paths: bool = True, model_config: dict[str, Any] | None = None
             ) -> list[Violation]:
    """Raise ConfigError if any rule fails, else log and return the advice's notes. `check_paths=False` for
    planning recipes whose model is not here; `model_config` (an HF config dict) then stands in for the model
    folder's config.json in the shape rules."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    token = _PLANNED_MODEL.set(model_config)
    try:
        violations = [v for r in RULES for v in r(cfg, check_paths)]
        notes = [] if violations else [v for r in ADVICE for v in r(cfg, check_paths)]
    finally:
        _PLANNED_MODEL.reset(token)
    if violations:
        raise ConfigError(violations)
    for note in notes:
        _log.warning("mrl: note: %s", note)
    return notes


def _get(cfg: DictConfig, path: str) -> Any:
    return OmegaConf.select(cfg, path)


def _one_of(cfg: DictConfig, path: str, allowed: tuple[Any, ...]) -> Iterator[Violation]:
    if _get(cfg, path) not in allowed:
        yield Violation(path, _get(cfg, path), f"must be one of {', '.join(map(str, allowed))}")


def _at_least(cfg: DictConfig, path: str, low: float) -> Iterator[Violation]:
    value = _get(cfg, path)
    if value is not None and value < low:
        yield Violation(path, value, f"must be >= {low}")


def on_cuda(cfg: DictConfig) -> bool:
    """Whether the run builds on CUDA, judged like the build's device choice (trainer.device; auto: CUDA present)."""
    device = _get(cfg, "trainer.device")
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def trainer_world_size(cfg: DictConfig) -> int:
    return _get(cfg, "resources.nnodes") * _get(cfg, "resources.n_gpus_per_node")


# ---- the model's config.json (start-up, before any worker) -----------------------------------------------------
# `mrl plan` checks a recipe whose model is not here against the config it plans with (a built-in shape).
_PLANNED_MODEL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("planned", default=None)


def hf_config(cfg: DictConfig, check_paths: bool) -> dict[str, Any] | None:
    """The model folder's config.json as a dict, when paths are checked and it is there (or the config
    `validate(model_config=...)` was given)."""
    if _PLANNED_MODEL.get() is not None:
        return _PLANNED_MODEL.get()
    path = os.path.join(str(_get(cfg, "model.path") or ""), "config.json")
    if not check_paths or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@rule
def _choices(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _one_of(cfg, "trainer.mode", TRAINER_MODES)
    yield from _one_of(cfg, "rollout.mode", REPLICA_MODES)
    yield from _one_of(cfg, "rollout.name", ROLLOUT_BACKENDS)
    yield from _one_of(cfg, "weight_sync.transport", TRANSPORTS)
    yield from _one_of(cfg, "model.bridge_backend", BRIDGE_BACKENDS)


@rule
def _positive_sizes(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for path in ("resources.nnodes", "resources.n_gpus_per_node", "resources.max_colocate_count",
                 "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
                 "actor.ppo_mini_batch_size", "actor.ppo_epochs", "rollout.n",
                 "rollout.tensor_model_parallel_size", "rollout.data_parallel_size",
                 "rollout.pipeline_model_parallel_size", "weight_sync.bucket_size_mb",
                 "weight_sync.parameter_sync_step", "trainer.total_training_steps"):
        yield from _at_least(cfg, path, 1)
    yield from _at_least(cfg, "resources.cpu_threads_per_slot", 0)
    for role in ENGINE_ROLES:
        for key in PARALLEL_SIZES:
            yield from _at_least(cfg, f"{role}.megatron.{key}", 1)
        yield from _at_least(cfg, f"{role}.megatron.logprob_keep_logits_gib", 0.0)
        yield from _at_least(cfg, f"{role}.megatron.logprob_chunk_tokens", 1)


# The domains' rules register themselves on import, in this order (the order their lines print).
from mrl.config.startup import (  # noqa: E402, F401, I001
    layout_rules, resource_rules, rollout_rules, algorithm_rules, lora_rules, backend_rules, field_rules, reward_rules,
)

__all__ = ["ConfigError", "Violation", "advice", "hf_config", "on_cuda", "rule", "trainer_world_size", "validate"]
