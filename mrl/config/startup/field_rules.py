"""Start-up rules on single fields and on what lies beside the config: known keys, value ranges and shapes, where
the rollout replicas go, data files, and the keys of the free-form dicts.

Registered with `@rule` like those of validate.py, which imports this module, so `validate` runs them all. The
keys and free-form dicts come from the schema's dataclasses, so fields added later are covered.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from mrl.config.startup.validate import ENGINE_ROLES, Violation, rule

# (setting, low, high, low included, high included); None: no bound. A None value is skipped (an optional field).
RANGES: tuple[tuple[str, float | None, float | None, bool, bool], ...] = (
    ("algorithm.gamma", 0.0, 1.0, True, True),
    ("algorithm.lam", 0.0, 1.0, True, True),
    ("algorithm.kl_coef", 0.0, None, True, False),
    ("actor.clip_ratio_low", 0.0, 1.0, True, False),  # the ratio's lower clip 1 - ε must stay above 0
    ("actor.entropy_coeff", 0.0, None, True, False),
    ("ref.log_prob_micro_batch_size_per_gpu", 1, None, True, False),
    ("rollout.num_replicas", 0, None, True, False),
    ("rollout.nnodes", 0, None, True, False),
    ("rollout.n_gpus_per_node", 0, None, True, False),
    ("trainer.val_pass_k", 0, None, True, False),
    ("trainer.rollout_dump_per_step", 0, None, True, False),
    ("trainer.max_checkpoints_to_keep", 1, None, True, False),
    ("trainer.time_limit_s", 0.0, None, False, False),
    ("reward.max_error_rate", 0.0, 1.0, True, True),
    *((f"{role}.megatron.{key}", 1, None, True, False) for role in ENGINE_ROLES
      for key in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size",
                  "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                  "make_vocab_size_divisible_by")),
)


def _interval(low: float | None, high: float | None, low_in: bool, high_in: bool) -> str:
    if high is None:
        return f"must be {'>=' if low_in else '>'} {low:g}"
    return f"must be in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


@rule
def _known_keys(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.config.keys import unknown_in

    yield from unknown_in(cfg)


@rule
def _ranges(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for path, low, high, low_in, high_in in RANGES:
        value = OmegaConf.select(cfg, path)
        if value is None or isinstance(value, bool):
            continue
        below = low is not None and (value < low if low_in else value <= low)
        above = high is not None and (value > high if high_in else value >= high)
        if below or above:
            yield Violation(path, value, _interval(low, high, low_in, high_in))


@rule
def _shapes(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for role in ("actor", "critic"):
        betas = OmegaConf.select(cfg, f"{role}.optim.betas")
        if len(betas) != 2:
            yield Violation(f"{role}.optim.betas", list(betas), "Adam's betas are two numbers [beta1, beta2]")
    if OmegaConf.select(cfg, "critic.enable") and OmegaConf.select(cfg, "critic.ppo_micro_batch_size_per_gpu") is None:
        yield Violation("critic.ppo_micro_batch_size_per_gpu", None,
                        "the critic makes micro-batches by sample count: it must be >= 1")
    elif (micro := OmegaConf.select(cfg, "critic.ppo_micro_batch_size_per_gpu")) is not None and micro < 1:
        yield Violation("critic.ppo_micro_batch_size_per_gpu", micro, "must be >= 1")


@rule
def _rollout_placement(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.config.placement import rollout_placement

    r = cfg.rollout
    if r.mode == "colocated":
        if cfg.trainer.mode == "sync":  # the async modes' own rules name what they need instead
            yield Violation("rollout.mode", r.mode, "the policy's rollout runs hybrid (on the trainer's devices) "
                                                    "or standalone (its own pool); colocated adds nothing for it over "
                                                    "hybrid with rollout.free_cache_engine=false (same slots, own "
                                                    "processes, never slept, ipc weights), so use that; colocated "
                                                    "is for other engines placed beside it through the mrl.rollout "
                                                    "API")
        return
    if r.mode == "standalone" and (r.nnodes < 1 or r.n_gpus_per_node < 1):
        return  # a pool without slots is reported by the separate_async rules
    problem = rollout_placement(cfg).problem()
    if problem is not None:
        setting, why = problem
        if setting == "footprint" and r.pd.enabled:
            setting = "rollout.pd.n_decode"
        elif setting == "footprint":  # the first layout size above 1 is the one to change
            setting = next((f"rollout.{k}" for k in ("tensor_model_parallel_size", "data_parallel_size",
                                                      "pipeline_model_parallel_size") if r[k] > 1),
                           "rollout.tensor_model_parallel_size")
        yield Violation(setting, OmegaConf.select(cfg, setting), why)


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


@rule
def _data_files(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    if not check_paths:
        return
    if not cfg.data.train_files:
        yield Violation("data.train_files", [], "must list at least one training file (.parquet, .jsonl or .json)")
    for key in ("train_files", "val_files"):
        for path in cfg.data[key]:
            if not str(path).endswith(DATA_SUFFIXES):
                yield Violation(f"data.{key}", str(path), "unsupported format: use .parquet, .jsonl or .json")
            elif not os.path.isfile(str(path)):
                yield Violation(f"data.{key}", str(path), "no such file")
    rows = _row_count([str(p) for p in cfg.data.train_files])
    if rows is not None and rows < cfg.data.train_batch_size:
        yield Violation("data.train_batch_size", cfg.data.train_batch_size,
                        f"a step needs more prompts than data.train_files hold ({rows} rows)")


def _row_count(paths: list[str]) -> int | None:
    """Rows of parquet (from its footer) and JSONL (non-empty lines) files; None (not counted) without files or
    when one is missing, .json or of another format (each reported by its own rule)."""
    if not paths or not all(os.path.isfile(p) and p.endswith((".parquet", ".jsonl")) for p in paths):
        return None
    total = 0
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


@rule
def _free_form_keys(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.config.passthrough import engine_kwargs_violations, transformer_config_violations
    from mrl.config.schema import MegatronConfig

    yield from engine_kwargs_violations(cfg.rollout.name, OmegaConf.to_container(cfg.rollout.engine_kwargs))
    named = [f.name for f in dataclasses.fields(MegatronConfig)]
    for role in ENGINE_ROLES:
        overrides = OmegaConf.to_container(cfg[role].megatron.override_transformer_config)
        yield from transformer_config_violations(role, overrides, named)  # type: ignore[arg-type]
