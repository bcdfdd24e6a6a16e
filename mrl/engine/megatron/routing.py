"""MoE routing in the trainer: replay the engine's top-k experts (R3, R2) and read back the trainer's own.

Layout of a routing field (`routed_experts`, a per-token field like `input_ids`): [N, L, K] small integers, row t
= the experts that MoE layer l (l-th MoE layer of the model, in layer order) sent token t to when t was the input.
`NOT_ROUTED` (-1) marks a token whose routing is unknown (the last sampled token, which the engine never fed back;
observation tokens no later turn prefilled): the trainer routes those itself.

On the Megatron side each router's `RouterReplay` (megatron-core, enabled by `moe_enable_routing_replay`) is
turned into `TracingReplay`, which also keeps what the router chose by itself and what it used, so one forward
gives both the replayed routing and the trainer's own top-k (for the agreement metric and for R2's record).
The router sees this rank's tokens of the packed THD row in row order: all of them, or its sequence-parallel
slice; `local_rows` cuts that view out of a packed [T, L, K] routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mrl.data.samples import NOT_ROUTED  # the routing layout's filler, declared with the samples

ROUTING_DTYPE = torch.int16  # 32k experts at most: compact in the sample store and over Ray


def moe_layer_numbers(num_layers: int, moe_layer_freq: int | Sequence[int]) -> list[int]:
    """Global 1-based numbers of the MoE layers (Megatron's `layer_number`), from `moe_layer_freq`."""
    if isinstance(moe_layer_freq, int):
        pattern = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def _make_tracing_class() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class TracingReplay(RouterReplay):
        """RouterReplay that fills NOT_ROUTED rows of the replay target with the router's own choice and keeps
        `own_idx` (the router's top-k) and `used_idx` (what the forward routed by) of the last forward."""

        own_idx: Tensor | None = None
        used_idx: Tensor | None = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.own_idx = own.detach()
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or self.target_topk_idx is None:
                self.used_idx = self.own_idx
                return probs, own
            target = self.target_topk_idx.to(scores.device).long()
            if target.shape != own.shape:
                raise ValueError(f"layer {self.layer_number}: replay target {tuple(target.shape)} for router "
                                 f"top-k {tuple(own.shape)} (routing not aligned with the packed row)")
            target = torch.where(target < 0, own, target)
            self.used_idx = target
            return scores.gather(1, target), target

    return TracingReplay


_TRACING: type | None = None


def install(chunks: Sequence[torch.nn.Module], moe_layers: Sequence[int]) -> list[list[tuple[int, Any]]]:
    """Turn every router's RouterReplay into TracingReplay; per model chunk, (MoE index, replay) in layer order."""
    global _TRACING
    from megatron.core.transformer.moe.router import TopKRouter

    if _TRACING is None:
        _TRACING = _make_tracing_class()
    index = {n: i for i, n in enumerate(moe_layers)}
    out = []
    for chunk in chunks:
        found = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise RuntimeError("router replay needs moe_enable_routing_replay=True in the TransformerConfig")
                module.router_replay.__class__ = _TRACING
                found.append((index[module.layer_number], module.router_replay))
        out.append(sorted(found, key=lambda p: p[0]))
    return out


def packed_routing(fields: dict[str, Tensor], token_mask: Tensor, row_length: int, key: str = "routed_experts"
                   ) -> Tensor:
    """[T, L, K] routing of a packed row from the micro-batch's padded [n, max_len, L, K] field; the trailing pad
    segment is NOT_ROUTED (the router picks its own)."""
    padded = fields[key]
    real = padded[token_mask]
    pad = real.new_full((row_length - real.shape[0], *real.shape[1:]), NOT_ROUTED)
    return torch.cat([real, pad])


def local_rows(packed: Tensor, sequence_parallel: bool, tp_rank: int, tp: int) -> Tensor:
    """The rows this rank's routers see: the row's sequence-parallel slice, or all of it."""
    if not sequence_parallel or tp == 1:
        return packed
    per_rank = packed.shape[0] // tp
    return packed[tp_rank * per_rank : (tp_rank + 1) * per_rank]


def set_targets(replays: Sequence[tuple[int, Any]], routing: Tensor | None) -> None:
    """Replay `routing` [T_local, L, K] on one chunk's routers, or let them route (None)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for moe_index, replay in replays:
        replay.clear_indices()
        if routing is None:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            replay.set_target_indices(routing[:, moe_index])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def read_back(replays: Sequence[tuple[int, Any]]) -> dict[str, dict[int, Tensor]]:
    """This chunk's last forward: {'own': {moe index: [T_local, K]}, 'used': …} as compact host tensors."""
    out: dict[str, dict[int, Tensor]] = {"own": {}, "used": {}}
    for moe_index, replay in replays:
        out["own"][moe_index] = replay.own_idx.to("cpu", ROUTING_DTYPE)
        out["used"][moe_index] = replay.used_idx.to("cpu", ROUTING_DTYPE)
        replay.clear_indices()
    return out


def same_experts(a: Tensor, b: Tensor) -> Tensor:
    """[..., K] → [...] bool: the two rows name the same set of experts (order within top-k is free)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def routing_metrics(own: Tensor, reference: Tensor, num_experts: int, prefix: str = "actor/",
                    used: Tensor | None = None) -> dict[str, float]:
    """Agreement of the trainer's own top-k `own` [N, L, K] with `reference` (the engine's) over the routed
    (not NOT_ROUTED) tokens, overall and per MoE layer, and per-layer expert load: max / mean tokens per expert
    (1.0 is perfectly balanced). With `used` (what the forward routed by), `routing_replayed`: the share of those
    tokens it routed exactly as the engine did (1.0 when the replay reached every router aligned)."""
    known = (reference >= 0).all(dim=-1)  # [N, L]
    agree = same_experts(own, reference) & known
    metrics: dict[str, float] = {}
    if bool(known.any()):
        metrics[f"{prefix}routing_agreement"] = float(agree.sum() / known.sum())
        if used is not None:
            metrics[f"{prefix}routing_replayed"] = float((same_experts(used, reference) & known).sum() / known.sum())
    for layer in range(own.shape[1]):
        if bool(known[:, layer].any()):
            metrics[f"{prefix}routing_agreement/layer_{layer}"] = float(agree[:, layer].sum() / known[:, layer].sum())
        load = torch.bincount(own[:, layer].flatten().long().clamp_min(0), minlength=num_experts).float()
        if load.sum() > 0:
            metrics[f"{prefix}expert_load_max_over_mean/layer_{layer}"] = float(load.max() / load.mean())
    return metrics
