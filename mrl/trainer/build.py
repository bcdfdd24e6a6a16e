"""Assemble a trainer from a validated config: data → resource pool → rollout replicas, actor/rollout/ref workers,
agent loops and reward (all started concurrently, then waited for). The slime order, in one function."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mrl.config.placement import rollout_placement
from mrl.config.reward_schema import RewardModelConfig
from mrl.config.schema import MrlConfig
from mrl.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from mrl.data.datasets import RLDataset
from mrl.reward.evaluator import RewardEvaluator
from mrl.reward.models import RewardModels
from mrl.reward.teacher_replicas import ReplicaTeacher
from mrl.rollout.agent_loop import AgentLoopManager
from mrl.rollout.agent_loop.tools import load_tools
from mrl.rollout.manager import LLMServerManager
from mrl.rollout.pd import PDSpec
from mrl.rollout.replica import Footprint, ReplicaSpec
from mrl.trainer.metrics import RunLogger
from mrl.trainer.modes import trainer_class
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts
from mrl.utils.process_logs import describe_process_logs
from mrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from mrl.workers.cpu_threads import engine_env
from mrl.workers.critic import CriticWorker


def typed(cfg: DictConfig | MrlConfig) -> MrlConfig:
    return cfg if isinstance(cfg, MrlConfig) else OmegaConf.to_object(cfg)  # type: ignore[return-value]


def rollout_spec(c: MrlConfig) -> ReplicaSpec:
    r = c.rollout
    return ReplicaSpec(
        backend=r.name,
        model_path=c.model.path,
        footprint=Footprint(r.tensor_model_parallel_size, r.data_parallel_size, r.pipeline_model_parallel_size),
        max_model_len=c.data.max_prompt_length + c.data.max_response_length,
        dtype=r.dtype or c.actor.megatron.params_dtype,
        seed=c.trainer.seed,
        engine_kwargs=dict(r.engine_kwargs),
        enforce_eager=r.enforce_eager,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enable_prefix_caching=r.enable_prefix_caching,
        enable_sleep_mode=r.enable_sleep_mode,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        env=engine_env(c, torch.cuda.is_available()),
        host=r.server_host,
        allow_remote_access=r.allow_remote_access,
        return_routed_experts=c.actor.megatron.router_replay == "rollout",
        lora_rank=c.actor.lora.rank if c.actor.lora.enable and c.actor.lora.sync == "adapter" else None,
        quantization=r.quantization,
        fp8_scale_format=r.fp8_scale_format,
        fp8_gemm=r.fp8_gemm,
    )


def start_own_replicas(backend: str, path: str, tp: int, replicas: int, max_model_len: int, dtype: str,
                       pool: Any = None, gpu_memory_utilization: float | None = None) -> LLMServerManager:
    """Replicas of a model in the loop (a generative reward model, a distillation teacher), launching (not waited
    for: the engines load while the trainer's other parts start): each in a standalone pool of its own, or with
    `pool` (the trainer's) in replica mode colocated on its first devices (the trainer's hand-over puts them to sleep
    and wakes them with the rollout)."""
    footprint = Footprint(tp=tp)
    spec = ReplicaSpec(backend=backend, model_path=path, footprint=footprint, max_model_len=max_model_len, dtype=dtype,
                       gpu_memory_utilization=gpu_memory_utilization)
    return LLMServerManager.create(spec, "standalone" if pool is None else "colocated", pool=pool,
                                   num_devices=replicas * footprint.devices, wait=False)


def start_judge(m: RewardModelConfig, dtype: str, pool: Any = None) -> LLMServerManager:
    """A generative reward model's replicas (on `pool`, the trainer's, when colocated). `dtype`: the engine's when
    `m.dtype` is None."""
    return start_own_replicas(m.backend, m.path, m.tensor_model_parallel_size, m.num_replicas, m.max_model_len,
                              m.dtype or dtype, pool if m.placement == "colocated" else None,
                              m.gpu_memory_utilization)


def start_teacher(c: MrlConfig, dtype: str) -> ReplicaTeacher:
    """algorithm.distill's teacher on replicas of its own (placement pool); room for the longest sample and the one
    token each request decodes."""
    d = c.algorithm.distill
    longest = c.data.max_prompt_length + c.data.max_response_length
    return ReplicaTeacher(start_own_replicas(d.backend, d.teacher_path, d.tensor_model_parallel_size, d.num_replicas,
                                             longest + 1, d.dtype or dtype))


def start_reward_models(models: list[RewardModelConfig], tokenizer_path: str, dtype: str, pool: Any = None
                        ) -> RewardModels:
    """reward.models, the judges' replicas launching (colocated ones on `pool`, the trainer's); a failure stops the
    judges already launched."""
    with ExitStack() as undo:
        judges = {}
        for m in models:
            if m.kind == "generative":
                judges[m.name] = start_judge(m, dtype, pool)
                undo.callback(judges[m.name].shutdown)
        reward_models = RewardModels(models, tokenizer_path, judges)
        undo.pop_all()  # from here RewardModels.close stops them
    return reward_models


def resolve_run_length(c: MrlConfig, train_data: RLDataset) -> int:
    """trainer.total_training_steps, or when it is None, total_epochs full passes over the training prompts
    (`RLDataset.batches` keeps a remainder smaller than a batch for the next epoch)."""
    if c.trainer.total_training_steps is not None:
        return c.trainer.total_training_steps
    per_epoch = len(train_data) // c.data.train_batch_size
    if per_epoch < 1:
        raise ValueError(f"trainer.total_training_steps=None: data.train_batch_size={c.data.train_batch_size} is "
                         f"larger than the {len(train_data)} training prompts, so an epoch has no step")
    return c.trainer.total_epochs * per_epoch


def make_run_logger(c: MrlConfig) -> RunLogger:
    t = c.trainer
    return RunLogger(t.default_local_dir, list(t.logger), dump_per_step=t.rollout_dump_per_step,
                     total_steps=t.total_training_steps, project=t.project_name, experiment=t.experiment_name,
                     config=OmegaConf.to_container(OmegaConf.structured(c)))  # type: ignore[arg-type]


class StartupProgress:
    """`[mrl] <stage> (<seconds since start-up began> s)` lines: the minute between Ray's start and step 0 is the
    workers' start, Megatron's build and weight load, and the engines' start, and says so as each one ends."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[mrl] {what} ({time.monotonic() - self.start:.1f} s)", flush=True)


