"""Start-up validation: every cross-field rule of the configuration, run once before any worker starts.

A rule is a function `cfg -> iterable of Violation`, registered with `@rule`. `validate` runs all of them and
raises one `ConfigError` listing every violation, each naming the setting, its value and the rule, so that a bad
recipe is fixed in one round rather than discovered as a hang or a late crash on a cluster. Later features add
their rules here (or in their own module, with `@rule`), never as scattered asserts.
"""

import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
REPLICA_MODES = ("hybrid", "colocated", "standalone")
ROLLOUT_BACKENDS = ("vllm", "sglang", "trtllm", "hf")
TRANSPORTS = ("ipc", "nccl", "disk")
BRIDGE_BACKENDS = ("mrl", "megatron_bridge")
ENGINE_ROLES = ("actor", "ref", "critic")
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size")


@dataclass(frozen=True)
class Violation:
    setting: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value!r}: {self.rule}"


class ConfigError(ValueError):
    def __init__(self, violations: list[Violation]):
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"invalid configuration ({len(violations)} problem(s)):\n{lines}")


Rule = Callable[[Any, bool], Iterable[Violation]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def validate(cfg: DictConfig | Any, check_paths: bool = True) -> None:
    """Raise ConfigError if any rule fails. `check_paths=False` for planning recipes whose model is not here."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    violations = [v for r in RULES for v in r(cfg, check_paths)]
    if violations:
        raise ConfigError(violations)


def _get(cfg: DictConfig, path: str) -> Any:
    return OmegaConf.select(cfg, path)


def _one_of(cfg: DictConfig, path: str, allowed: tuple[str, ...]) -> Iterator[Violation]:
    if _get(cfg, path) not in allowed:
        yield Violation(path, _get(cfg, path), f"must be one of {', '.join(allowed)}")


def _at_least(cfg: DictConfig, path: str, low: float) -> Iterator[Violation]:
    value = _get(cfg, path)
    if value is not None and value < low:
        yield Violation(path, value, f"must be >= {low}")


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
    for role in ENGINE_ROLES:
        for key in PARALLEL_SIZES:
            yield from _at_least(cfg, f"{role}.megatron.{key}", 1)


@rule
def _sampling(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _at_least(cfg, "rollout.temperature", 0.0)
    top_p = _get(cfg, "rollout.top_p")
    if not 0.0 < top_p <= 1.0:
        yield Violation("rollout.top_p", top_p, "must be in (0, 1]")
    top_k = _get(cfg, "rollout.top_k")
    if top_k == 0 or top_k < -1:
        yield Violation("rollout.top_k", top_k, "must be -1 (disabled) or a positive number of tokens")


@rule
def _updates_per_step(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    # rollout.n multiplies samples, not updates: updates per step = train_batch_size / ppo_mini_batch_size.
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "actor.ppo_mini_batch_size")
    if batch >= 1 and mini >= 1 and batch % mini:
        yield Violation("actor.ppo_mini_batch_size", mini,
                        f"must divide data.train_batch_size={batch} (each step makes train_batch_size / "
                        "ppo_mini_batch_size optimizer updates)")


def trainer_world_size(cfg: DictConfig) -> int:
    return _get(cfg, "resources.nnodes") * _get(cfg, "resources.n_gpus_per_node")


@rule
def _megatron_layout(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    world = trainer_world_size(cfg)
    te_available = importlib.util.find_spec("transformer_engine") is not None
    for role in ENGINE_ROLES:
        m = f"{role}.megatron"
        tp, pp, cp, ep = (_get(cfg, f"{m}.{key}") for key in PARALLEL_SIZES)
        if min(tp, pp, cp, ep) < 1 or world < 1:
            continue  # reported by _positive_sizes
        if world % (tp * pp * cp):
            yield Violation(f"{m}.tensor_model_parallel_size", tp,
                            f"TP×PP×CP = {tp}×{pp}×{cp} must divide the trainer's devices "
                            f"(resources.nnodes × resources.n_gpus_per_node = {world})")
        etp = _get(cfg, f"{m}.expert_tensor_parallel_size") or tp
        if (world // pp) % (ep * etp):
            yield Violation(f"{m}.expert_model_parallel_size", ep,
                            f"EP×ETP = {ep}×{etp} must divide the devices of one pipeline stage ({world // pp})")
        vpp = _get(cfg, f"{m}.virtual_pipeline_model_parallel_size")
        if vpp is not None and vpp > 1 and pp == 1:
            yield Violation(f"{m}.virtual_pipeline_model_parallel_size", vpp,
                            "virtual pipeline stages need pipeline_model_parallel_size > 1")
        if cp > 1 and not te_available:
            yield Violation(f"{m}.context_parallel_size", cp,
                            "context parallel needs TransformerEngine, which is not importable here; set it to 1")


@rule
def _modes(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    mode, replica = _get(cfg, "trainer.mode"), _get(cfg, "rollout.mode")
    transport = _get(cfg, "weight_sync.transport")
    if mode in ("sync", "colocate_async") and replica == "standalone":
        yield Violation("rollout.mode", replica,
                        f"trainer.mode={mode} alternates phases on shared devices; a standalone rollout pool needs "
                        "trainer.mode=separate_async")
    if replica == "standalone" and transport == "ipc":
        yield Violation("weight_sync.transport", transport,
                        "a standalone rollout pool is on other devices: use nccl or disk, not ipc")
    if mode != "separate_async":
        return
    if replica != "standalone":
        yield Violation("rollout.mode", replica, "trainer.mode=separate_async needs rollout.mode=standalone")
    for path in ("rollout.nnodes", "rollout.n_gpus_per_node"):
        if _get(cfg, path) < 1:
            yield Violation(path, _get(cfg, path),
                            "trainer.mode=separate_async needs a rollout pool with device slots "
                            "(rollout.nnodes > 0 and rollout.n_gpus_per_node > 0)")
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "actor.ppo_mini_batch_size")
    sync_step = _get(cfg, "weight_sync.parameter_sync_step")
    if batch != sync_step * mini:
        yield Violation("weight_sync.parameter_sync_step", sync_step,
                        f"trainer.mode=separate_async needs data.train_batch_size ({batch}) == "
                        f"parameter_sync_step × actor.ppo_mini_batch_size ({sync_step} × {mini})")


@rule
def _model_path(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    path = _get(cfg, "model.path")
    if not path:
        yield Violation("model.path", path, "must name an HF model folder (config.json, safetensors, tokenizer)")
    elif check_paths and not os.path.isfile(os.path.join(path, "config.json")):
        yield Violation("model.path", path, "no config.json there; it must be a local HF model folder")


AGENT_LOOPS = ("single_turn", "tool")


@rule
def _trainer_roles(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _one_of(cfg, "rollout.agent_loop", AGENT_LOOPS)
    yield from _at_least(cfg, "rollout.agent_loop_workers", 1)
    yield from _at_least(cfg, "data.max_sample_rounds", 1)
    estimator, critic = _get(cfg, "algorithm.adv_estimator"), _get(cfg, "critic.enable")
    if estimator == "gae" and not critic:
        yield Violation("algorithm.adv_estimator", estimator, "GAE needs critic values: set critic.enable=true")
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "critic.ppo_mini_batch_size")
    if critic and (mini < 1 or batch % mini):
        yield Violation("critic.ppo_mini_batch_size", mini,
                        f"must divide data.train_batch_size={batch} (the critic's updates per step)")
    replicas = _get(cfg, "rollout.num_replicas")
    footprint = (_get(cfg, "rollout.tensor_model_parallel_size") * _get(cfg, "rollout.data_parallel_size")
                 * _get(cfg, "rollout.pipeline_model_parallel_size"))
    if _get(cfg, "rollout.mode") == "hybrid" and replicas * footprint > trainer_world_size(cfg):
        yield Violation("rollout.num_replicas", replicas,
                        f"{replicas} hybrid replicas of {footprint} devices exceed the trainer's "
                        f"{trainer_world_size(cfg)} device slots")


@rule
def _not_wired_yet(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    # Refuse settings the trainer would silently ignore, rather than let a run go without them.
    if _get(cfg, "algorithm.use_kl_in_reward"):
        yield Violation("algorithm.use_kl_in_reward", True,
                        "a KL penalty in the reward is not applied by the trainer yet; use actor.use_kl_loss=true")
