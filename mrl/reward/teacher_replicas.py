"""A distillation teacher on rollout replicas of its own (`algorithm.distill.placement: pool`): a teacher too large to
sit beside the actor, or one served on its own devices, scores the student's samples through its engine's prompt
log-probs. Each sample (prompt + response ids) goes out as one prompt asking for one new token; the replica returns
every prompt token's log-prob given the tokens before it, which is the teacher's log-prob of each sampled token.

Those log-probs are untempered (vLLM applies no sampling processor to prompt tokens; SGLang scales them by the
request's temperature, 1 for this greedy request), so start-up requires
rollout.temperature 1, where the student's π_old is untempered too (mrl/config/startup/reward_rules.py). Every
request of a step goes out at once and the engines batch them; mrl/trainer/build.py starts the replicas.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from mrl.reward.distinct import once_per_distinct

# One new token (the engine must decode something); the prompt's log-probs are what is read.
_SAMPLING = {"max_tokens": 1, "temperature": 0.0, "logprobs": False, "prompt_logprobs": True}


class ReplicaTeacher:
    """`log_probs(sequences)`: per sequence, the teacher's log-prob of each token given the ones before it (0.0 for
    the first token), from `replicas` (an LLMServerManager serving the teacher)."""

    def __init__(self, replicas: Any) -> None:
        self.manager = replicas

    async def _one(self, client: Any, request_id: str, ids: list[int]) -> list[float]:
        out = await client.generate(request_id, ids, _SAMPLING)
        await client.end_session(request_id)
        if "prompt_log_probs" not in out.extra:  # the replica had no room for the sample plus one token
            raise RuntimeError(f"distillation teacher: no prompt log-probs for a {len(ids)}-token sample; its "
                               "replica's context must exceed the longest sample")
        return out.extra["prompt_log_probs"]

    async def _all(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        client, batch = self.manager.client(), uuid.uuid4().hex[:8]
        return list(await asyncio.gather(*(self._one(client, f"teacher-{batch}-{i}", list(ids))
                                           for i, ids in enumerate(sequences))))

    def log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        keys = [tuple(int(t) for t in ids) for ids in sequences]
        return [list(row) for row in asyncio.run(once_per_distinct(keys, self._all))]

    def wait_started(self) -> None:
        self.manager.wait_started()

    def close(self) -> None:
        self.manager.shutdown()
