"""MoE experts through one grouped GEMM per projection, without TransformerEngine.

Megatron's local spec runs experts as `SequentialMLP`: a Python loop of one small GEMM per local expert, and a host
synchronisation to split the tokens. With dozens of local experts that loop, not the arithmetic, sets the speed.
megatron-core 0.19 has a grouped expert module only through TE (`TEGroupedMLP`).

`GroupedGemmExperts` keeps `SequentialMLP`'s parameters exactly (`local_experts.<i>.linear_fc1/fc2.weight`, so the
bridges, checkpoints, the export and the weight sync see the same tensors) and replaces only its forward: the local
experts' weights are stacked per call (a copy of the layer's expert weights, small next to the GEMMs; autograd hands
each expert its slice of the gradient) and `torch.nn.functional.grouped_mm` multiplies each expert's token rows with
its weight, with the activation and the router probabilities applied as the expert `MLP` applies them.

Used for bfloat16 weights (what grouped_mm's CUDA kernel takes, and its CPU fallback in torch 2.13 differentiates;
its float32 backward fails there) on Hopper or newer, with expert widths that are multiples of 8; any other dtype
or device, expert biases, FP8/FP4 or probabilities applied on the input take `SequentialMLP`'s loop.
Expert tensor parallelism needs no extra communication here: with TP or EP above 1 Megatron builds expert linears
with `explicit_expert_comm` (the token dispatcher gathers and scatters), and with both at 1 there is no group.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor


def _glu(config: Any, x: Tensor) -> Tensor:
    """The expert MLP's gated activation (megatron.core.transformer.mlp.MLP.forward, unfused path)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    if (val := config.activation_func_clamp_value) is not None:
        x_glu = x_glu.clamp(min=None, max=val)
        x_linear = x_linear.clamp(min=-val, max=val)
    return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


class GroupedGemmExperts(SequentialMLP):
    """`SequentialMLP` whose forward is two grouped GEMMs (see the module docstring)."""

    def _grouped(self, hidden: Tensor) -> bool:
        c = self.config
        fc1, fc2 = self.local_experts[0].linear_fc1, self.local_experts[0].linear_fc2
        # grouped_mm's CUDA kernel: Hopper or newer, rows of 16-byte multiples (8 bf16 values)
        kernel = not hidden.is_cuda or torch.cuda.get_device_capability(hidden.device) >= (9, 0)
        aligned = all(n % 8 == 0 for n in (*fc1.weight.shape, *fc2.weight.shape))
        return (hidden.dtype == torch.bfloat16 and self.num_local_experts > 1 and kernel and aligned
                and hasattr(torch.nn.functional, "grouped_mm") and not (c.fp8 or c.fp4)
                and not c.moe_apply_probs_on_input and not c.use_te_activation_func
                and fc1.bias is None and fc2.bias is None)

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor,
                permuted_probs: Tensor) -> tuple[Tensor, None]:
        if not self._grouped(permuted_local_hidden_states):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offsets = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int32), 0, dtype=torch.int32)
        # [E, in, out] as column-major views of the [out, in] weights: the layout grouped_mm's kernels read.
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        h = torch.nn.functional.grouped_mm(x, fc1, offs=offsets)
        scale = permuted_probs.unsqueeze(-1)
        c = self.config
        if c.bias_activation_fusion and c.gated_linear_unit and c.activation_func is torch.nn.functional.silu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            h = weighted_bias_swiglu_impl(h, None, scale, c.activation_func_fp8_input_store)
        else:
            h = _glu(c, h) if c.gated_linear_unit else c.activation_func(h)
            h = (h * scale).to(x.dtype)
        return torch.nn.functional.grouped_mm(h, fc2, offs=offsets), None
