"""Start-up rules of resources and modes: replica modes and weight-sync transports, the async trainer modes and
their rollout pool, the run's paths, devices and frequencies, and the limits that bound a hang. Registered with
`@rule`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.startup.validate import Violation, _at_least, _get, _one_of, rule


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


DEVICES = ("auto", "cuda", "cpu")


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


@rule
def _fault_limits(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    # A zero or negative limit would fail every call at once rather than bound a hang.
    for path in ("rollout.request_retry_wait_s", "rollout.health_check_timeout_s", "rollout.control_timeout_s",
                 "rollout.generate_timeout_s", "trainer.dispatch_timeout_s", "resources.start_timeout_s"):
        if _get(cfg, path) <= 0:
            yield Violation(path, _get(cfg, path), "must be > 0 seconds (it bounds how long a call may hang)")
    for path in ("rollout.max_request_retries", "rollout.max_replica_restarts", "rollout.health_check_interval_s"):
        yield from _at_least(cfg, path, 0)


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
