"""Critic: a Megatron engine that outputs a value per token instead of log-probs, and its worker role.

The value head is row 0 of the (vocab-parallel) output layer: V(s_t) = h_{t−1} · W_out[0]. The critic starts from
the policy's weights, and a row of the existing output projection is a head Megatron already shards, trains and
checkpoints — no new parameter the bridge would have to know. Token alignment is the log-probs' (value t from the
hidden state at t−1, see mrl/engine/base.py), so GAE runs on the same [n, L] layout as everything else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mrl.algo.aggregation import agg_loss
from mrl.algo.value_loss import clipped_value_loss
from mrl.config.schema import MrlConfig
from mrl.controller import Dispatch, Worker, nd_compute, register
from mrl.data.batch import Batch
from mrl.engine.megatron.engine import MegatronEngine
from mrl.engine.megatron.packing import PackedMicroBatch, shift_to_tokens
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
VALUE_ROW = 0


def value_output_processor(
    hidden_states: Tensor, output_layer: Any, output_weight: Tensor | None, context: Any, **_: Any
) -> Tensor:
    """GPTModel `output_processor` hook: per-position values [b, s] from the value row of the output weight."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    weight = output_weight if output_weight is not None else output_layer.weight
    if output_layer.sequence_parallel:
        hidden_states = mappings.gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
    else:
        hidden_states = mappings.copy_to_tensor_model_parallel_region(hidden_states)
    # The row lives on TP rank 0 (vocab-parallel shards); other ranks add zeros and the sum is the value.
    owner = parallel_state.get_tensor_model_parallel_rank() == VALUE_ROW // weight.shape[0]
    local = hidden_states @ weight[VALUE_ROW % weight.shape[0]] * (1.0 if owner else 0.0)
    return mappings.reduce_from_tensor_model_parallel_region(local).t()


class MegatronValueEngine(MegatronEngine):
    def _output_processor(self) -> Any:
        return value_output_processor

    def _token_outputs(self, mb: PackedMicroBatch, output: Any) -> dict[str, Tensor]:
        return {"values": mb.unpack(shift_to_tokens(output[0], mb.cu_seqlens))}

    def _output_keys(self, entropy: bool) -> list[str]:
        return ["values"]


def make_value_loss_fn(cliprange_value: float, loss_agg_mode: str, loss_scale_factor: float | None = None) -> Any:
    """The value loss, aggregated like the actor's (`loss_scale_factor`: C of seq-mean-token-sum-norm)."""

    def loss_fn(outputs: Any, mb: Any, normalizer: Any) -> Any:
        mask = mb["response_mask"]
        out = clipped_value_loss(outputs["values"], mb["values"], mb["returns"], mask, cliprange_value)
        loss = agg_loss(out.loss_mat, mask, loss_agg_mode, normalizer, loss_scale_factor)
        local = agg_loss(out.loss_mat.detach(), mask, loss_agg_mode, None, loss_scale_factor)
        return loss, {"critic/vf_loss": local, **{f"critic/{k}": v for k, v in out.metrics.items()}}

    return loss_fn


class CriticWorker(StoreClient, DeviceHandover, Worker):
    """Like the actor's roles, it fetches its rows by key from the sample store and writes `values` back there."""

    def __init__(self, config: MrlConfig) -> None:
        super().__init__()
        torch.set_num_threads(worker_threads(config, torch.cuda.is_available()))  # mrl/workers/cpu_threads.py
        self.config = config
        self.critic: TrainingWorker | None = None
        self.loss_fn = make_value_loss_fn(config.critic.cliprange_value, config.actor.loss_agg_mode,
                                          loss_scale_factor(config))

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def init_model(self) -> None:
        c = self.config
        engine = MegatronValueEngine(
            c.model.path,
            c.critic.megatron,
            c.critic.optim,
            micro_batch_size=c.critic.ppo_micro_batch_size_per_gpu,
            total_steps=scheduled_updates(c, c.critic.ppo_mini_batch_size),  # one pass per step (update_critic)
            seed=c.trainer.seed,
            bridge_backend=c.model.bridge_backend,
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
