"""A pool teacher (mrl/reward/teacher_replicas.py) and a greedy generative judge (mrl/reward/judge.py) send each
distinct request once: a group's identical responses and the step's no-op padding rows (copies) cost one request,
and every row still gets its own sequence's result, in order. A sampling judge asks again for every row. The replica
stand-in answers like an adapter (prompt log-probs in TokenOutput.extra; the judge's answer as token ids)."""

from __future__ import annotations

import asyncio

import pytest

from mrl.config.reward_schema import RewardModelConfig
from mrl.models.tiny import make_tiny_hf_model
from mrl.reward.judge import GenerativeJudge, JudgeInput
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


class EchoJudgeReplica(CountingReplica):
    """Answers each prompt with its own length as text, tokenized by the judge's tokenizer."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    async def generate(self, request_id: str, ids: list[int], sampling: dict) -> TokenOutput:
        self.prompts.append(list(ids))
        return TokenOutput(self.tokenizer.encode(f"score {len(ids)}", add_special_tokens=False), None, "stop", 0)


@pytest.mark.parametrize(("temperature", "requests"), [(0.0, 2), (0.7, 4)])
def test_a_greedy_judge_answers_each_distinct_prompt_once(tmp_path, temperature, requests):
    path = make_tiny_hf_model("qwen2", tmp_path / "judge")
    judge = GenerativeJudge(RewardModelConfig(name="j", kind="generative", path=str(path), temperature=temperature,
                                              template="Q {prompt} A {response}", parser=r"score (\d+)"), None)
    replica = EchoJudgeReplica(judge.tokenizer)
    judge.manager = replica
    items = [JudgeInput("12", "3"), JudgeInput("12", "345"), JudgeInput("12", "3"), JudgeInput("12", "3")]
    answers = asyncio.run(judge.answers(items))
    assert len(replica.prompts) == requests
    lengths = [len(judge.prompt_ids(x)) for x in items]
    assert answers == [f"score {n}" for n in lengths] and lengths[0] != lengths[1]
    assert judge.scores(answers) == [float(n) for n in lengths]