def build_trainer(cfg: DictConfig | MrlConfig, logger: RunLogger | None = None) -> PPOTrainer:
    from transformers import AutoTokenizer

    progress = StartupProgress()
    c = typed(cfg)
    tokenizer_path = c.model.tokenizer_path or c.model.path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    train_data = RLDataset.from_files(c.data.train_files, c.data.prompt_key)
    val_data = RLDataset.from_files(c.data.val_files, c.data.prompt_key) if c.data.val_files else None
    # Multi-turn loops render the tools' schemas into the prompt (the tools are built here for their schemas only).
    schemas = [t.schema for t in load_tools(list(c.rollout.tools))] if c.rollout.agent_loop != "single_turn" else []
    for data in (train_data, val_data):
        if data is not None:  # a prompt past the rollout's context would fail its request mid-step
            data.drop_long_prompts(tokenizer, c.data.max_prompt_length, schemas or None)
    # Before any worker gets the config: the engines size their LR schedules by the run length (prompts counted
    # after the drop).
    c = replace(c, trainer=replace(c.trainer, total_training_steps=resolve_run_length(c, train_data)))
    progress(f"data: {len(train_data)} training prompts" + (f", {len(val_data)} held out" if val_data else "")
             + f"; {c.trainer.total_training_steps} steps")
    hybrid = c.rollout.mode == "hybrid"
    colocated_judges = sum(m.kind == "generative" and m.placement == "colocated" for m in c.reward.models)
    use_gpu = torch.cuda.is_available() if c.trainer.device == "auto" else c.trainer.device == "cuda"
    # A failed start-up releases what it started (workers, engines, placement groups): left behind, they would
    # hold their slots and names, and the next start-up in the same cluster would fail on them.
    with ExitStack() as undo:
        pool = RayResourcePool(
            [c.resources.n_gpus_per_node] * c.resources.nnodes,
            use_gpu=use_gpu,
            # A hybrid replica's server, the critic and colocated judges' servers share each slot with the worker
            # that trains there.
            max_colocate_count=max(c.resources.max_colocate_count, 1 + hybrid + c.critic.enable + colocated_judges),
            name_prefix=f"mrl_{c.trainer.experiment_name}",
            timeout_s=c.resources.start_timeout_s,
        )
        undo.callback(pool.remove)
        spec = rollout_spec(c)
        policy = c.rollout  # its retry, health-check and time-limit knobs
        placement = rollout_placement(c)  # checked at start-up by the same function (mrl/config/placement.py)
        # Everything below starts concurrently and is waited for at the end: the engines first (usually the longest
        # start: import, weight load, CUDA graphs), then the training workers (process start, Megatron build, weight
        # load), the agent-loop workers and the sample store (before: one after another; docs/gpu.md, "Start-up").
        pd = c.rollout.pd
        pd_spec = PDSpec.from_config(pd) if pd.enabled else None
        rollout = LLMServerManager.create(spec, c.rollout.mode, pool=pool if hybrid else None,
                                          num_devices=placement.devices, policy=policy, wait=False, pd=pd_spec,
                                          pd_base_port=pd.base_port)
        undo.callback(rollout.shutdown)
        with_ref = c.actor.use_kl_loss or c.algorithm.use_kl_in_reward
        actor_rollout = RayWorkerGroup(
            pool, RayClassWithInitArgs(ActorRolloutRefWorker, c, with_ref=with_ref), name_prefix="actor_rollout",
            call_timeout_s=c.trainer.dispatch_timeout_s,
        )
        undo.callback(actor_rollout.kill)
        engines_ready = [actor_rollout.init_model()]  # non-blocking: Megatron builds while the replicas start
        critic = None
        if c.critic.enable:
            critic = RayWorkerGroup(pool, RayClassWithInitArgs(CriticWorker, c), name_prefix="critic",
                                    call_timeout_s=c.trainer.dispatch_timeout_s)
            undo.callback(critic.kill)
            engines_ready.append(critic.init_model())
        progress(f"started {actor_rollout.world_size} training worker(s) and {placement.replicas} {c.rollout.name} "
                 f"replica(s) of {placement.footprint} device(s); Megatron builds and loads the weights meanwhile")
        # The clients fetch the server set at their first call, after the replicas are registered below.
        agent_loops = AgentLoopManager(
            c.rollout.agent_loop_workers, tokenizer_path, rollout.balancer, c.rollout.agent_loop,
            c.data.max_response_length, list(c.rollout.tools), c.rollout.max_turns, policy,
            fully_async=c.trainer.mode != "sync",
        )
        undo.callback(agent_loops.shutdown)
        reward = RewardEvaluator(None if c.reward.reward_fn == "auto" else c.reward.reward_fn,
                                 max_workers=c.reward.num_workers, timeout_s=c.reward.timeout_s)
        undo.callback(reward.close)
        reward_models = (start_reward_models(c.reward.models, tokenizer_path, spec.dtype, pool) if c.reward.models
                         else None)
        if reward_models is not None:
            undo.callback(reward_models.close)
        distill = c.algorithm.distill
        teacher = start_teacher(c, spec.dtype) if distill.enable and distill.placement == "pool" else None
        if teacher is not None:
            undo.callback(teacher.close)
        rollout.wait_started()
        progress(f"rollout replicas serving ({c.rollout.name})")
        if reward_models is not None and reward_models.judges:
            reward_models.wait_started()
            progress(f"reward judges serving ({', '.join(reward_models.judges)})")
        if teacher is not None:
            teacher.wait_started()
            progress(f"distillation teacher's replicas serving ({distill.backend})")
        for ready in engines_ready:
            ready.get()
        progress("Megatron engines built, weights loaded" + (" (actor and critic)" if critic is not None else ""))
        agent_loops.wait_ready()
        actor_rollout.set_rollout(rollout)
        for group in (actor_rollout, critic):  # workers fetch and write per-token data by key (mrl/data/samples.py)
            if group is not None:
                group.set_store(agent_loops.store)
        undo.pop_all()  # started: from here `shutdown` owns them
    for line in describe_process_logs(log_sources(actor_rollout, critic, rollout, agent_loops, c.rollout.name)):
        print(line, flush=True)
    parts = TrainerParts(
        actor_rollout=actor_rollout,
        rollout=rollout,
        agent_loops=agent_loops,
        store=agent_loops.store,
        tokenizer=tokenizer,
        train_data=train_data,
        val_data=val_data,
        reward=reward,
        critic=critic,
        reward_models=reward_models,
        teacher=teacher,
    )
    parts.pool = pool  # type: ignore[attr-defined]
    progress(f"agent loops ready ({c.rollout.agent_loop_workers} worker(s)); training starts")
    return trainer_class(c.trainer.mode)(c, parts, logger or make_run_logger(c))


