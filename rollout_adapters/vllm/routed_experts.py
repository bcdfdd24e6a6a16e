"""vLLM's routed experts (`enable_return_routed_experts`) in mrl's routing layout, for router replay R3.

What vLLM 0.25 (CUDA) returns, read from its source: `CompletionOutput.routed_experts`, a numpy array
[rows, num_hidden_layers, top-k] set on the request's final output only, uint8 (≤ 256 experts) or uint16. Its rows
are the prompt's tokens from `SamplingParams.routed_experts_prompt_start` (read from the scheduler's slot buffer
when the prefill completes, so prefix-cached tokens carry the routing of the pass that computed them), then one
row per token fed in each decode step: the prompt and every sampled token but the last. The layer axis is every
decoder layer by index (the capture is keyed by the layer number in the module name); a dense layer's row is zeros.
The ids are the router's logical experts, before EPLB's physical mapping.

mrl's layout (mrl/engine/megatron/routing.py): [tokens, MoE layers, top-k] int16 over the same tokens, -1
(NOT_ROUTED) where unknown. The vllm adapter asks for the whole prompt (start 0) in every turn, as the hf backend
returns it, so the agent loop's longest turn covers a multi-turn trajectory's earlier turns and observations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mrl.engine.megatron.routing import NOT_ROUTED, ROUTING_DTYPE

log = logging.getLogger(__name__)


def to_routing(routed: Any, prompt_len: int, num_output: int, moe_layers: Sequence[int], prompt_start: int = 0,
               request_id: str = "") -> torch.Tensor | None:
    """[prompt_len + num_output − 1, len(moe_layers), K] int16 from one sample's `routed_experts` (None: none
    returned, e.g. aborted before its prefill completed). The `prompt_start` tokens vLLM skipped are NOT_ROUTED;
    rows past the fed tokens are dropped and missing ones at the end NOT_ROUTED (the rows run in token order from
    prompt_start, so the start stays aligned), with a warning: vLLM returns exactly the fed tokens otherwise."""
    if routed is None:
        return None
    rows = np.asarray(routed)
    if rows.ndim != 3:
        raise ValueError(f"routed_experts of {request_id}: shape {rows.shape}, expected [tokens, layers, top-k]")
    if max(moe_layers) >= rows.shape[1]:
        raise ValueError(f"routed_experts of {request_id}: {rows.shape[1]} layers, but MoE layer {max(moe_layers)}")
    fed = prompt_len + max(num_output - 1, 0)
    want = fed - prompt_start
    if rows.shape[0] != want:
        log.warning("routed_experts of %s: %d rows for %d fed tokens from %d (prompt %d, output %d)", request_id,
                    rows.shape[0], want, prompt_start, prompt_len, num_output)
    routing = torch.from_numpy(rows[:want, list(moe_layers)].astype(np.int16))
    head = routing.new_full((prompt_start, *routing.shape[1:]), NOT_ROUTED)
    tail = routing.new_full((want - routing.shape[0], *routing.shape[1:]), NOT_ROUTED)
    return torch.cat([head, routing, tail]).to(ROUTING_DTYPE)


def routing_extra(out: Any, prompt_len: int, moe_layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """TokenOutput.extra of a finished RequestOutput of a `prompt_len`-token prompt (one sample, asked with
    routed_experts_prompt_start 0)."""
    sample = out.outputs[0]
    if sample.routed_experts is None and len(sample.token_ids):
        # Every sampled token follows a completed prefill, whose routing vLLM returns: the capture is off.
        raise RuntimeError(f"request {out.request_id}: vLLM returned {len(sample.token_ids)} tokens but no routed "
                           "experts (was the engine started with enable_return_routed_experts?)")
    routing = to_routing(sample.routed_experts, prompt_len, len(sample.token_ids), moe_layers,
                         request_id=out.request_id)
    return {"routed_experts": routing} if routing is not None else {}
