"""`PPOTrainer`: the driver of synchronous PPO/GRPO. `step()` reads top to bottom as the nine stages of a step
(sample, reward, DP balance, old log-prob, reference log-prob, values, advantage, critic update, actor update;
with distillation, teacher log-prob after the reference's; with colocated reward models, their scores right after
sampling), each under a named timer, then weight sync stamped with `global_steps`, validation and metrics.

Modes differ only in hooks (`on_sample_begin/end`, `sync_weights`, `on_step_end`): the async trainers subclass
and override those, never `step()`. Hybrid replicas sleep after sampling and wake around the weight sync.

The driver never holds per-token data: agent loops put each trajectory's tokens into the sample store and return
a light record (key + scalar tags); the step moves a batch of store keys and scalar columns, workers fetch and
write per-token fields by key, and the step's samples leave the store when it ends (mrl/data/samples.py).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from mrl.algo.advantages import AdvantageConfig
from mrl.algo.kl import KLControlConfig, KLController, make_kl_controller
from mrl.algo.rollout_correction import correction_metrics
from mrl.config.schema import MrlConfig
from mrl.data.batch import Batch
from mrl.data.datasets import RLDataset
from mrl.data.jagged import JaggedTensor
from mrl.data.replay_buffer import ReplayBuffer, pad_with_noops
from mrl.data.sample_store import SampleStore
from mrl.data.samples import light_batch, put_noop_payloads
from mrl.reward.errors import RewardErrors
from mrl.reward.evaluator import RewardEvaluator, RewardItem
from mrl.reward.judge import JudgeInput, prompt_text
from mrl.reward.models import RewardModels, combine, reward_score_field
from mrl.reward.teacher_replicas import ReplicaTeacher
from mrl.trainer import batching, checkpointing
from mrl.trainer.metrics import (
    ModelFlops,
    RunLogger,
    StageTimer,
    agent_loop_metrics,
    held_out_accuracy,
    perf_metrics,
    reward_part_metrics,
    staleness_metrics,
)
from mrl.utils.rng import rng_state, set_rng_state
from mrl.weight_sync.state_machine import device_sync_metrics


@dataclass
class TrainerParts:
    """What `build_trainer` assembles: the worker groups, the rollout side and the data."""

    actor_rollout: Any  # RayWorkerGroup of ActorRolloutRefWorker
    rollout: Any  # LLMServerManager
    agent_loops: Any  # AgentLoopManager
    tokenizer: Any
    train_data: RLDataset
    val_data: RLDataset | None
    reward: RewardEvaluator
    critic: Any = None
    store: SampleStore | None = None  # where trajectories' per-token data lives (the agent loops' store)
    reward_models: RewardModels | None = None  # reward.models, scored beside the rule reward
    teacher: ReplicaTeacher | None = None  # algorithm.distill's teacher on replicas of its own (placement pool)


def mean_over_updates(per_rank: list[dict[str, Any]], prefix: str = "critic") -> dict[str, float]:
    """Metrics of every optimizer update of every DP rank, averaged; unprefixed engine keys get `prefix/`."""
    steps = [s for rank in per_rank for s in rank["steps"]]
    out = {f"{prefix}/updates": per_rank[0]["updates"],
           # NaN/Inf loss or gradients: the engine skipped the update on every rank (same count on each)
           f"{prefix}/skipped_updates": sum(not s.get("update_ok", True) for s in per_rank[0]["steps"])}
    for key in steps[0] if steps else []:
        out[key if "/" in key else f"{prefix}/{key}"] = sum(float(s[key]) for s in steps) / len(steps)
    return out


class PPOTrainer:
    def __init__(self, config: MrlConfig, parts: TrainerParts, logger: RunLogger | None = None) -> None:
        self.config = config
        self.parts = parts
        self.logger = logger or RunLogger(None)
        self.global_steps = 0
        self.buffer = ReplayBuffer(filter_equal_rewards=config.data.dynamic_sampling)
        self.prompts = parts.train_data.batches(
            config.data.train_batch_size, shuffle=config.data.shuffle, seed=config.data.seed
        )
        self.adv_config = AdvantageConfig(
            gamma=config.algorithm.gamma, lam=config.algorithm.lam,
            norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
        )
        self.timer = StageTimer()
        self.updates_all_skipped = False  # the last step's actor updates were all skipped (non-finite)
        self.flops = ModelFlops.from_model_path(config.model.path)
        a = config.algorithm
        self.kl_ctrl: KLController | None = make_kl_controller(KLControlConfig(
            a.kl_ctrl_type, a.kl_coef, a.kl_target, a.kl_horizon)) if a.use_kl_in_reward else None
        self.kl_metrics: dict[str, float] = {}
        self.handover_memory: dict[str, float] = {}  # device memory at each hybrid hand-over (GiB in use)
        self.sync_metrics: dict[str, float] = {}  # bytes the last weight sync moved (per device, sliced / whole)
        self.old_log_prob_share = 1.0  # of the batch's rows the last old log-prob pass computed (MFU)
        self.fit_start = time.monotonic()  # trainer.time_limit_s counts from here (reset by fit)
        self.reward_errors = RewardErrors(config.reward.max_error_rate)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        self.fit_start = time.monotonic()
        if self.resume() is None and self.sleeps_rollout:
            self.give_devices_to_rollout()  # the first generation runs beside no training state
        if self.config.trainer.val_before_train and self.parts.val_data is not None:
            self.logger.log(self.global_steps, self.validate())  # a resumed run measures where it resumed
        while self.global_steps < self.config.trainer.total_training_steps and not self.out_of_time():
            self.logger.log(self.global_steps + 1, self.step())
        return self.logger.history

    def out_of_time(self) -> bool:
        limit = self.config.trainer.time_limit_s
        return limit is not None and time.monotonic() - self.fit_start >= limit

    def step(self) -> dict[str, Any]:
        t = self.timer = StageTimer()
        step_start = time.perf_counter()
        with t("gen"):
            self.on_sample_begin()
            trajectories = self.sample()  # stage 1 + 2: rollout, then reward (timed inside as "reward")
        reward_errors = self.reward_errors.take()  # past reward.max_error_rate the run stops here, before training
        if self.parts.reward_models is not None:  # judges' failed parses: scored with their fallback, counted here
            reward_errors.update(self.parts.reward_models.take_metrics())
        self.on_sample_end()  # hybrid: the devices go to the trainer (timed as handover/*)
        if not trajectories:
            return self.skip_step(step_start, reward_errors)
        if self.parts.reward_models is not None and self.parts.reward_models.colocated:
            with t("reward_colocated"):
                self.score_colocated(trajectories)
        batch = self.to_training_batch(trajectories)  # store keys + scalar columns
        with t("balance"):
            batch = self.balance(batch)
        with t("old_log_prob"):
            mismatch = self.compute_old_log_prob(batch)
        if self.use_reference:
            with t("ref"):
                self.parts.actor_rollout.compute_ref_log_prob(batch)
        if self.config.algorithm.distill.enable:
            with t("teacher"):
                self.compute_teacher_log_prob(batch)
        if self.parts.critic is not None:
            with t("values"):
                self.parts.critic.compute_values(batch)
        with t("adv"):
            batch = self.compute_advantage(batch)
        if self.parts.critic is not None:
            with t("update_critic"):
                critic_out = self.parts.critic.update_critic(batch, self.num_critic_updates)
        with t("update_actor"):
            actor_out = self.parts.actor_rollout.update_actor(batch, self.num_updates)
        self.release_samples(batch)
        self.global_steps += 1
        steps = actor_out[0]["steps"]
        self.updates_all_skipped = bool(steps) and all(not s["update_ok"] for s in steps)
        if self.updates_all_skipped:
            print(f"[mrl] step {self.global_steps}: every actor update was skipped (NaN/Inf loss or gradients); "
                  "the rollout keeps the last good weights", flush=True)
        metrics = {**self.step_metrics(trajectories, actor_out, mismatch), **reward_errors}
        if self.parts.critic is not None:
            metrics.update(mean_over_updates(critic_out))
        return self.end_step(metrics, step_start, batch)

    def skip_step(self, step_start: float, reward_errors: dict[str, float]) -> dict[str, Any]:
        """A step without samples: dynamic sampling evicted every group of its `data.max_sample_rounds` rounds (all
        rewards equal: no gradient anywhere). It trains nothing and says so (`train/skipped_step`, a warning), yet
        counts, so a run on prompts it already solves ends after total_training_steps instead of looping. verl
        raises once its refill budget is spent; one step without signal is no reason to end a run."""
        self.release_samples(light_batch([]))  # the evicted groups' samples
        self.global_steps += 1
        self.updates_all_skipped = True  # the actor did not change: awake replicas keep their weights
        print(f"[mrl] step {self.global_steps}: dynamic sampling kept no prompt group in "
              f"{self.config.data.max_sample_rounds} generation rounds (every group's rewards were equal); the step "
              "trains nothing", flush=True)
        return self.end_step({"train/skipped_step": 1.0, "buffer/evicted_groups": self.buffer.evicted,
                              **reward_errors}, step_start)

    def end_step(self, metrics: dict[str, Any], step_start: float, batch: Batch | None = None) -> dict[str, Any]:
        """What ends every step, trained or skipped: a checkpoint when due, the weight sync (replicas that slept get
        their weights back), validation when due, timings, and throughput of the trained `batch`."""
        c, t = self.config, self.timer
        # A run cut by trainer.time_limit_s saves its last step too, so the next run resumes where it stopped.
        last = self.out_of_time() and c.trainer.save_freq > 0
        if last or checkpointing.due(self.global_steps, c.trainer.save_freq, c.trainer.total_training_steps):
            with t("save_checkpoint"):
                self.save_checkpoint()
        with t("update_weights"):
            self.sync_weights()
        metrics.update(self.take_handover_memory())
        metrics.update(self.sync_metrics)
        due = c.trainer.test_freq > 0 and (self.global_steps % c.trainer.test_freq == 0 or self.out_of_time())
        if due and self.parts.val_data:
            with t("validate"):
                metrics.update(self.validate())
        metrics.update(t.metrics())
        metrics["timing_s/step"] = time.perf_counter() - step_start
        if batch is not None:
            metrics.update(self.perf_metrics(batch, metrics))
        self.on_step_end(metrics)
        return metrics

    # ---- hooks (mode differences live here) ---------------------------------------------------------------------
    def on_sample_begin(self) -> None:
        return None

    def on_sample_end(self) -> None:
        # Sync mode stays on-policy: surplus groups from dynamic-sampling refills are not kept for the next step.
        self.buffer.clear()
        if self.sleeps_rollout:
            self.give_devices_to_trainer()

    def sync_weights(self) -> None:
        asleep = self.sleeps_rollout
        if self.updates_all_skipped and not asleep:
            return  # the actor did not change: replicas keep the last good weights and their version
        t = self.timer
        if asleep:
            with t("sync/wake_weights"):
                # The engine's weights wake into what the training roles leave free: their allocators give back
                # the update's cached activations first (a 2.6B MoE update's left too little on an H100).
                for group in self.training_groups():
                    group.release_cached_blocks()
                self.parts.rollout.wake_up(["weights"])
        with t("sync/update"):  # export, transfer and load, pipelined bucket by bucket
            self.sync_metrics = device_sync_metrics(self.parts.actor_rollout.update_weights(self.global_steps))
        if asleep:  # the export needed the actor's weights on the device; now the rollout gets the memory back
            self.give_devices_to_rollout()

    # ---- hybrid hand-over: the devices alternate between the rollout engines and the training roles ----------------
    def give_devices_to_trainer(self) -> None:
        """The replicas sleep, then the training roles bring back what they offloaded. Level 2 (the default,
        rollout.sleep_level) discards the engine's weights, since the sync after the step refills them anyway."""
        with self.timer("handover/sleep"):
            self.parts.rollout.sleep(level=self.config.rollout.sleep_level)
            for judge in self.judges_beside_trainer:  # level 1: a judge's weights never come back by a sync
                judge.sleep(level=1)
        with self.timer("handover/onload"):
            self.note_handover("rollout_asleep", "trainer_onloaded", "onload")

    def give_devices_to_rollout(self) -> None:
        """The training roles offload (and free the allocator's cache), then the engines' KV cache wakes."""
        with self.timer("sync/offload"):
            self.note_handover("trainer_resident", "trainer_offloaded", "offload")
        with self.timer("sync/wake_kv_cache"):
            self.parts.rollout.wake_up(["kv_cache"])
            for judge in self.judges_beside_trainer:
                judge.wake_up()
        awake = self.parts.actor_rollout.device_memory()
        self.handover_memory["rollout_awake"] = max(m.get("used", 0.0) for m in awake)

    def note_handover(self, before: str, after: str, method: str) -> None:
        """Call `method` (offload/onload) on every training group; keep the device memory (GiB in use, the most
        loaded device) before and after it."""
        reports = [report for g in self.training_groups() for report in getattr(g, method)()]
        for point, key in ((before, "before"), (after, "after")):
            self.handover_memory[point] = max(r[key].get("used", 0.0) for r in reports)

    def training_groups(self) -> list[Any]:
        return [g for g in (self.parts.actor_rollout, self.parts.critic) if g is not None]

    def take_handover_memory(self) -> dict[str, float]:
        """`memory/handover/<point>_used_gib` since the last step (nothing on CPU hosts)."""
        out = {f"memory/handover/{k}_used_gib": v for k, v in self.handover_memory.items() if v > 0}
        self.handover_memory = {}
        return out

    def on_step_end(self, metrics: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        """Stop what the mode runs beside the workers (async modes: the rollout producer); `shutdown` calls it."""
        return None

    # ---- stages -----------------------------------------------------------------------------------------------
    def sample(self) -> list[dict[str, Any]]:
        """Complete prompt groups for one step. With dynamic sampling, groups with all-equal rewards are evicted
        and more prompts are generated, up to `data.max_sample_rounds` rounds (then the step uses what it has)."""
        c = self.config
        want = c.data.train_batch_size
        for _ in range(c.data.max_sample_rounds if c.data.dynamic_sampling else 1):
            prompts = [{**p, "uid": f"{p['uid']}@{uuid.uuid4().hex[:8]}"} for p in next(self.prompts)]
            trajectories = self.parts.agent_loops.generate(prompts, c.rollout.n, self.sampling(train=True))
            with self.timer("reward"):
                self.score(trajectories, prompts)
            self.buffer.add(trajectories, c.rollout.n)
            if self.buffer.ready(want):
                break
        return self.buffer.sample(min(want, len(self.buffer)))

    def score(self, trajectories: list[dict[str, Any]], prompts: list[dict[str, Any]]) -> None:
        """Score each response's text (decoded from its model tokens by the agent loop; trajectories: consecutive
        groups, one per prompt); the prompt's fields ride along for the dump."""
        n = len(trajectories) // len(prompts)
        items = []
        for k, traj in enumerate(trajectories):
            prompt = prompts[k // n]
            traj.update(uid=prompt["uid"], messages=prompt["messages"], ground_truth=prompt["ground_truth"])
            extra = {**prompt["extra_info"], **traj.get("reward_info", {})}  # a custom loop's reward inputs
            items.append(RewardItem(traj["response_text"], prompt["ground_truth"], prompt["data_source"], extra))
        model_scores: dict[str, list[float]] = {}
        if self.parts.reward_models is None:
            results = self.parts.reward.evaluate_sync(items)
        else:
            future = self.parts.reward.submit(items)  # rule rewards run while the reward models score
            model_scores = self.score_with_models(trajectories)
            results = future.result()
        self.reward_errors.record(items, results)  # failures score 0: counted per data source, not dropped
        if self.parts.reward_models is not None:  # rule_weight applies even when only colocated models add later
            rule = [r.score for r in results]
            totals = combine(rule, model_scores, self.config.reward.rule_weight, self.parts.reward_models.weights)
            for k, (traj, total) in enumerate(zip(trajectories, totals)):
                traj["score"] = total
                traj["reward_parts"] = {"rule": rule[k], **{name: s[k] for name, s in model_scores.items()}}
        else:
            for traj, result in zip(trajectories, results):
                traj["score"] = result.score

    def score_with_models(self, trajectories: list[dict[str, Any]]) -> dict[str, list[float]]:
        """{reward model name: score per trajectory}: discriminative models score its token ids (prompt + response)
        from the store, judges its text (the prompt's last user message, the response, the ground truth)."""
        models = self.parts.reward_models
        sequences: list[list[int]] = []
        if models.needs_token_ids:
            ids = self.store.get_jagged([t["key"] for t in trajectories], ["input_ids"])["input_ids"]
            sequences = [row.tolist() for row in ids.to_list()]
        texts = [JudgeInput(prompt_text(t["messages"]), t["response_text"],
                            "" if t["ground_truth"] is None else str(t["ground_truth"])) for t in trajectories]
        return models.score(sequences, texts)

    def score_colocated(self, trajectories: list[dict[str, Any]]) -> None:
        """Add each colocated reward model's weighted score to the step's rewards and parts. They run in the actor
        workers, so only once the trainer holds its devices (after sampling): the sum is the one `combine` makes,
        in two parts. Validation's scores leave them out (its samples are scored while the rollout has the
        devices)."""
        models = self.parts.reward_models
        keys = [t["key"] for t in trajectories]
        self.parts.actor_rollout.compute_reward_scores(light_batch(trajectories))
        fields = [reward_score_field(name) for name in models.colocated]
        stored = self.store.get_jagged(keys, fields)
        for name, field in zip(models.colocated, fields):
            for traj, score in zip(trajectories, stored[field].values.tolist()):
                traj["score"] += models.weights[name] * score
                traj["reward_parts"][name] = score

    def to_training_batch(self, trajectories: list[dict[str, Any]]) -> Batch:
        """The step's light batch (store keys and scalar columns). No-op samples make the count divisible by
        DP × updates (actor and critic), so every rank makes the same updates; each owns a copy of its source's
        payload in the store."""
        multiple = self.dp_size * math.lcm(self.num_updates, self.num_critic_updates)
        records = pad_with_noops(trajectories, multiple)
        put_noop_payloads(self.store, records)
        return light_batch(records)

    def balance(self, batch: Batch) -> Batch:
        return batch[batching.balance_order(batch["length"].tolist(), self.dp_size)]

    def compute_old_log_prob(self, batch: Batch) -> dict[str, float]:
        """π_old into the store (by the actor; all rows but those the first update trains on-policy); returns the
        rollout-vs-trainer mismatch metrics of the rows it computed, and the rollout correction's (`rollout_corr/*`,
        also per staleness level). Bypass mode computes no π_old, so it measures, and reports, no mismatch."""
        if not self.config.rollout.recompute_old_log_prob:
            # bypass: the workers read the rollout's log-probs as π_old. Their agreement with themselves measures
            # nothing of the trainer against the engine: no `rollout/*` metric rather than a constant 1.0.
            return {}
        # The actor skips rows its first update trains on-policy (ActorRolloutRefWorker.on_policy_rows).
        per_rank = self.parts.actor_rollout.compute_log_prob(batch, self.num_updates)
        self.old_log_prob_share = min(sum(r["rows"] for r in per_rank) / max(len(batch), 1), 1.0)
        return {**batching.mismatch_over_ranks(per_rank), **batching.routing_over_ranks(per_rank),
                **correction_metrics([r["correction"] for r in per_rank], self.global_steps)}

    def compute_teacher_log_prob(self, batch: Batch) -> None:
        """`teacher_log_prob` of every token into the store: by the frozen teacher beside the actor, or by the
        teacher's own replicas (placement pool), which score each row's prompt + response as one prompt."""
        if self.parts.teacher is None:
            self.parts.actor_rollout.compute_teacher_log_prob(batch)
            return
        keys = list(batch["key"])
        ids = self.store.get_jagged(keys, ["input_ids"])["input_ids"].to_list()
        scored = self.parts.teacher.log_probs([row.tolist() for row in ids])
        column = JaggedTensor.from_list([torch.tensor(row, dtype=torch.float32) for row in scored])
        self.store.update_jagged(keys, {"teacher_log_prob": column})

    def compute_advantage(self, batch: Batch) -> Batch:
        """Outcome estimators give one scalar per sample (`advantage`, a column of the light batch); GAE (the
        critic's per-token values), REINFORCE++ (discounted, whitened over tokens) and KL-in-reward are per-token: one
        worker computes `advantages` and `returns` into the store, and the KL controller comes back updated.
        Distillation (algorithm.distill) makes them per-token on every DP rank: the teacher's signal alone, or added
        to the task's."""
        estimator, distill = self.config.algorithm.adv_estimator, self.config.algorithm.distill
        alone = distill.enable and distill.mode == "alone"  # the teacher's signal is the whole advantage
        if not alone and (estimator in batching.TOKEN_LEVEL_ESTIMATORS or self.kl_ctrl is not None):
            self.kl_metrics, self.kl_ctrl = self.parts.actor_rollout.compute_token_advantages(
                batch, estimator, self.adv_config, self.kl_ctrl, self.config.algorithm.kl_penalty)
        elif not alone:
            batch["advantage"] = batching.scalar_advantages(batch, estimator, self.adv_config)
        if distill.enable:
            per_rank = self.parts.actor_rollout.compute_distill_advantages(batch)
            self.kl_metrics.update(batching.token_weighted_mean(per_rank, ["distill/kl"]))
            if "advantage" in batch:  # now inside the stored per-token advantages, which the update reads
                del batch["advantage"]
        return batch

    def release_samples(self, batch: Batch) -> None:
        """The step is trained: its samples (and those of groups the buffer discarded) leave the store."""
        self.store.delete(sorted(set(batch["key"]) | set(self.buffer.take_discarded())))

    @property
    def store(self) -> SampleStore:
        assert self.parts.store is not None, "TrainerParts.store: the sample store of the agent loops"
        return self.parts.store

    # ---- checkpoints (mrl/trainer/checkpointing.py: layout, atomic commit, which one to resume) -------------
    def save_checkpoint(self) -> str:
        """Engines (actor, critic) and driver state of this step, committed atomically; returns the folder."""
        root = self.config.trainer.default_local_dir
        staging = checkpointing.staging_dir(root, self.global_steps)
        self.parts.actor_rollout.save_checkpoint(f"{staging}/actor")
        if self.parts.critic is not None:
            self.parts.critic.save_checkpoint(f"{staging}/critic")
        checkpointing.save_trainer_state(staging, self.trainer_state())
        final = checkpointing.step_dir(root, self.global_steps)
        checkpointing.commit(staging, final)
        checkpointing.prune(root, self.config.trainer.max_checkpoints_to_keep, final)
        return final

    def load_checkpoint(self, path: str) -> None:
        self.parts.actor_rollout.load_checkpoint(f"{path}/actor")
        if self.parts.critic is not None:
            self.parts.critic.load_checkpoint(f"{path}/critic")
        self.restore_trainer_state(checkpointing.load_trainer_state(path))

    def trainer_state(self) -> dict[str, Any]:
        """The driver's part of a checkpoint (async modes add their rollout producer's). Groups still buffered are
        saved with their payloads from the store: a resumed run trains on exactly those tokens."""
        keys = self.buffer.keys()
        return {"global_steps": self.global_steps, "dataloader": self.prompts.state_dict(), "buffer": self.buffer,
                "payloads": dict(zip(keys, self.store.get(keys))) if keys else {}, "rng": rng_state(),
                "kl_ctrl": self.kl_ctrl}

    def restore_trainer_state(self, state: dict[str, Any]) -> None:
        self.global_steps = state["global_steps"]
        self.prompts.load_state_dict(state["dataloader"])
        self.buffer = state["buffer"]
        self.buffer.take_discarded()  # keys of the saved run's store, not this one's
        if state.get("payloads"):
            self.store.put(state["payloads"])
        set_rng_state(state["rng"])
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:  # the adaptive β carries on
            self.kl_ctrl = state["kl_ctrl"]

    def resume(self) -> str | None:
        """Per `trainer.resume_mode`: load the checkpoint and push its weights to the rollout replicas, which
        started from model.path. Returns the folder resumed from (None: a fresh start)."""
        path = checkpointing.resume_path(self.config.trainer.resume_mode, self.config.trainer.default_local_dir)
        if path is None:
            return None
        self.load_checkpoint(path)
        if self.sleeps_rollout:  # as after a step: the trainer holds the devices, rollout sleeps
            self.give_devices_to_trainer()
        self.sync_weights()
        print(f"[mrl] resumed from {path} at global step {self.global_steps}", flush=True)
        return path

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split (and pass@k with k temperature samples when val_pass_k > 0)."""
        c, val = self.config, self.parts.val_data
        assert val is not None
        prompts = list(val.rows)
        size = c.data.val_batch_size or len(prompts)
        greedy = self.generate_scored(prompts, 1, {**self.sampling(train=False), "temperature": 0.0}, size)
        metrics = {"val/greedy_acc": held_out_accuracy(greedy)}
        if c.rollout.agent_loop != "single_turn":
            metrics.update(agent_loop_metrics(greedy, prefix="val"))
        k = c.trainer.val_pass_k
        if k > 0:
            sampled = self.generate_scored(prompts, k, self.sampling(train=False), size)
            hits = [any(t["score"] > 0 for t in sampled[i * k : (i + 1) * k]) for i in range(len(prompts))]
            metrics[f"val/pass@{k}"] = sum(hits) / len(prompts)
        return metrics

    def generate_scored(self, prompts: list[dict[str, Any]], n: int, sampling: dict[str, Any],
                        batch_size: int) -> list[dict[str, Any]]:
        """n scored trajectories per prompt (consecutive), generated `batch_size` prompts at a time."""
        out: list[dict[str, Any]] = []
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            trajectories = self.parts.agent_loops.generate(chunk, n, sampling)
            self.score(trajectories, chunk)  # before the drop: a discriminative reward model reads the token ids
            self.store.delete([t["key"] for t in trajectories])  # never trained on
            out += trajectories
        return out

    # ---- helpers ------------------------------------------------------------------------------------------------
    @property
    def sleeps_rollout(self) -> bool:
        """Hybrid replicas sleep while the trainer has the devices, unless rollout.free_cache_engine is off."""
        return self.config.rollout.mode == "hybrid" and self.config.rollout.free_cache_engine

    @property
    def judges_beside_trainer(self) -> list[Any]:
        """The replica managers of colocated generative reward models (asleep and awake with the rollout)."""
        models = self.parts.reward_models
        return models.judges_beside_trainer if models is not None else []

    @property
    def use_reference(self) -> bool:
        return self.config.actor.use_kl_loss or self.config.algorithm.use_kl_in_reward

    @property
    def num_updates(self) -> int:
        return self.config.data.train_batch_size // self.config.actor.ppo_mini_batch_size

    @property
    def num_critic_updates(self) -> int:
        if self.parts.critic is None:  # no critic: its mini-batch size (unchecked then) must not shape batches
            return 1
        return self.config.data.train_batch_size // self.config.critic.ppo_mini_batch_size

    @property
    def dp_size(self) -> int:
        return self.parts.actor_rollout.dispatch_layout("actor").n_chunks

    def sampling(self, train: bool) -> dict[str, Any]:
        r = self.config.rollout
        return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "logprobs": True,
                "seed": self.request_seed(self.global_steps * 10_007 + (0 if train else 7)), "ignore_eos": r.ignore_eos}

    def request_seed(self, offset: int) -> int | None:
        """The seed of a group's first sample (the client adds each sample's index), or None where
        rollout.seed_requests is off."""
        return self.config.trainer.seed * 1_000_003 + offset if self.config.rollout.seed_requests else None

    def step_metrics(self, trajectories: list[dict[str, Any]], actor_out: list[dict],
                     mismatch: dict[str, float]) -> dict:
        real = [t for t in trajectories if not t.get("is_noop")]
        scores = torch.tensor([t["score"] for t in real])
        gen_tokens = sum(t["model_tokens"] for t in real)
        metrics: dict[str, Any] = {
            "reward/mean": float(scores.mean()),
            "response_length/mean": gen_tokens / max(len(real), 1),
            "buffer/evicted_groups": self.buffer.evicted,
            "train/skipped_step": 0.0,
            "perf/gen_tokens_per_s": gen_tokens / max(self.timer.seconds.get("gen", 0.0), 1e-9),
        }
        metrics.update(agent_loop_metrics(real))
        metrics.update(reward_part_metrics(real))
        metrics.update(mean_over_updates(actor_out, prefix="actor"))
        metrics.update(self.kl_metrics)
        metrics.update(mismatch)
        # global_steps already counts this step's update: the policy that sampled and trained is one version back.
        metrics.update(staleness_metrics(real, self.global_steps - 1))
        self.logger.dump_rollouts(self.global_steps, [
            {"prompt": t["messages"], "response": t["response_text"], "reward": t["score"],
             "ground_truth": t["ground_truth"], "version": t["max_version"]} for t in real
        ])
        return metrics

    def perf_metrics(self, batch: Batch, metrics: dict[str, Any]) -> dict[str, float]:
        """Throughput, MFU and the workers' peak memory per phase of the step whose `timing_s/*` are in `metrics`."""
        seconds = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
        memory = self.parts.actor_rollout.memory_stats()
        if self.parts.critic is not None:
            memory += self.parts.critic.memory_stats()
        return perf_metrics(batch["length"].tolist(), seconds, memory, self.flops,
                            self.config.trainer.peak_tflops_per_device, trainer_devices=self.trainer_devices,
                            run_devices=self.num_devices, actor_epochs=self.config.actor.ppo_epochs,
                            stage_share={"old_log_prob": self.old_log_prob_share})

    @property
    def trainer_devices(self) -> int:
        return self.config.resources.nnodes * self.config.resources.n_gpus_per_node

    @property
    def num_devices(self) -> int:
        """Devices of the run: the trainer's pool, plus a standalone rollout pool's."""
        r = self.config.rollout
        return self.trainer_devices + (r.nnodes * r.n_gpus_per_node if r.mode == "standalone" else 0)
