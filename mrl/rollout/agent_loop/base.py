"""One session = one trajectory: a prompt (chat messages, templated here) and the tokens generated for it.

Token fidelity: `response_ids` are exactly the ids the engine returned, concatenated with tool-observation ids
(`response_mask` 0, log-prob 0.0) in multi-turn loops; nothing is ever re-tokenised from decoded text.

Custom loops (`rollout.agent_loop="package.module:Name"`): an `AgentLoop` subclass or an async function, given a
sample (`messages`, `uid`, …) and the sampling dict, returning a `Trajectory`: ids, masks, engine log-probs, the
weight version of every model span, the engine's per-turn extras and inputs for the reward.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mrl.data.datasets import templated_prompt_ids
from mrl.rollout.agent_loop.tools import ToolBox, ToolCall, ToolError, argument_error, load_object
from mrl.rollout.client import LLMServerClient

logger = logging.getLogger(__name__)


@dataclass
class Trajectory:
    """What an agent loop returns (the interface of custom loops too): the prompt's ids, then per response token
    its id, whether the model produced it (`response_mask`) and the engine's log-prob (0.0 for observations)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: model token, 0: tool/observation token
    rollout_log_probs: list[float] = field(default_factory=list)
    # Weight versions that produced the model tokens (min, max): one value in sync mode.
    min_version: int = -1
    max_version: int = -1
    # (start, end, version) over response_ids for every model span: a turn, or its pieces across weight syncs.
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Per model turn, what the engine returned beside tokens (`TokenOutput.extra`: e.g. routed experts, the server).
    turn_extras: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = "stop"
    num_turns: int = 0
    seed: int | None = None  # the sampling seed of the session's first turn: a run can be replayed
    tool_calls: int = 0  # calls the model made, well-formed or not
    tool_errors: int = 0  # calls answered with an error observation (malformed, unknown tool, failed, over limit)
    tool_seconds: float = 0.0  # time spent executing tools
    # Extra inputs for the reward function, merged into the prompt's extra_info when the response is scored.
    reward_info: dict[str, Any] = field(default_factory=dict)

    def extend(self, ids: list[int], log_probs: list[float] | None, model: bool) -> None:
        self.response_ids += ids
        self.response_mask += [1 if model else 0] * len(ids)
        self.rollout_log_probs += list(log_probs) if model and log_probs is not None else [0.0] * len(ids)

    def add_model_turn(self, out: Any) -> None:
        """Append one engine output (TokenOutput, or the partial-rollout client's TrajectoryOutput) verbatim."""
        start = len(self.response_ids)
        self.extend(out.token_ids, out.log_probs, model=True)
        spans = getattr(out, "spans", None) or [(0, len(out.token_ids), out.version)]
        self.version_spans += [(start + a, start + b, v) for a, b, v in spans]
        self.turn_extras.append(dict(getattr(out, "extra", None) or {}))
        self.record_version(out.version, getattr(out, "min_version", None))
        self.stop_reason = out.stop_reason
        self.num_turns += 1

    def record_version(self, version: int, min_version: int | None = None) -> None:
        """`min_version`: the oldest version of a turn that spans a weight sync (partial rollout), else `version`."""
        oldest = version if min_version is None else min_version
        self.min_version = oldest if self.min_version < 0 else min(self.min_version, oldest)
        self.max_version = max(self.max_version, version)


