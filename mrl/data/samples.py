"""A trajectory in two halves: its per-token payload stays in the sample store, its light record travels.

- Payload (the store's value under the trajectory's key, put by the agent loop): per-token tensors aligned with
  `input_ids` = prompt + response, prompt positions with `response_mask` 0 and log-prob 0.0 (DESIGN.md, Batch).
  Workers add their per-token outputs to it (`old_log_probs`, `ref_log_prob`, `values`, `advantages`, `returns`).
- Record (agent loop → replay buffer → driver): the key and scalar tags (uid, score, lengths, versions, …).

The driver's step moves a `Batch` of the records' scalar columns (`light_batch`); the mesh dispatch splits it like
any batch, and each worker fetches its rows' tensors by key (`fetch`) and writes its outputs back (`write_back`).
A no-op sample (mrl/data/replay_buffer.py) owns a store key holding a copy of a real sample's payload
(`put_noop_payloads`), with `is_noop` set: `fetch` zeroes its response mask (it trains nothing), and the workers'
outputs for it go under its own key like any row's, so no row ever reads another row's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor
from mrl.data.sample_store import SampleStore

# What an agent loop puts; workers add their outputs to the same value.
NOT_ROUTED = -1  # a token no engine routed, in the [tokens, MoE layers, top-k] layout (mrl/engine/megatron/routing.py)
TRAJECTORY_FIELDS = ("input_ids", "response_mask", "rollout_log_probs")


def payload(prompt_ids: Sequence[int], response_ids: Sequence[int], response_mask: Sequence[int],
            rollout_log_probs: Sequence[float]) -> dict[str, torch.Tensor]:
    """The per-token fields of one trajectory in the full-sequence layout."""
    p = len(prompt_ids)
    return {
        "input_ids": torch.tensor([*prompt_ids, *response_ids], dtype=torch.long),
        "response_mask": torch.tensor([0] * p + list(response_mask), dtype=torch.float32),
        "rollout_log_probs": torch.tensor([0.0] * p + list(rollout_log_probs), dtype=torch.float32),
    }


def routed_experts(turn_extras: Sequence[dict[str, Any]], length: int) -> torch.Tensor | None:
    """The engine's routing of a trajectory of `length` tokens, [length, L, K], from its turns' `routed_experts`
    (each turn's covers its prompt, i.e. every earlier token, observations included, and its own tokens but the
    last): the longest one, the rest NOT_ROUTED (-1). None when no turn returned routing."""
    found = [e["routed_experts"] for e in turn_extras if e.get("routed_experts") is not None]
    if not found:
        return None
    longest = max(found, key=len)[:length]
    pad = longest.new_full((length - len(longest), *longest.shape[1:]), NOT_ROUTED)
    return torch.cat([torch.as_tensor(longest), pad])


def fill_unrouted(routing: Sequence[torch.Tensor | None], payloads: Sequence[dict[str, torch.Tensor]]
                  ) -> list[torch.Tensor]:
    """`routing` with every None (a trajectory no turn of which returned routing) all NOT_ROUTED, so the column
    covers every row."""
    like = next(r for r in routing if r is not None)
    return [r if r is not None else like.new_full((len(p["input_ids"]), *like.shape[1:]), -1)
            for r, p in zip(routing, payloads)]


def light_batch(records: Sequence[dict[str, Any]]) -> Batch:
    """The scalar columns of a step's records: what the driver balances, computes advantages on and dispatches."""
    return Batch.from_dict({
        "key": [r["key"] for r in records],
        "uid": [r["uid"] for r in records],
        "score": torch.tensor([float(r["score"]) for r in records]),
        "length": torch.tensor([r["prompt_len"] + r["response_len"] for r in records], dtype=torch.long),
        "is_noop": torch.tensor([bool(r.get("is_noop", False)) for r in records]),
        # the oldest weight version of the sample's tokens (-1: none); the rollout correction's metrics group by it
        "min_version": torch.tensor([int(r.get("min_version", -1)) for r in records], dtype=torch.long),
    })


def fetch(store: SampleStore, batch: Batch, fields: Sequence[str]) -> Batch:
    """`batch` (scalar columns with a `key` column) plus the per-token `fields` of its rows, fetched by key."""
    columns = store.get_jagged(list(batch["key"]), fields)
    if "response_mask" in columns and "is_noop" in batch and bool(batch["is_noop"].any()):
        mask = columns["response_mask"]
        keep = torch.repeat_interleave((~batch["is_noop"]).to(mask.values.dtype), mask.lengths())
        columns["response_mask"] = JaggedTensor(mask.values * keep, mask.offsets)
    return batch.union(Batch.from_dict(columns, batch_size=len(batch)))


def write_back(store: SampleStore, batch: Batch, outputs: dict[str, JaggedTensor]) -> None:
    """Add per-token `outputs` (aligned with `batch`'s rows) to each row's value in the store (no-op rows own their
    keys: theirs too)."""
    store.update_jagged(list(batch["key"]), outputs)


def put_noop_payloads(store: SampleStore, records: Sequence[dict[str, Any]]) -> None:
    """Give each no-op record (mrl/data/replay_buffer.py `noop_like`) its payload: its source's, copied inside the
    store under the no-op's own key."""
    copies = {r["key"]: r["noop_of"] for r in records if r.get("is_noop")}
    if copies:
        store.copy(copies)


def put_sequences(store: SampleStore, keys: Sequence[str], sequences: Sequence[dict[str, Any]]) -> Batch:
    """Put ready-made sequences (`prompt_ids`, `response_ids`, optional `response_mask` / `rollout_log_probs`)
    under `keys` and return their light batch: for probes and tests that call a worker outside a step."""
    items = {}
    for key, s in zip(keys, sequences):
        n = len(s["response_ids"])
        items[key] = payload(s["prompt_ids"], s["response_ids"], s.get("response_mask", [1] * n),
                             s.get("rollout_log_probs", [0.0] * n))
    store.put(items)
    return light_batch([{"key": k, "uid": k, "score": 0.0, "prompt_len": len(s["prompt_ids"]),
                         "response_len": len(s["response_ids"])} for k, s in zip(keys, sequences)])
