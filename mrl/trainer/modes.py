"""The async trainer modes: `PPOTrainer` subclasses that override hooks only (DESIGN.md glossary).

- `colocate_async` (hybrid replicas, the trainer's devices): a background producer keeps up to
  `staleness_threshold` steps' worth of extra groups generating. When a step's groups are ready, the unfinished
  ones are aborted (their clients keep the tokens and re-send at once; the re-sent requests park in the paused
  servers) and the replicas sleep; after the update the weights are synced and generation resumes, so the
  aborted requests continue on the new weights (partial rollout: long responses no longer stall a step).
- `separate_async` (a standalone rollout pool): the producer keeps the pool generating while the actor trains;
  after every step (= `weight_sync.parameter_sync_step` optimizer updates, a start-up rule) the standalone sync
  sequence (mrl/weight_sync/state_machine.py) moves the weights and resumes generation.

Both take each step's groups from the producer's replay buffer, which drops groups staler than
`weight_sync.staleness_threshold` versions; the step's metrics carry the staleness distribution. Buffered groups'
tokens stay in the sample store until a step trains them (or the buffer drops them); a checkpoint saves them.
"""

from __future__ import annotations

import copy
from typing import Any

import ray

from mrl.config.schema import MrlConfig
from mrl.data.batch import Batch
from mrl.data.replay_buffer import ReplayBuffer
from mrl.trainer.metrics import RunLogger
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts
from mrl.trainer.producer import Prompt, RolloutProducer
from mrl.weight_sync.state_machine import StandaloneWeightSync


class AsyncTrainer(PPOTrainer):
    """What both async modes share: generation runs in a `RolloutProducer`, the step takes finished groups."""

    def __init__(self, config: MrlConfig, parts: TrainerParts, logger: RunLogger | None = None) -> None:
        super().__init__(config, parts, logger)
        c = config
        self.buffer = ReplayBuffer(filter_equal_rewards=c.data.dynamic_sampling,
                                   staleness_threshold=c.weight_sync.staleness_threshold)
        self.producer = RolloutProducer(
            self.submit_group, self.score, self.prompts, self.buffer, c.rollout.n, c.data.train_batch_size,
            c.weight_sync.staleness_threshold,
            max_evictions_per_step=c.data.max_sample_rounds * c.data.train_batch_size if c.data.dynamic_sampling
            else None,
            group_timeout_s=c.rollout.generate_timeout_s,
        )
        self.step_extra: dict[str, float] = {}

    def submit_group(self, prompt: Prompt, index: int) -> ray.ObjectRef:
        # Seeds follow the group's start order, not the step: a group may start during any step.
        params = {**self.sampling(train=True), "seed": self.request_seed(index * 10_007)}
        return self.parts.agent_loops.submit(prompt, self.config.rollout.n, params)

    def sample(self) -> list[dict[str, Any]]:
        self.producer.start()
        trajectories = self.producer.take(self.config.data.train_batch_size, self.global_steps)
        # Partial rollouts: the share of samples whose tokens came from more than one weight version (the step's
        # staleness/mean and /max come with every trainer's metrics).
        spanning = sum(t["min_version"] < t["max_version"] for t in trajectories)
        self.step_extra = {"staleness/spanning_frac": spanning / max(len(trajectories), 1)}
        return trajectories

    def on_sample_end(self) -> None:
        return None  # leftovers stay buffered: they are the next step's (bounded-staleness) data

    def release_samples(self, batch: Batch) -> None:
        with self.producer.lock:  # the producer thread discards groups (evicted, stale) into the buffer's list
            super().release_samples(batch)

    def on_step_end(self, metrics: dict[str, Any]) -> None:
        metrics.update(self.step_extra)
        metrics.update(self.producer.stats())

    def trainer_state(self) -> dict[str, Any]:
        # One consistent snapshot while the producer thread draws prompts and fills the buffer: the dataloader
        # position counts every prompt drawn, the buffer holds the finished groups, the producer lists the rest.
        with self.producer.lock:
            state = super().trainer_state()
            state["buffer"] = copy.deepcopy(self.buffer)
            state["producer"] = self.producer.state_dict()
        return state

    def restore_trainer_state(self, state: dict[str, Any]) -> None:
        super().restore_trainer_state(state)
        self.producer.buffer = self.buffer
        self.producer.load_state_dict(state.get("producer", {}), self.global_steps)

    def close(self) -> None:
        self.producer.stop()
        super().close()


class ColocateAsyncTrainer(AsyncTrainer):
    def on_sample_end(self) -> None:
        # Partial rollout: abort what still generates (it resumes after the sync), then lend the devices.
        with self.timer("handover/abort"):
            self.step_extra["partial_rollout/aborted_requests"] = float(sum(self.parts.rollout.abort_all()))
        if self.sleeps_rollout:  # else (rollout.free_cache_engine=false) the paused replicas keep their memory
            self.give_devices_to_trainer()

    def sync_weights(self) -> None:
        super().sync_weights()  # hybrid: wake weights, update, offload the actor, wake the KV cache
        self.producer.set_version(self.global_steps)
        self.parts.rollout.resume_generation()  # the aborted requests continue on the new weights


class SeparateAsyncTrainer(AsyncTrainer):
    def __init__(self, config: MrlConfig, parts: TrainerParts, logger: RunLogger | None = None) -> None:
        super().__init__(config, parts, logger)
        self.weight_sync = StandaloneWeightSync(parts.rollout, parts.actor_rollout.update_weights)

    def sync_weights(self) -> None:
        # Every actor update of the step skipped (non-finite): the pool keeps the last good weights, which equal
        # the actor's, so generation goes on untouched; admission still moves on with the step.
        if not self.updates_all_skipped:
            self.step_extra.update(self.weight_sync.run(self.global_steps).metrics())
        self.producer.set_version(self.global_steps)


TRAINERS: dict[str, type[PPOTrainer]] = {
    "sync": PPOTrainer,
    "colocate_async": ColocateAsyncTrainer,
    "separate_async": SeparateAsyncTrainer,
}


def trainer_class(mode: str) -> type[PPOTrainer]:
    if mode not in TRAINERS:
        raise ValueError(f"trainer.mode={mode!r} is not a trainer mode; known: {', '.join(TRAINERS)}")
    return TRAINERS[mode]
