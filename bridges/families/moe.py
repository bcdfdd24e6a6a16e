"""Mixture-of-experts pieces shared by the MoE families: routed experts, router, shared experts."""

from __future__ import annotations

from bridges.mapping import GateUp, Mapping, Replicated, RowParallel


def routed_experts(hf_mlp: str = "model.layers.*.mlp.") -> list[Mapping]:
    """Router and per-expert SwiGLU weights; `*` after `experts.` is the global expert id on both sides.

    Megatron splits experts over EP (rank r owns a contiguous block) and each expert over expert-TP; the
    canonical names already carry global ids, so the table needs no EP arithmetic.
    """
    experts = "decoder.layers.*.mlp.experts.local_experts.*."
    return [
        Replicated("decoder.layers.*.mlp.router.weight", hf_mlp + "gate.weight"),
        GateUp(
            experts + "linear_fc1.weight", hf_mlp + "experts.*.gate_proj.weight", hf_mlp + "experts.*.up_proj.weight"
        ),
        RowParallel(experts + "linear_fc2.weight", hf_mlp + "experts.*.down_proj.weight"),
    ]


def shared_experts(hf_shared: str = "model.layers.*.mlp.shared_experts.") -> list[Mapping]:
    """Always-on experts: an ordinary TP-split SwiGLU MLP (split over TP, not expert-TP)."""
    m = "decoder.layers.*.mlp.shared_experts."
    return [
        GateUp(m + "linear_fc1.weight", hf_shared + "gate_proj.weight", hf_shared + "up_proj.weight"),
        RowParallel(m + "linear_fc2.weight", hf_shared + "down_proj.weight"),
    ]
