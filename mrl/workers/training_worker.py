"""`TrainingWorker`: the generic training role over one `BaseEngine` — it knows batches, losses and optimizer
updates, nothing about RL.

`train_batch` cuts this DP rank's share of a step into `num_updates` consecutive mini-batches and runs one
`forward_backward` + `optimizer_step` per mini-batch (the engine splits each further into micro-batches). Every DP
rank must call it with the same `num_updates`: the engine all-reduces loss denominators per update. Counts are
made divisible by the caller with no-op samples (all-zero loss mask), never by dispatch padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mrl.controller import Dispatch, register
from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor
from mrl.data.samples import fetch, write_back
from mrl.engine.base import BaseEngine, LossFn
from mrl.utils.phase_memory import device_memory, release_cached_blocks


def to_engine_batch(batch: Batch, token_keys: list[str]) -> Any:
    """The engine's jagged layout (mrl/engine/megatron/packing.py) of the per-token fields `token_keys`; they must
    share the offsets of `input_ids`."""
    from mrl.engine.megatron.packing import JaggedBatch

    offsets = batch.jagged_field("input_ids").offsets
    fields = {}
    for key in token_keys:
        field = batch.jagged_field(key)
        if not torch.equal(field.offsets, offsets):
            raise ValueError(f"token field {key!r} is not aligned with input_ids")
        fields[key] = field.values
    return JaggedBatch(offsets, fields)


class StoreClient:
    """What the worker roles share on the sample path: the store handle, and fetching a light batch's per-token
    fields by key (mrl/data/samples.py)."""

    store: Any = None
    # The store field read when a role asks for "old_log_probs" (the actor's bypass mode reads the rollout's).
    old_log_prob_field = "old_log_probs"

    @register(Dispatch.ONE_TO_ALL)
    def set_store(self, store: Any) -> None:
        self.store = store

    def write(self, mesh: str, light: Batch, outputs: dict[str, JaggedTensor]) -> None:
        """Per-token `outputs` of `light`'s rows into the store, by the one rank of `mesh` whose outputs dispatch
        collects (TP 0, last PP stage): one writer per sample."""
        if self.mesh(mesh).is_collect:  # mesh(): Worker's, which every role also is
            write_back(self.store, light, outputs)

    def fetch(self, batch: Batch, fields: list[str]) -> Batch:
        old = self.old_log_prob_field
        out = fetch(self.store, batch, [old if f == "old_log_probs" else f for f in fields])
        if "old_log_probs" in fields and old != "old_log_probs":
            out["old_log_probs"] = out.jagged_field(old)
        return out


class DeviceHandover:
    """Hybrid mode's hand-over of a device between the training roles of a worker and the rollout engine beside
    them: `offload` before the engine wakes, `onload` after it sleeps. Each role moves the state its
    `megatron.*_offload` settings name, and the allocator's cached blocks (activations, freed buffers) go back to
    the device either way: the engine's allocator cannot reuse them. Both return the device's memory before and
    after (mrl/utils/phase_memory.py `device_memory`), which the trainer logs as `memory/handover/*`."""

    def training_roles(self) -> list[tuple[TrainingWorker, Any]]:
        """(role, its MegatronConfig) of every engine this worker holds."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def offload(self) -> dict[str, dict[str, float]]:
        before = device_memory()
        for role, m in self.training_roles():
            role.offload(params=m.param_offload, grads=m.grad_offload, optimizer=m.optimizer_offload)
        release_cached_blocks()
        return {"before": before, "after": device_memory()}

    @register(Dispatch.ONE_TO_ALL)
    def release_cached_blocks(self) -> None:
        release_cached_blocks()

    @register(Dispatch.ONE_TO_ALL)
    def onload(self) -> dict[str, dict[str, float]]:
        before = device_memory()
        for role, _ in self.training_roles():
            role.onload()
        return {"before": before, "after": device_memory()}

    @register(Dispatch.ONE_TO_ALL)
    def device_memory(self) -> dict[str, float]:
        return device_memory()


class TrainingWorker:
    def __init__(self, engine: BaseEngine) -> None:
        self.engine = engine
        self.updates = 0  # optimizer updates made so far (tests count them)

    def train_batch(self, batch: Any, loss_fn: LossFn, num_updates: int, epochs: int = 1) -> list[dict[str, float]]:
        """`epochs` passes over `num_updates` mini-batches; one metrics dict per update."""
        n = len(batch)
        if num_updates < 1 or n % num_updates:
            raise ValueError(f"{n} samples on this rank cannot form {num_updates} equal mini-batches")
        size = n // num_updates
        metrics = []
        for _ in range(epochs):
            for k in range(num_updates):
                mini = batch.select(list(range(k * size, (k + 1) * size)))
                step = self.engine.forward_backward(mini, loss_fn)
                step.update(self.engine.optimizer_step())
                self.updates += 1
                metrics.append(step)
        return metrics

    def infer_batch(self, batch: Any, entropy: bool = False, routing: bool = False) -> dict[str, Tensor]:
        return self.engine.infer(batch, entropy=entropy, **({"routing": True} if routing else {}))

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Free the accelerator for another phase (rollout in hybrid mode); nothing to free on a CPU-only host."""
        if torch.cuda.is_available():
            self.engine.to("cpu", params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> None:
        if torch.cuda.is_available():
            self.engine.to("cuda")

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)


def scheduled_updates(config: Any, ppo_mini_batch_size: int, epochs: int = 1) -> int:
    """Optimizer updates of a whole run for a role (`config`: MrlConfig) with this mini-batch size, making `epochs`
    passes over each step's samples: the LR schedule's decay length, so a decaying LR reaches its minimum at the
    run's last update (not after 1/epochs of the run)."""
    per_step = max(config.data.train_batch_size // ppo_mini_batch_size, 1)
    return config.trainer.total_training_steps * per_step * epochs


def loss_scale_factor(config: Any) -> float:
    """C of seq-mean-token-sum-norm in the actor's and the critic's losses (`config`: MrlConfig):
    `actor.loss_scale_factor`, else the longest response (verl's default). Never a batch's own width: ours is the
    padded micro-batch's, prompt included, and differs from one micro-batch to the next."""
    scale = config.actor.loss_scale_factor
    return float(scale) if scale is not None else float(config.data.max_response_length)


def jagged_from_flat(values: Tensor, like: JaggedTensor) -> JaggedTensor:
    """Per-token engine outputs (flat, in the batch's order) as a jagged field aligned with `like`."""
    return JaggedTensor(values, like.offsets.clone())
