"""Agent loops on a real engine (the HF adapter, in process): token in, token out.

Tool loop: each model turn's ids and log-probs are the engine's, verbatim; tool observations are appended with
response_mask 0 and log-prob 0.0, tokenised once from the chat template's text; each turn's prompt is the previous
context's ids, never re-tokenised text. Every call gets an observation: a failure (malformed call, unknown tool,
bad arguments, a tool that raises or returns no text, a call over the limit) is an error observation and the
session goes on. Custom loops load by "module:Name".
"""

import asyncio
from typing import ClassVar

import pytest

from mrl.models.tiny import make_tiny_hf_model
from mrl.rollout.agent_loop import (
    SingleTurnAgentLoop,
    Tool,
    ToolAgentLoop,
    ToolBox,
    ToolCall,
    ToolError,
    Trajectory,
    agent_loop_class,
)
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


class EchoLength(Tool):
    name = "echo_length"
    description = "count characters"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def execute(self, arguments):
        return f"you wrote {len(arguments['text'])} characters"


class Broken(Tool):
    name = "broken"
    description = "fails"

    async def execute(self, arguments):
        if arguments.get("how") == "raise":
            raise RuntimeError("tool backend down")
        if arguments.get("how") == "tool_error":
            raise ToolError("division by zero")
        return {"not": "text"}


class CallEveryTurn:
    """A pluggable parser: every turn calls echo_length with the turn's text, so the loop runs to max_turns."""

    def parse(self, text):
        return [ToolCall("echo_length", {"text": text})]


class Scripted:
    """A parser that returns the next turn's calls from a script (then none: the model answered)."""

    def __init__(self, turns):
        self.turns = list(turns)

    def parse(self, text):
        return self.turns.pop(0) if self.turns else []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("agent_loop") / "m", seed=0)
    adapter = HFAdapter(str(path), max_model_len=1024)
    from transformers import AutoTokenizer

    return adapter, AutoTokenizer.from_pretrained(str(path))


# Stopping on a large set of ids ends each turn after a few tokens with stop_reason "stop".
SAMPLING = {"temperature": 1.0, "seed": 3, "stop_token_ids": list(range(100, 400))}
SAMPLE = {"messages": [{"role": "user", "content": "hello world"}], "uid": "u"}


def rendered_tool_turn(tokenizer, text):
    """The tiny ChatML template's tool turn after a model turn, written out by hand: newline, tool message,
    generation prompt; tokenised once."""
    return tokenizer.encode(f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_four_turn_trajectory_is_engine_ids_plus_observations_tokenised_once(engine):
    adapter, tokenizer = engine
    client = InProcessClient(adapter)
    box = ToolBox([EchoLength()], CallEveryTurn(), max_turns=4)
    loop = ToolAgentLoop(tokenizer, client, max_response_length=400, toolbox=box)
    traj = asyncio.run(loop.run("s0", SAMPLE, SAMPLING))
    assert traj.num_turns == 4 and len(client.calls) == 4 and traj.tool_calls == 3 and traj.tool_errors == 0
    schema_prompt = tokenizer.apply_chat_template(SAMPLE["messages"], tools=[EchoLength().schema],
                                                  add_generation_prompt=True, tokenize=False)
    assert schema_prompt.startswith("<|im_start|>system\ntools: echo_length<|im_end|>")  # the tools, rendered
    assert traj.prompt_ids == tokenizer.encode(schema_prompt, add_special_tokens=False)
    position = 0
    for turn, (prompt_ids, out) in enumerate(client.calls):
        assert prompt_ids == traj.prompt_ids + traj.response_ids[:position]  # the context, as ids
        end = position + len(out.token_ids)
        assert traj.response_ids[position:end] == out.token_ids
        assert traj.response_mask[position:end] == [1] * len(out.token_ids)
        assert traj.rollout_log_probs[position:end] == out.log_probs
        assert traj.version_spans[turn] == (position, end, out.version)
        position = end
        if turn < 3:  # an observation follows every turn but the last
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            obs = rendered_tool_turn(tokenizer, f"you wrote {len(text)} characters")
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


def observations(tokenizer, traj):
    """The decoded observation spans (response_mask 0) of a trajectory, in order."""
    spans, current = [], []
    for i, m in zip(traj.response_ids, traj.response_mask):
        if m == 0:
            current.append(i)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=True))
            current = []
    return spans + ([tokenizer.decode(current, skip_special_tokens=True)] if current else [])


def test_every_failed_call_is_an_error_observation_and_the_session_goes_on(engine, caplog):
    adapter, tokenizer = engine
    client = InProcessClient(adapter)
    script = [
        [ToolCall(None, error="the tool call is not valid JSON (Expecting value)"), ToolCall("nope", {})],
        [ToolCall("echo_length", {"text": 3}), ToolCall("broken", {"how": "raise"})],
        [ToolCall("broken", {"how": "tool_error"}), ToolCall("broken", {"how": "non_text"})],
        [ToolCall("echo_length", {"text": "abc"}), ToolCall("echo_length", {"text": "over the limit"})],
    ]
    box = ToolBox([EchoLength(), Broken()], Scripted(script), max_turns=5, max_tool_calls=7)
    loop = ToolAgentLoop(tokenizer, client, max_response_length=600, toolbox=box)
    with caplog.at_level("WARNING", logger="mrl.rollout.agent_loop.base"):
        traj = asyncio.run(loop.run("s2", SAMPLE, SAMPLING))
    assert traj.num_turns == 5 and traj.tool_calls == 8 and traj.tool_errors == 7  # the 5th turn called nothing
    obs = observations(tokenizer, traj)
    assert len(obs) == 4
    expected = [
        ["Error: the tool call is not valid JSON",
         "Error: unknown tool 'nope'; the tools are ['echo_length', 'broken']"],
        ["Error: echo_length: argument 'text' must be a JSON string",
         "Error: tool broken failed (RuntimeError: tool backend down)"],
        ["Error: division by zero", "Error: tool broken failed (TypeError: returned dict, not text)"],
        ["you wrote 3 characters", "Error: the limit of 7 tool calls per trajectory is reached"],
    ]
    for text, messages in zip(obs, expected):
        for message in messages:
            assert message in text
    assert "tool broken failed" in caplog.text


async def echo_twice(loop, session_id, sample, sampling):
    """A custom loop as a function: two model turns, the second continuing the first's ids."""
    traj = Trajectory(loop.prompt_ids(sample["messages"]), seed=sampling.get("seed"))
    for _ in range(2):
        out = await loop.client.generate(session_id, traj.prompt_ids + traj.response_ids,
                                         {**sampling, "max_tokens": 4})
        traj.add_model_turn(out)
    traj.reward_info["turns_seen"] = traj.num_turns
    return traj


class TwiceLoop(ToolAgentLoop):
    """A custom loop as a class."""


def test_custom_loops_load_by_module_path(engine):
    adapter, tokenizer = engine
    assert agent_loop_class(f"{__name__}:TwiceLoop") is TwiceLoop
    cls = agent_loop_class(f"{__name__}:echo_twice")
    client = InProcessClient(adapter)
    traj = asyncio.run(cls(tokenizer, client, max_response_length=8).run("s3", SAMPLE, SAMPLING))
    assert traj.num_turns == 2 and traj.reward_info == {"turns_seen": 2}
    assert client.calls[1][0] == traj.prompt_ids + client.calls[0][1].token_ids
    for bad in ("react", f"{__name__}:SAMPLE", f"{__name__}:missing"):
        with pytest.raises(ValueError, match=r"rollout\.agent_loop"):
            agent_loop_class(bad)
