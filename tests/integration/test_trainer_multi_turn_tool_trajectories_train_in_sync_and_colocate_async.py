"""Multi-turn tool trajectories through the trainer: a custom tool loop (loaded by module path) on a hybrid `hf`
replica calls the real sandboxed Python tool (in the agent-loop Ray actors) after every turn but the last.

Proves, in `sync`: every trajectory has its turns and tool calls, the sandbox answered each call inside the
Ray worker, the store's payload masks exactly the observation tokens (response_mask 0, rollout log-prob 0.0)
and the step trains; the tool metrics are logged. In `colocate_async`: trajectories whose long last turn was
aborted for a weight sync continue on the new weights (min_version < max_version) with nothing lost, and train.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from trainer_fixtures import KeepsStepTensors, stepped, tiny_trainer

from mrl.data.datasets import PromptBatches
from mrl.rollout.agent_loop import ToolAgentLoop, ToolCall
from mrl.trainer.modes import ColocateAsyncTrainer
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

# LONG: the budget the long last turns run to (LONG_ASYNC in the colocate_async run).
B, N, STEPS, VOCAB, LONG, LONG_ASYNC, TURNS = 2, 2, 2, 512, 192, 1024, 3
SHORT_DELAY_S = 1.0
# The prompts of the first batch the dataloader draws (data.seed=1) are the short ones; every other prompt's
# last turn runs to the budget. So the colocate_async producer's first four groups are two short ones, which fill
# step 1, and two long ones still generating at its abort; the groups admitted after the sync are long too, so the
# aborted ones (with a head start) fill step 2. With a parity rule the first four held one short group and step 1
# waited for a long one, whose lockstep peers sometimes finished before the abort (seen on CI).
SHORT = {row["index"] for row in next(PromptBatches([{"index": i} for i in range(8)], B, seed=1))}


class CallPythonEveryTurn:
    """Tool-call parser: every model turn asks the Python tool to double the turn's length in characters."""

    def parse(self, text):
        return [ToolCall("python", {"code": f"print({len(text)} * 2)"})]


class ShortTurnsThenLong(ToolAgentLoop):
    """One-token turns (every id stops); prompts outside SHORT make their last turn run to the budget. A SHORT
    prompt's last tool answer comes SHORT_DELAY_S late: otherwise the short groups could complete step 1 while the
    long ones were still in their second tool call, and the abort found nothing in the engine (seen on CI)."""

    def turn_sampling(self, sample, sampling, traj):
        last = traj.num_turns == self.toolbox.max_turns - 1
        if sample["extra_info"]["index"] in SHORT:
            self.short = {*getattr(self, "short", ()), id(traj)}
        elif last:
            return {**sampling, "ignore_eos": True}
        return {**sampling, "stop_token_ids": list(range(VOCAB))}

    async def _answer(self, session_id, call, traj):
        if id(traj) in getattr(self, "short", ()) and traj.tool_calls == TURNS - 2:  # the call before the last turn
            await asyncio.sleep(SHORT_DELAY_S)
        return await super()._answer(session_id, call, traj)


OVERRIDES = [
    f"data.train_batch_size={B}", "actor.ppo_mini_batch_size=1", f"rollout.n={N}", "rollout.name=hf",
    f"trainer.total_training_steps={STEPS}", "data.max_prompt_length=128", "data.seed=1",
    f"rollout.agent_loop={__name__}:ShortTurnsThenLong", f"rollout.max_turns={TURNS}",
    "rollout.tools=[mrl.rollout.agent_loop.python_tool:PythonTool]",
    f"rollout.tool_parser={__name__}:CallPythonEveryTurn",
]


class SyncRecorder(KeepsStepTensors, PPOTrainer):
    def sample(self):
        self.taken = [*getattr(self, "taken", []), super().sample()]
        return self.taken[-1]


class AsyncRecorder(ColocateAsyncTrainer):
    def sample(self):
        self.taken = [*getattr(self, "taken", []), super().sample()]
        return self.taken[-1]


