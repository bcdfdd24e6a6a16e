"""Critic (PPO value model): the actor's transformer with a scalar value head instead of the vocabulary output.

The value of token t is read at position t−1, like its log-prob (verl's `values[:, -R-1:-1]`), so per-token
outputs share the token-aligned layout of mrl/engine/base.py. The head is one [1, H] weight replicated on every
TP rank: each rank computes the same values from the full sequence (sequence-parallel shards are gathered with
a backward that only splits, since every rank already holds the full gradient), so neither the head's gradient
nor the hidden states' gradient needs a TP reduction. Initialised from the actor's HF weights; the output layer
stays frozen and unused, the head starts from Megatron's init method (seeded like every other weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mrl.engine.megatron.engine import MegatronEngine
from mrl.engine.megatron.packing import PackedMicroBatch, shift_to_tokens


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, init_method: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        init_method(self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


def value_processor(hidden_states: Tensor, context: Any, **_: Any) -> Tensor:
    """GPTModel `output_processor` for the critic: per-position values [b, s] (fp32)."""
    from megatron.core.tensor_parallel import mappings

    if context["sequence_parallel"]:
        hidden_states = mappings.gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
    return context["head"](hidden_states).squeeze(-1).float().t()


class MegatronCritic(MegatronEngine):
    """`infer` returns {"values"}; the loss_fn of `forward_backward` receives outputs {"values"}."""

    def _prepare_chunks(self, chunks: list[torch.nn.Module]) -> None:
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer.weight.requires_grad_(False)
                chunk.value_head = ValueHead(
                    self.tf_config.hidden_size, self.tf_config.params_dtype, self.tf_config.init_method
                ).to(chunk.output_layer.weight.device)

    def _output_processor(self) -> Any:
        return value_processor

    def _processor_context(self, mb: PackedMicroBatch, model: Any) -> dict[str, Any]:
        unwrapped = model.module if hasattr(model, "module") else model
        return {"head": getattr(unwrapped, "value_head", None), "sequence_parallel": self.tf_config.sequence_parallel}

    def _token_outputs(self, mb: PackedMicroBatch, output: Any) -> dict[str, Tensor]:
        return {"values": mb.unpack(shift_to_tokens(output[0], mb.cu_seqlens))}

    def _output_keys(self, entropy: bool) -> list[str]:
        return ["values"]

    def export_weights(self, tp_slices: bool = False, row_blocks: bool = False):
        raise NotImplementedError("a critic's weights are not synced to rollout engines")