class AgentLoop(ABC):
    """Subclasses implement `run`; a loop object serves many concurrent sessions, so it keeps no per-session
    state on `self`. `toolbox` (the recipe's tools, parser and limits) is given to every loop; loops that use
    no tools ignore it."""

    def __init__(self, tokenizer: Any, client: LLMServerClient, max_response_length: int,
                 toolbox: ToolBox | None = None) -> None:
        self.tokenizer = tokenizer
        self.client = client
        self.max_response_length = max_response_length
        self.toolbox = toolbox or ToolBox()

    def prompt_ids(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return templated_prompt_ids(self.tokenizer, messages, tools)

    @abstractmethod
    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory: ...


class SingleTurnAgentLoop(AgentLoop):
    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory:
        traj = Trajectory(self.prompt_ids(sample["messages"]), seed=sampling.get("seed"))
        out = await self.client.generate(
            session_id, traj.prompt_ids, {**sampling, "max_tokens": self.max_response_length}
        )
        traj.add_model_turn(out)
        return traj


class ToolAgentLoop(AgentLoop):
    """Model turn → (tool calls? → their observations as `tool` messages) → … until a turn calls no tool (the
    answer), `max_turns` or the budget. The prompt carries the tools' schemas through the chat template.

    The response budget (`max_response_length`) counts model and observation tokens together (they all occupy
    the context): it is the trajectory's token limit. Observation text is tokenised once, as the chat template
    renders it after the model's end-of-turn token; the next turn's prompt is the ids so far, never re-tokenised."""

    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory:
        box = self.toolbox
        traj = Trajectory(self.prompt_ids(sample["messages"], box.schemas), seed=sampling.get("seed"))
        while traj.num_turns < box.max_turns:
            budget = self.max_response_length - len(traj.response_ids)
            if budget <= 0:
                traj.stop_reason = "length"
                break
            params = {**self.turn_sampling(sample, sampling, traj), "max_tokens": budget}
            out = await self.client.generate(session_id, traj.prompt_ids + traj.response_ids, params)
            traj.add_model_turn(out)
            if out.stop_reason != "stop" or traj.num_turns >= box.max_turns:
                break  # an observation after the last turn would never be read by the model
            calls = box.parser.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
            if not calls:
                break  # the model answered
            results = await asyncio.gather(*(self._answer(session_id, call, traj) for call in calls))
            obs = self.observation_ids(list(results))
            room = self.max_response_length - len(traj.response_ids)
            traj.extend(obs[:room], None, model=False)
        await self.client.end_session(session_id)
        return traj

    def turn_sampling(self, sample: dict[str, Any], sampling: dict[str, Any], traj: Trajectory) -> dict[str, Any]:
        """The sampling dict of the next turn (`traj.num_turns` turns done): a hook for subclasses (e.g. another
        temperature once a tool answered); the loop sets max_tokens to the remaining budget."""
        return sampling

    async def _answer(self, session_id: str, call: ToolCall, traj: Trajectory) -> str:
        """The observation text for one call: the tool's output, or "Error: …" for whatever went wrong (counted
        on the trajectory; a tool is user code, so any exception it raises is caught here, never in the step)."""
        traj.tool_calls += 1
        tool = self.toolbox.find(call.name)
        if traj.tool_calls > self.toolbox.max_tool_calls:
            error = f"the limit of {self.toolbox.max_tool_calls} tool calls per trajectory is reached"
        elif call.error is not None:
            error = call.error
        elif tool is None:
            error = f"unknown tool {call.name!r}; the tools are {[t.name for t in self.toolbox.tools]}"
        else:
            error = argument_error(tool, call.arguments)
        if error is None:
            assert tool is not None
            start = time.monotonic()
            try:
                observation = await tool.execute(call.arguments)
                if not isinstance(observation, str):
                    raise TypeError(f"returned {type(observation).__name__}, not text")
                return observation
            except ToolError as err:
                error = str(err)
            except Exception as err:
                logger.warning("session %s: tool %s failed (%s: %s)", session_id, tool.name, type(err).__name__, err)
                error = f"tool {tool.name} failed ({type(err).__name__}: {err})"
            finally:
                traj.tool_seconds += time.monotonic() - start
        traj.tool_errors += 1
        return f"Error: {error}"

    def observation_ids(self, texts: list[str]) -> list[int]:
        """Ids of `tool` messages with these contents as the chat template renders them right after an assistant
        turn (the template's text after the end-of-turn token, then the messages and the next generation prompt);
        computed against a stand-in conversation, so templates that add a default system prompt add none here."""
        tool_messages = [{"role": "tool", "content": t} for t in texts]
        base = self._render(_STAND_IN, generation_prompt=False)
        full = self._render(_STAND_IN + tool_messages, generation_prompt=True)
        eos = self.tokenizer.eos_token
        if full.startswith(base) and eos and eos in base:
            text = base[base.rindex(eos) + len(eos):] + full[len(base):]
        else:  # a template that renders the stand-in's last turn differently once it is followed by more
            text = "\n" + self._render(tool_messages, generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


# A conversation up to the end of an assistant turn, against which observations are rendered.
_STAND_IN = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


class FunctionAgentLoop(AgentLoop):
    """A custom loop given as an async function `fn(loop, session_id, sample, sampling) -> Trajectory`; `loop` is
    this object (tokenizer, client, max_response_length, toolbox, prompt_ids)."""

    fn: Callable[..., Awaitable[Trajectory]]

    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory:
        return await type(self).fn(self, session_id, sample, sampling)


AGENT_LOOPS: dict[str, type[AgentLoop]] = {"single_turn": SingleTurnAgentLoop, "tool": ToolAgentLoop}


def agent_loop_class(name: str) -> type[AgentLoop]:
    """A built-in loop by name, or a custom one by path: "package.module:Class" (an AgentLoop subclass) or
    "package.module:function" (an async function, see FunctionAgentLoop)."""
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if ":" not in name:
        raise ValueError(f"rollout.agent_loop={name!r}: not one of {sorted(AGENT_LOOPS)} nor 'package.module:Name'")
    obj = load_object(name, "rollout.agent_loop")
    if isinstance(obj, type) and issubclass(obj, AgentLoop):
        return obj
    if inspect.iscoroutinefunction(obj):
        return type(f"FunctionAgentLoop[{name}]", (FunctionAgentLoop,), {"fn": staticmethod(obj)})
    raise ValueError(f"rollout.agent_loop={name!r} is neither an AgentLoop subclass nor an async function")
