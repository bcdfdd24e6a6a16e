"""The critic (PPO value model): the policy's transformer under a value head of its own, HF's
`…ForTokenClassification` with one label (verl's critic; its Megatron critic likewise swaps the output layer for
a [hidden → 1] projection).

The chunk of the last stage has no vocabulary projection: its `output_layer` is replaced before the import and
DDP (no parameters, gradients or optimizer state for it) by the value head (`score.weight` [1, H] and, as HF
builds it unless `token_classification_bias` is false, `score.bias` [1]); keeping Megatron's name lets GPTModel's
checkpointing and output hook treat it as the output layer it is. The head is read from the model
folder where it has one (a trained critic or reward model saved as `…ForTokenClassification`); otherwise it is
initialised as HF initialises the score head: weight ~ N(0, initializer_range), bias 0, from a generator seeded
with the engine's seed, so every TP rank starts from the same head.

The value of token t is read at position t−1, like its log-prob (verl's `values[:, -R-1:-1]`), so per-token
outputs share the token-aligned layout of mrl/engine/base.py. The head is replicated on every TP rank: each rank
computes the same values from the full sequence (sequence-parallel shards are gathered with a backward that only
splits, since every rank already holds the full gradient), so neither the head's gradient nor the hidden states'
gradient needs a TP reduction, and the head counts once in the gradient norm (it is a TP duplicate).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mrl.config.schema import CriticConfig
from mrl.engine.megatron.engine import MegatronEngine
from mrl.engine.megatron.packing import PackedMicroBatch, shift_to_tokens


class ValueHead(torch.nn.Module):
    """HF's score head with one label: values = hidden · weightᵀ + bias."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


def value_processor(hidden_states: Tensor, output_layer: ValueHead, context: Any, **_: Any) -> Tensor:
    """GPTModel `output_processor` for the critic: per-position values [b, s] (fp32)."""
    from megatron.core.tensor_parallel import mappings

    if context["sequence_parallel"]:
        hidden_states = mappings.gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
    return output_layer(hidden_states).squeeze(-1).float().t()


class MegatronCritic(MegatronEngine):
    """`infer` returns {"values"}; the loss_fn of `forward_backward` receives outputs {"values"}. Built from the
    model folder's causal LM or token-classification checkpoint (the bridge's `value_model()` table)."""

    @classmethod
    def from_critic_config(
        cls, model_path: str, critic: CriticConfig, *, total_steps: int = 1, seed: int = 1234,
        bridge_backend: str = "mrl",
    ) -> MegatronCritic:
        """The trainer's critic: `critic.*` micro-batching (by sample count), layout and optimizer."""
        return cls(model_path, critic.megatron, critic.optim, micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
                   total_steps=total_steps, seed=seed, bridge_backend=bridge_backend)

    def _select_bridge(self, bridge: Any) -> Any:
        if not hasattr(bridge, "value_model"):
            raise NotImplementedError(f"{type(bridge).__name__} has no value model: the critic needs bridge "
                                      "backend 'mrl'")
        return bridge.value_model()

    def _prepare_chunks(self, chunks: list[torch.nn.Module]) -> None:
        hf = self.bridge.hf_config
        std = getattr(hf, "initializer_range", None) or 0.02
        generator = torch.Generator().manual_seed(self.seed)
        for chunk in chunks:
            if not chunk.post_process:
                continue
            head = ValueHead(self.tf_config.hidden_size, self.tf_config.params_dtype,
                             bias=getattr(hf, "token_classification_bias", True))
            with torch.no_grad():
                head.weight.copy_(torch.normal(0.0, std, head.weight.shape, generator=generator))
            # The vocabulary projection goes (a critic never computes logits); its device is the chunk's.
            chunk.output_layer = head.to(chunk.output_layer.weight.device)

    def _output_processor(self) -> Any:
        return value_processor

    def _processor_context(self, mb: PackedMicroBatch, model: Any) -> dict[str, Any]:
        return {"sequence_parallel": self.tf_config.sequence_parallel}

    def _token_outputs(self, mb: PackedMicroBatch, output: Any) -> dict[str, Tensor]:
        return {"values": mb.unpack(shift_to_tokens(output[0], mb.cu_seqlens))}

    def _output_keys(self, entropy: bool) -> list[str]:
        return ["values"]

    def export_weights(self, tp_slices: bool = False, row_blocks: bool = False):
        raise NotImplementedError("a critic's weights are not synced to rollout engines")


class MegatronRewardModel(MegatronCritic):
    """A discriminative reward model (`...ForSequenceClassification`, one label) as a frozen value engine: its
    `score.weight` is the value head's tensor, read from the folder (the bridge maps a classifier's architecture to
    its causal LM's). `infer` returns {"scores"}: per position, not per token; a sample's score is the one at its
    last position.

    The critic's token alignment puts the output of position t under token t+1, so the last real token's own output
    falls off its sample. A reward model's score is exactly that output (HF pools the last non-pad position), so this
    engine skips the shift rather than scoring one extra appended token: same forward, no extra column, and causal
    attention makes position t's output depend on tokens 0..t only, which is what HF's classifier computes."""

    def _token_outputs(self, mb: PackedMicroBatch, output: Any) -> dict[str, Tensor]:
        return {"scores": mb.unpack(output[0])}

    def _output_keys(self, entropy: bool) -> list[str]:
        return ["scores"]
