"""A pool teacher (mrl/reward/teacher_replicas.py) sends each distinct sample once: a group's identical responses and
the step's no-op padding rows (copies) are scored by one request, and every row still gets its own sequence's
log-probs, in order. The replica stand-in answers like an adapter asked for prompt log-probs (TokenOutput.extra)."""

from __future__ import annotations

import asyncio

import pytest

from mrl.reward.teacher_replicas import ReplicaTeacher
from rollout_adapters.base import TokenOutput


class CountingReplica:
    """The manager's client protocol: generate + end_session; a token's 'log-prob' is −token/10 after the first."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.ended: list[str] = []

    def client(self) -> CountingReplica:
        return self

    async def generate(self, request_id: str, ids: list[int], sampling: dict) -> TokenOutput:
        assert sampling["prompt_logprobs"] and sampling["max_tokens"] == 1
        self.prompts.append(list(ids))
        await asyncio.sleep(0.001 * (len(self.prompts) % 3))  # answers come back out of order
        return TokenOutput([0], None, "length", 0, {"prompt_log_probs": [0.0] + [-t / 10 for t in ids[1:]]})

    async def end_session(self, request_id: str) -> None:
        self.ended.append(request_id)


def test_identical_rows_are_scored_once_and_every_row_gets_its_own():
    replica = CountingReplica()
    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 2, 4], [1, 2, 3]]
    scored = ReplicaTeacher(replica).log_probs(rows)
    assert sorted(map(tuple, replica.prompts)) == [(1, 2, 3), (1, 2, 4), (5, 6)]
    assert len(replica.ended) == 3
    assert scored == [[0.0, pytest.approx(-0.2), pytest.approx(-0.3)] if row[-1] == 3 else
                      [0.0, pytest.approx(-0.2), pytest.approx(-0.4)] if row[-1] == 4 else
                      [0.0, pytest.approx(-0.6)] for row in rows]
    scored[0][1] = 9.0  # rows are separate lists: writing one leaves its copies alone
    assert scored[2][1] == pytest.approx(-0.2)


def test_a_replica_without_room_for_the_sample_is_an_error_naming_the_context():
    class Full(CountingReplica):
        async def generate(self, request_id: str, ids: list[int], sampling: dict) -> TokenOutput:
            return TokenOutput([], None, "length", 0)

    with pytest.raises(RuntimeError, match="context must exceed the longest sample"):
        ReplicaTeacher(Full()).log_probs([[1, 2]])
