"""Agent loops on a real engine (the HF adapter, in process): token in, token out.

Tool loop: each model turn's ids and log-probs are the engine's, verbatim; tool observations are appended with
response_mask 0 and log-prob 0.0; each turn's prompt is the previous context's ids, never re-tokenised text.
"""

import asyncio

import pytest

from mrl.models.tiny import make_tiny_hf_model
from mrl.rollout.agent_loop import SingleTurnAgentLoop, Tool, ToolAgentLoop
from rollout_adapters.hf.adapter import HFAdapter


class InProcessClient:
    """The client API over one adapter without Ray; it records every call and its engine output."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.calls = []

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self.adapter.generate(request_id, prompt_ids, sampling_params)
        self.calls.append((list(prompt_ids), out))
        return out

    async def end_session(self, request_id):
        return None


class EchoLengthTool(Tool):
    name = "echo_length"

    def parse(self, text):
        return len(text)  # every turn "calls" the tool, so the loop runs until max_turns

    async def execute(self, arguments):
        return f"you wrote {arguments} characters"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("agent_loop") / "m", seed=0)
    adapter = HFAdapter(str(path), max_model_len=512)
    from transformers import AutoTokenizer

    return adapter, AutoTokenizer.from_pretrained(str(path))


# Stopping on a large set of ids ends each turn after a few tokens with stop_reason "stop".
SAMPLING = {"temperature": 1.0, "seed": 3, "stop_token_ids": list(range(100, 400))}
SAMPLE = {"messages": [{"role": "user", "content": "hello world"}], "uid": "u"}


def test_tool_loop_masks_observations_and_keeps_engine_tokens(engine):
    adapter, tokenizer = engine
    client = InProcessClient(adapter)
    loop = ToolAgentLoop(tokenizer, client, max_response_length=200, tools=[EchoLengthTool()], max_turns=3)
    traj = asyncio.run(loop.run("s0", SAMPLE, SAMPLING))
    assert traj.num_turns == 3 and len(client.calls) == 3
    position = 0
    for turn, (prompt_ids, out) in enumerate(client.calls):
        assert prompt_ids == traj.prompt_ids + traj.response_ids[:position]  # the context, as ids
        end = position + len(out.token_ids)
        assert traj.response_ids[position:end] == out.token_ids
        assert traj.response_mask[position:end] == [1] * len(out.token_ids)
        assert traj.rollout_log_probs[position:end] == out.log_probs
        position = end
        if turn < 2:  # an observation follows every turn but the last
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            obs = loop.observation_ids(f"you wrote {len(text)} characters")
            end = position + len(obs)
            assert traj.response_ids[position:end] == obs
            assert traj.response_mask[position:end] == [0] * len(obs)
            assert traj.rollout_log_probs[position:end] == [0.0] * len(obs)
            position = end
    assert position == len(traj.response_ids)


def test_single_turn_loop_returns_the_engine_output_verbatim(engine):
    adapter, tokenizer = engine
    client = InProcessClient(adapter)
    traj = asyncio.run(SingleTurnAgentLoop(tokenizer, client, max_response_length=8).run("s1", SAMPLE, SAMPLING))
    ((prompt_ids, out),) = client.calls
    assert prompt_ids == traj.prompt_ids == tokenizer.apply_chat_template(
        SAMPLE["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert traj.response_ids == out.token_ids and traj.rollout_log_probs == out.log_probs
    assert traj.response_mask == [1] * len(out.token_ids) and traj.seed == SAMPLING["seed"]


class BrokenTool(Tool):
    """Every turn calls it; the first call raises or returns a non-text object, depending on `failure`."""

    name = "broken"

    def __init__(self, failure):
        self.failure = failure

    def parse(self, text):
        return text

    async def execute(self, arguments):
        if self.failure == "raise":
            raise RuntimeError("tool backend down")
        return {"not": "text"}


@pytest.mark.parametrize("failure", ["raise", "non_text"])
def test_a_malformed_tool_output_is_counted_and_ends_the_session(engine, failure, caplog):
    adapter, tokenizer = engine
    client = InProcessClient(adapter)
    loop = ToolAgentLoop(tokenizer, client, max_response_length=200, tools=[BrokenTool(failure)], max_turns=3)
    with caplog.at_level("WARNING", logger="mrl.rollout.agent_loop.base"):
        traj = asyncio.run(loop.run("s2", SAMPLE, SAMPLING))
    ((_, out),) = client.calls  # one model turn, then the failed tool call ended the session
    assert traj.tool_errors == 1 and traj.num_turns == 1
    assert traj.response_ids == out.token_ids and traj.response_mask == [1] * len(out.token_ids)
    assert "tool broken failed" in caplog.text
