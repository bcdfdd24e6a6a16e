"""`mrl plan RECIPE [key=value ...]`: what one training step of a recipe costs, before any device is touched.

Per-step accounting (the seeds' table, verl's conventions):
- prompts per step B = data.train_batch_size; rollout requests B × n (n = rollout.n);
- rollout replicas = rollout devices ÷ (rollout TP × DP × PP), where the rollout devices are the trainer's
  (replica modes hybrid and colocated) or the standalone pool's (rollout.nnodes × rollout.n_gpus_per_node);
- actor mini-batch M × n samples (M = actor.ppo_mini_batch_size prompts); updates per step B/M × ppo_epochs:
  n multiplies samples, not updates; per-device batch = M × n ÷ Megatron DP (DP = world ÷ (TP × PP × CP));
- devices for training and rollout; GPU share per worker 1/max_colocate_count;
- weight syncs per step (separate_async: updates ÷ parameter_sync_step, else 1) and whether they cross pools.
Then the per-device memory estimate of `mrl/tools/memory.py`, and problems: every start-up rule the
configuration breaks (mrl/config/startup/validate.py) plus what cannot fit on the device. The exit status is 1 when the
recipe cannot start, so scripts can gate on it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mrl.config.model_shape import ModelShape, resolve_model_config, shape_from_config, stage_layers
from mrl.config.placement import rollout_placement
from mrl.config.startup import ConfigError, validate
from mrl.config.startup.loader import load_config
from mrl.tools.memory import GiB, MemoryEstimate, estimate, value_model_shape

# Above this share of device memory the caching allocator's fragmentation usually tips a run into OOM.
_TIGHT_FRACTION = 0.9


@dataclass
class Accounting:
    prompts_per_step: int
    rollout_requests: int
    max_rollout_requests: int  # with dynamic sampling: refill rounds generate more
    training_devices: int
    rollout_devices: int  # devices the rollout replicas occupy (the trainer's own when hybrid/colocated)
    extra_rollout_devices: int  # devices added for a standalone pool
    total_devices: int
    rollout_replica_devices: int  # TP × DP × PP of one replica
    rollout_replicas: int
    requests_per_replica: float
    actor_dp: int
    mini_batch_samples: int
    updates_per_step: float
    samples_per_device_per_update: float
    micro_batches_per_update: float | None  # None with dynamic batch size (token budget decides)
    gpu_share_per_worker: float
    weight_syncs_per_step: float
    weight_sync_crosses_pools: bool
    weight_sync_transport: str
    weight_sync_bytes: int
    weight_sync_buckets: int


@dataclass
class Plan:
    recipe: str
    model: str
    model_source: str
    total_params: int
    active_params: int
    accounting: Accounting
    memory: MemoryEstimate
    problems: list[str] = field(default_factory=list)  # the recipe cannot start
    notes: list[str] = field(default_factory=list)  # it starts, but something is worth knowing
    peak: str = ""  # what a device holds at its peak, and whether the training and rollout phases alternate
    stage_layers: list[int] = field(default_factory=list)  # the actor's layers per pipeline stage

    @property
    def can_start(self) -> bool:
        return not self.problems


def accounting(cfg: DictConfig, shape: ModelShape) -> Accounting:
    res, r, a, ws = cfg.resources, cfg.rollout, cfg.actor, cfg.weight_sync
    batch, n, mini = cfg.data.train_batch_size, r.n, a.ppo_mini_batch_size
    m = a.megatron
    training = res.nnodes * res.n_gpus_per_node
    standalone = r.mode == "standalone"
    extra = r.nnodes * r.n_gpus_per_node if standalone else 0
    placement = rollout_placement(cfg)  # the same function places the replicas at start-up
    rollout_devices, footprint, replicas = placement.pool_devices, placement.footprint, placement.replicas
    dp = max(training // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size), 1)
    updates = batch / mini * a.ppo_epochs
    per_device = mini * n / dp
    micro = None if a.use_dynamic_bsz else per_device / (a.ppo_micro_batch_size_per_gpu or 1)
    syncs = updates / ws.parameter_sync_step if cfg.trainer.mode == "separate_async" else 1.0
    sync_bytes = shape.export_bytes(r.quantization)  # bf16, or block FP8 linear weights
    rounds = cfg.data.max_sample_rounds if cfg.data.dynamic_sampling else 1
    return Accounting(
        prompts_per_step=batch,
        rollout_requests=batch * n,
        max_rollout_requests=batch * n * rounds,
        training_devices=training,
        rollout_devices=rollout_devices,
        extra_rollout_devices=extra,
        total_devices=training + extra,
        rollout_replica_devices=footprint,
        rollout_replicas=replicas,
        requests_per_replica=batch * n / replicas if replicas else float("inf"),
        actor_dp=dp,
        mini_batch_samples=mini * n,
        updates_per_step=updates,
        samples_per_device_per_update=per_device,
        micro_batches_per_update=micro,
        gpu_share_per_worker=1 / res.max_colocate_count,
        weight_syncs_per_step=syncs,
        weight_sync_crosses_pools=standalone,
        weight_sync_transport=ws.transport,
        weight_sync_bytes=sync_bytes,
        weight_sync_buckets=-(-sync_bytes // (ws.bucket_size_mb * 1024**2)),
    )


def _check(cfg: DictConfig, acc: Accounting, mem: MemoryEstimate, problems: list[str], notes: list[str]) -> None:
    device = mem.device_bytes
    train = mem.training_total
    rollout = mem.rollout
    assert rollout is not None
    # Replicas that cannot be placed are a start-up rule (mrl/config/placement.py), listed with the config's.
    if acc.rollout_replicas * acc.rollout_replica_devices < acc.rollout_devices:
        notes.append(f"rollout: {acc.rollout_devices - acc.rollout_replicas * acc.rollout_replica_devices} of "
                     f"{acc.rollout_devices} rollout devices hold no replica (rollout.num_replicas)")
    if train > device:
        problems.append(f"memory: the training phase needs {train / GiB:.1f} GiB per device, the device has "
                        f"{device / GiB:.0f} GiB (raise TP/PP/EP, shard the optimizer, recompute activations or "
                        "lower the token budget)")
    elif train > _TIGHT_FRACTION * device:
        notes.append(f"memory: the training phase uses {train / device:.0%} of the device; fragmentation may OOM")
    if rollout.kv_cache <= 0:
        problems.append(f"memory: rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} reserves "
                        f"{rollout.reserved / GiB:.1f} GiB but the weights take {rollout.weights / GiB:.1f} GiB and "
                        f"the runtime {rollout.overhead / GiB:.1f} GiB: the KV cache budget is "
                        f"{rollout.kv_cache / GiB:.1f} GiB (raise it or the rollout TP)")
    elif rollout.sequences_in_kv < 1:
        problems.append(f"memory: the KV cache holds {rollout.kv_tokens} tokens, less than one sequence of "
                        f"data.max_prompt_length + data.max_response_length; the inference engine refuses to start")
    elif acc.requests_per_replica > rollout.sequences_in_kv:
        notes.append(f"rollout: a replica gets {acc.requests_per_replica:.0f} requests but its KV cache holds "
                     f"{rollout.sequences_in_kv} full sequences at once (the rest queue)")
    if cfg.rollout.mode == "colocated" and train + rollout.reserved > device:
        problems.append(f"memory: a colocated rollout keeps {rollout.reserved / GiB:.1f} GiB while training needs "
                        f"{train / GiB:.1f} GiB, more than the device's {device / GiB:.0f} GiB")
    if acc.samples_per_device_per_update % 1:
        notes.append(f"batch: {acc.mini_batch_samples} samples per update over DP={acc.actor_dp} leave a remainder; "
                     "the trainer pads with no-op samples")


def make_plan(recipe: str, overrides: list[str] | None = None, *, device_gib: float = 80.0,
              rollout_overhead_gib: float = 2.0, model_config: str | None = None) -> Plan:
    """The plan of a recipe. Start-up rule violations become problems rather than exceptions, so every number
    that can still be computed is shown."""
    cfg = load_config(recipe, overrides, check=False)
    problems: list[str] = []
    config, source = resolve_model_config(cfg.model.path, model_config)
    try:  # the model-shape rules (TP vs heads, PP vs layers, ...) run against the config planned with
        validate(cfg, check_paths=False, model_config=config)
    except ConfigError as err:
        problems += [f"config: {v}" for v in err.violations]
    shape = shape_from_config(config)
    acc = accounting(cfg, shape)
    mem = estimate(cfg, shape, device_gib, rollout_overhead_gib, _frozen_shapes(cfg, problems))
    name = Path(cfg.model.path.rstrip("/")).name
    m = cfg.actor.megatron
    stages = stage_layers(shape.num_layers, m.pipeline_model_parallel_size,
                          m.get("num_layers_in_first_pipeline_stage"), m.get("num_layers_in_last_pipeline_stage"))
    plan = Plan(recipe, name, source, shape.total_params, shape.active_params, acc, mem, problems,
                peak=_phases(cfg, mem), stage_layers=stages)
    _check(cfg, acc, mem, plan.problems, plan.notes)
    return plan


def _frozen_shapes(cfg: DictConfig, problems: list[str]) -> dict[str, ModelShape]:
    """{role: shape} of the frozen engines beside the reference: the distillation teacher and each colocated reward
    model `rm:<name>` (its folder's config.json, or a built-in shape named like it; a reward model under its score
    head)."""
    d = cfg.algorithm.distill
    beside = d.enable and d.placement == "colocated"  # a pool's teacher is on devices of its own
    folders = [("teacher", "algorithm.distill.teacher_path", d.teacher_path, False)] if beside else []
    folders += [(f"rm:{m.name}", f"reward.models[{k}].path", m.path, True)
                for k, m in enumerate(cfg.reward.models) if m.placement == "colocated" and m.kind == "discriminative"]
    shapes = {}
    for role, setting, path, classifier in folders:
        try:
            shape = shape_from_config(resolve_model_config(path)[0])
        except FileNotFoundError as err:
            problems.append(f"{setting}: {err}")
            continue
        shapes[role] = value_model_shape(shape) if classifier else shape
    return shapes


def _per_replica(a: Accounting) -> str:
    """Requests per replica as whole numbers: `5` or `5-6` when they do not divide evenly."""
    if a.rollout_replicas < 1:
        return "no replica:"
    low, rest = divmod(a.rollout_requests, a.rollout_replicas)
    return f"{low}-{low + 1}" if rest else str(low)


def _phases(cfg: DictConfig, mem: MemoryEstimate) -> str:
    """What a device holds at its peak: hybrid replicas sleep while the trainer works, so the two phases
    alternate; a resident (free_cache_engine=false) or colocated engine keeps its reserve through training."""
    train, reserve = mem.training_total, mem.rollout.reserved if mem.rollout else 0.0
    r = cfg.rollout
    if r.mode == "standalone":
        return f"  peak per training device            {_gib(train)} (the rollout has its own devices)"
    if r.mode == "hybrid" and r.free_cache_engine:
        return (f"  peak per device                     {_gib(max(train, reserve))} (hybrid: training and rollout "
                "phases alternate, the rollout sleeps while the trainer works)")
    return f"  peak per device                     {_gib(train + reserve)} (training + the resident rollout reserve)"


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f} GiB"


def render(plan: Plan) -> str:
    a, mem = plan.accounting, plan.memory
    lines = [
        f"recipe {plan.recipe}: model {plan.model} (shape from {plan.model_source})",
        f"  parameters {plan.total_params / 1e9:.2f} B total, {plan.active_params / 1e9:.2f} B active per token",
        f"  actor layers per pipeline stage   {' + '.join(map(str, plan.stage_layers))} "
        f"(PP={len(plan.stage_layers)})",
        "per step",
        f"  prompts per step (B)              {a.prompts_per_step}",
        f"  rollout requests (B x n)          {a.rollout_requests}"
        + (f" (up to {a.max_rollout_requests} with dynamic sampling)" if a.max_rollout_requests > a.rollout_requests
           else ""),
        f"  rollout replicas                  {a.rollout_replicas} = {a.rollout_devices} devices / "
        f"{a.rollout_replica_devices} (TP x DP x PP); {_per_replica(a)} requests each",
        f"  actor mini-batch (M x n samples)  {a.mini_batch_samples}",
        f"  updates per step (B/M x epochs)   {a.updates_per_step:g}",
        f"  samples per device per update     {a.samples_per_device_per_update:g} (actor DP={a.actor_dp})"
        + (f", {a.micro_batches_per_update:g} micro-batches" if a.micro_batches_per_update is not None else ""),
        f"  devices                           {a.training_devices} training + {a.extra_rollout_devices} rollout-only "
        f"= {a.total_devices}",
        f"  GPU share per worker              {a.gpu_share_per_worker:.3f}",
        f"  weight syncs per step             {a.weight_syncs_per_step:g} "
        f"({'across pools' if a.weight_sync_crosses_pools else 'same devices'}, {a.weight_sync_transport}, "
        f"{a.weight_sync_bytes / GiB:.1f} GiB in {a.weight_sync_buckets} buckets)",
        f"memory per device ({mem.device_bytes / GiB:.0f} GiB device)",
    ]
    width = max([7, *(len(e.role) for e in mem.training)])  # a reward model's role carries its name
    for e in mem.training:
        lines.append(f"  {e.role:{width}s} params {_gib(e.params)}  grads {_gib(e.grads)}  "
                     f"optimizer {_gib(e.optimizer)}  activations {_gib(e.activations)}  = {_gib(e.total)}")
    lines.append(f"  training phase total                {_gib(mem.training_total)}")
    if (r := mem.rollout) is not None:
        lines.append(f"  rollout reserve {_gib(r.reserved)}: weights {_gib(r.weights)}, runtime {_gib(r.overhead)},"
                     f" KV cache {_gib(r.kv_cache)} = {r.kv_tokens} tokens, {r.sequences_in_kv} full sequences")
    lines += [plan.peak] if plan.peak else []
    lines += [f"CANNOT START: {p}" for p in plan.problems] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def to_json(plan: Plan) -> dict[str, Any]:
    out = asdict(plan)
    out["can_start"] = plan.can_start
    out["memory"]["training_total"] = plan.memory.training_total
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipes/<family>/<name> without .yaml, or a path to a YAML file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.n=8")
    parser.add_argument("--device-memory-gib", type=float, default=80.0,
                        help="memory of one device (80 for H100/A100-80G, 141 for H200)")
    parser.add_argument("--rollout-overhead-gib", type=float, default=2.0,
                        help="inference engine memory besides weights and KV cache (activation profile, graphs)")
    parser.add_argument("--model-config", default=None,
                        help="an HF config.json, or a built-in name (e.g. Qwen3-8B), instead of model.path")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args.recipe, args.overrides, device_gib=args.device_memory_gib,  # errors: mrl/cli.py
                     rollout_overhead_gib=args.rollout_overhead_gib, model_config=args.model_config)
    print(json.dumps(to_json(plan), indent=2) if args.json else render(plan))
    return 0 if plan.can_start else 1