@pytest.fixture(scope="module")
def sync_run(ray_cluster, tmp_path_factory):
    trainer = tiny_trainer(SyncRecorder, "tiny/grpo", tmp_path_factory.mktemp("tool_sync"),
                           [*OVERRIDES, f"data.max_response_length={LONG}"], list("abc"),
                           vocab_size=VOCAB)
    with stepped(trainer, STEPS) as result:
        pass
    return result  # shut down already: the tests read what the trainer recorded


def test_sync_trajectories_have_their_turns_tool_answers_and_masked_observations(sync_run):
    trainer, metrics, _ = sync_run
    records = [t for step in trainer.taken for t in step]
    shape = [(t["num_turns"], t["tool_calls"], t["tool_errors"]) for t in records]
    assert set(shape) == {(TURNS, TURNS - 1, 0)}, shape
    lengths = {t["response_len"] for t in records}
    assert LONG in lengths and min(lengths) < LONG  # the long prompts' last turns ran to the budget
    tokenizer = trainer.parts.tokenizer
    for payloads in trainer.step_payloads:
        for value in payloads.values():
            mask = value["response_mask"].tolist()
            ids = value["input_ids"].tolist()
            first = mask.index(1)  # prompt positions are 0 too: the response starts at the first model token
            response, rmask = ids[first:], mask[first:]
            # model token, observation, model token, observation, then the last turn
            runs = [rmask[0]] + [b for a, b in itertools.pairwise(rmask) if a != b]
            assert runs == [1, 0, 1, 0, 1]
            obs = [i for i, m in zip(response, rmask) if m == 0]
            text = tokenizer.decode(obs, skip_special_tokens=True)
            assert text.count("tool\n") == TURNS - 1 and "Error" not in text  # the sandbox answered each call
            lps = value["rollout_log_probs"][first:]
            assert all(lp == 0.0 for lp, m in zip(lps.tolist(), rmask) if m == 0)
    # The trainer's log-probs over the whole multi-turn sequence match the engine's per-turn ones (same weights).
    with_old = [p for p in trainer.step_payloads[0].values() if "old_log_probs" in p]
    for p in with_old:
        model = p["response_mask"].bool()
        assert torch.allclose(p["old_log_probs"][model], p["rollout_log_probs"][model], atol=1e-4)
    assert metrics[0]["rollout/logprob_mismatch"] < 1.001
    for m in metrics:
        assert m["rollout/turns_mean"] == TURNS and m["rollout/tool_calls_mean"] == TURNS - 1
        assert m["rollout/tool_errors"] == 0 and m["rollout/tool_seconds"] > 0
        assert 0 < m["rollout/observation_token_share"] < 1


@pytest.fixture(scope="module")
def async_run(ray_cluster, tmp_path_factory, sync_run):  # after the sync run: one trainer at a time
    trainer = tiny_trainer(AsyncRecorder, "tiny/grpo_colocate_async", tmp_path_factory.mktemp("tool_async"),
                           [*OVERRIDES, f"data.max_response_length={LONG_ASYNC}"], list("abc"), vocab_size=VOCAB)
    with stepped(trainer, STEPS) as result:
        pass
    return result


def test_colocate_async_multi_turn_trajectories_continue_across_the_weight_sync(async_run):
    trainer, metrics, _ = async_run
    assert metrics[0]["partial_rollout/aborted_requests"] > 0
    second = trainer.taken[1]
    spanning = [t for t in second if t["min_version"] < t["max_version"]]
    assert spanning and all((t["min_version"], t["max_version"]) == (0, 1) for t in spanning)
    for t in spanning:  # all turns, both tool answers and the whole budget: nothing lost across the abort
        assert t["num_turns"] == TURNS and t["tool_calls"] == TURNS - 1 and t["tool_errors"] == 0
        assert t["response_len"] == LONG_ASYNC
        assert [v for *_, v in t["version_spans"]][-1] == 1
