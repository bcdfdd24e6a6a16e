"""Critic worker: the role that computes values and trains the critic (mrl/engine/megatron/critic.py) under
its own value loss: verl's clipped value objective (`critic.cliprange_value`) aggregated by `critic.loss_agg_mode`.
Token alignment is the log-probs' (value t from the hidden state at t−1, see mrl/engine/base.py), so GAE runs on
the same [n, L] layout as everything else.
"""

from __future__ import annotations

from typing import Any

import torch

from mrl.algo.aggregation import agg_loss
from mrl.algo.value_loss import clipped_value_loss
from mrl.config.schema import CriticConfig, MrlConfig
from mrl.controller import Dispatch, Worker, nd_compute, register
from mrl.data.batch import Batch
from mrl.engine.megatron.critic import MegatronCritic
from mrl.utils.phase_memory import phase_memory, tracks_memory
from mrl.workers.cpu_threads import worker_threads
from mrl.workers.training_worker import (
    DeviceHandover,
    StoreClient,
    TrainingWorker,
    jagged_from_flat,
    loss_scale_factor,
    scheduled_updates,
    to_engine_batch,
)

CRITIC_MESH = "critic"


def make_value_loss_fn(critic: CriticConfig, loss_scale_factor: float | None = None) -> Any:
    """The engine loss_fn of a critic update: ½·max((V−R)², (V_clip−R)²) aggregated as `critic.loss_agg_mode`
    (`loss_scale_factor`: C of seq-mean-token-sum-norm, the actor's)."""

    def loss_fn(outputs: Any, mb: Any, normalizer: Any) -> Any:
        mask = mb["response_mask"]
        out = clipped_value_loss(outputs["values"], mb["values"], mb["returns"], mask, critic.cliprange_value)
        loss = agg_loss(out.loss_mat, mask, critic.loss_agg_mode, normalizer, loss_scale_factor)
        local = agg_loss(out.loss_mat.detach(), mask, critic.loss_agg_mode, None, loss_scale_factor)
        return loss, {"critic/vf_loss": local, **{f"critic/{k}": v for k, v in out.metrics.items()}}

    return loss_fn


class CriticWorker(StoreClient, DeviceHandover, Worker):
    """Like the actor's roles, it fetches its rows by key from the sample store and writes `values` back there."""

    def __init__(self, config: MrlConfig) -> None:
        super().__init__()
        torch.set_num_threads(worker_threads(config, torch.cuda.is_available()))  # mrl/workers/cpu_threads.py
        self.config = config
        self.critic: TrainingWorker | None = None
        self.loss_fn = make_value_loss_fn(config.critic, loss_scale_factor(config))

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def init_model(self) -> None:
        c = self.config
        engine = MegatronCritic.from_critic_config(
            c.model.path, c.critic,
            total_steps=scheduled_updates(c, c.critic.ppo_mini_batch_size),  # one pass per step (update_critic)
            seed=c.trainer.seed, bridge_backend=c.model.bridge_backend,
        )
        engine.initialize()
        self.critic = TrainingWorker(engine)
        self.register_mesh(CRITIC_MESH, engine.mesh())

    @register(nd_compute(CRITIC_MESH), pad=True)
    @tracks_memory("values")
    def compute_values(self, batch: Batch) -> None:
        """`values` of every token, into the store (written by the rank dispatch collects)."""
        assert self.critic is not None, "init_model first"
        fetched = self.fetch(batch, ["input_ids"])
        out = self.critic.infer_batch(to_engine_batch(fetched, ["input_ids"]))
        self.write(CRITIC_MESH, batch, {"values": jagged_from_flat(out["values"], fetched.jagged_field("input_ids"))})

    @register(nd_compute(CRITIC_MESH))
    @tracks_memory("update_critic")
    def update_critic(self, batch: Batch, num_updates: int) -> dict[str, Any]:
        assert self.critic is not None, "init_model first"
        keys = ["input_ids", "response_mask", "values", "returns"]
        batch = self.fetch(batch, keys)
        before = self.critic.updates
        steps = self.critic.train_batch(to_engine_batch(batch, keys), self.loss_fn, num_updates)
        return {"updates": self.critic.updates - before, "steps": steps}

    def training_roles(self) -> list[tuple[TrainingWorker, Any]]:
        return [(self.critic, self.config.critic.megatron)] if self.critic is not None else []

    @register(Dispatch.ONE_TO_ALL)
    def memory_stats(self) -> dict[str, Any]:
        return phase_memory(self).take()

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        assert self.critic is not None, "init_model first"
        self.critic.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        assert self.critic is not None, "init_model first"
        self.critic.load_checkpoint(path)
