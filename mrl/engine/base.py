"""The training-engine contract the RL layers program against (DESIGN.md, "BaseEngine").

RL code (workers, trainer, algorithms) sees only this interface: it hands the engine jagged batches and a loss
function, and gets back metrics, per-token log-probs/entropy/values, HF-named weights and checkpoints. Everything
about meshes, pipeline schedules and sharded optimizers stays behind it.

Batch layout (`JaggedBatch`, mrl/engine/megatron/packing.py): per-token fields are flat [N] tensors aligned with
`input_ids` (prompt and response of each sample, no padding) and cut into samples by `offsets` [B+1]. Per-token
outputs use the same alignment: the log-prob at position t of a sample is log π(x_t | x_<t), computed from the
logits at position t−1; position 0 of every sample has no log-prob and is 0.

Loss contract: `loss_fn(outputs, micro_batch, normalizer)` returns `(loss, metrics)` where `loss` is this
micro-batch's share of the step loss under the step-global denominators of `normalizer`
(mrl/algo/aggregation.py); the engine makes the gradient equal to the gradient of Σ(shares) over micro-batches and
DP ranks whatever its schedule and data-parallel reduction do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from torch import Tensor

from mrl.algo.aggregation import LossNormalizer


class LossFn(Protocol):
    """Per-micro-batch loss: outputs and micro-batch fields are padded [n_samples, max_len] tensors (position t of
    row i is token t of sample i; the caller's masks mark valid positions)."""

    def __call__(
        self, outputs: Mapping[str, Tensor], micro_batch: Mapping[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, Mapping[str, Tensor]]: ...


class BaseEngine(ABC):
    """One model replica sharded over a device mesh, with its optimizer; see the module docstring for layouts."""

    @abstractmethod
    def initialize(self) -> None:
        """Join the process groups, build the (sharded) model, optimizer and LR schedule."""

    @abstractmethod
    def forward_backward(self, batch: Any, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of the step loss over `batch` (this DP rank's share of one optimizer update).

        Returns metrics: `loss` is the step loss summed over micro-batches and DP ranks (same on every rank), plus
        the means of the loss_fn's metrics over micro-batches.
        """

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, update, advance the LR schedule and zero the gradients; returns `grad_norm`, `lr`, `update_ok`.

        If any gradient of any rank is NaN/Inf, no rank updates (weights, optimizer state and LR schedule stay as
        they were), the gradients are still zeroed, and `update_ok` is False."""

    @abstractmethod
    def infer(self, batch: Any, *, entropy: bool = False) -> dict[str, Tensor]:
        """Per-token outputs in the batch's flat layout: `log_probs` (and `entropy`), or `values` for a critic. An MoE
        engine with router replay also takes `routing=True` (mrl/engine/megatron/engine.py says what it adds)."""

    @abstractmethod
    def to(self, device: str, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move the selected training state to `device` ("cpu" to free the accelerator, "cuda" to come back)."""

    @abstractmethod
    def export_weights(self, tp_slices: bool = False, row_blocks: bool = False) -> Iterator[tuple]:
        """Full (unsharded) weights under their HF names, one tensor at a time; `tp_slices`: the dense TP-split
        ones as (name, this rank's slice, TpSlice) where the engine can; `row_blocks`: fused QKV's q/k/v as
        uncopied row blocks tagged ROW_BLOCKS, for the one-copy sender (bridges/export.py)."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer and scheduler state (and this rank's RNG states) so that another layout can load
        it; valid before the first optimizer step too."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by `save_checkpoint`, possibly under another parallel layout; idempotent (the
        LR schedule is set to the saved step, never advanced from where this engine stood)."""

    @abstractmethod
    def mesh(self, name: str = "train") -> Any:
        """This rank's coordinates in the named device mesh (mrl.controller.mesh.DeviceMesh) for dispatch."""