def log_sources(actor_rollout: Any, critic: Any, rollout: Any, agent_loops: Any, backend: str) -> list[tuple[str, Any]]:
    """(name, Ray actor) of every process the run started: training workers, each rollout replica's server (a PD
    replica's members), agent-loop workers."""
    named = [(f"training worker {i}", w) for i, w in enumerate(actor_rollout.workers)]
    named += [(f"critic worker {i}", w) for i, w in enumerate(critic.workers if critic is not None else [])]
    for rank, replica in sorted(rollout.replicas.items()):
        members = getattr(replica, "members", None) or {"": replica.server}
        named += [(f"rollout replica {rank}{' ' + role if role else ''} ({backend} server and its engine)", actor)
                  for role, actor in members.items()]
    return named + [(f"agent-loop worker {i}", w) for i, w in enumerate(agent_loops.workers)]


def shutdown(trainer: PPOTrainer) -> None:
    """Stop everything `build_trainer` started (agent loops, replicas, workers, pool)."""
    p: Any = trainer.parts
    trainer.close()  # before the agent loops go: an async producer still waits on them
    trainer.logger.close()
    p.reward.close()
    if p.reward_models is not None:  # discriminative actors and the judges' replicas
        p.reward_models.close()
    if p.teacher is not None:
        p.teacher.close()
    p.agent_loops.shutdown()
    p.rollout.shutdown()
    p.actor_rollout.kill()
    if p.critic is not None:
        p.critic.kill()
    if getattr(p, "pool", None) is not None:
        p.pool.remove()


def train(cfg: Any) -> tuple[list[dict[str, Any]], float]:
    """Build the trainer, fit it and shut everything down again; returns the run's history and the seconds its
    start-up took (workers, replicas, agent loops)."""
    start = time.monotonic()
    trainer = build_trainer(cfg)
    startup = time.monotonic() - start
    try:
        return trainer.fit(), startup
    finally:
        shutdown(trainer)
