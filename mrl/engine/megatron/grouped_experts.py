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

`InRankTokenDispatcher` serves the grouped experts where one rank holds every expert (EP = TP = 1, dropless). The
stock all-to-all dispatcher then still (a) copies the per-expert token counts to the host and waits for them in every
layer (the GPU drains while the host launches the rest of the layer), (b) sorts the tokens by local expert, an
identity permutation with one rank, and (c) returns the tokens with `scatter_add_`/`index_add_` in bf16, atomics
that race and round in bf16 (its backward of the first permutation too). Here the counts stay on the device (the
grouped GEMM takes device offsets), the identity sort is skipped, and both directions of the permutation are gathers
whose reduction over a token's top-k rows is a sum, neither atomic nor rounded per added row.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
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


class _ToExperts(torch.autograd.Function):
    """`tokens[order]`: each token once per chosen expert, expert-major. Backward: each token's k gradient rows summed
    (gathered by `by_token`), where `index_select`'s own backward would `index_add_` them."""

    @staticmethod
    def forward(ctx: Any, tokens: Tensor, order: Tensor, by_token: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(by_token)
        ctx.k = k
        return tokens.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (by_token,) = ctx.saved_tensors
        return _sum_per_token(grad, by_token, ctx.k), None, None, None


class _ToTokens(torch.autograd.Function):
    """The inverse of `_ToExperts`: each token's k expert rows summed. Backward: `grad[order]`."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, order: Tensor, by_token: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        return _sum_per_token(rows, by_token, k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None, None


def _sum_per_token(rows: Tensor, by_token: Tensor, k: int) -> Tensor:
    return rows.index_select(0, by_token).view(-1, k, rows.shape[-1]).sum(1)


class InRankTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """The all-to-all dispatcher with every expert on this rank (see the module docstring). `build_model` swaps the
    class of a built dispatcher that `applies`; the shared-expert hooks and the EP/TP all-to-alls (no-ops with one
    rank) stay the base class's."""

    @staticmethod
    def applies(dispatcher: Any) -> bool:
        c = dispatcher.config
        return (type(dispatcher) is MoEAlltoAllTokenDispatcher and dispatcher.ep_size == 1 and dispatcher.tp_size == 1
                and c.moe_expert_capacity_factor is None and not c.moe_pad_expert_input_to_capacity
                and not c.moe_router_padding_for_quantization and not c.moe_permute_fusion)

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = routing_map.sum(dim=0)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        # Every token picks exactly top-k experts (dropless): the first N·k of the expert-major flattened map.
        n, k = routing_map.shape[0], self.config.moe_router_topk
        flat = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[: n * k]
        self._order = flat % n
        self._by_token = self._order.argsort(stable=True)
        permuted_probs = probs.T.reshape(-1)[flat]
        return _ToExperts.apply(tokens, self._order, self._by_token, k), permuted_probs

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Tensor | None = None) -> Tensor | None:
        return tokens_per_expert  # the counts stay on the device: no copy to the host, no wait

    def dispatch_postprocess(self, global_input_tokens: Tensor, global_probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states  # one rank: no sort to undo, no TP reduce-scatter

    def combine_postprocess(self, permutated_local_input_tokens: Tensor) -> Tensor:
        rows = permutated_local_input_tokens
        output = _ToTokens.apply(rows, self._order, self._by_token, self.config.moe_router_topk)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
