"""One session = one trajectory: a prompt (chat messages, templated here) and the tokens generated for it.

Token fidelity: `response_ids` are exactly the ids the engine returned, concatenated with tool-observation ids
(`response_mask` 0, log-prob 0.0) in multi-turn loops; nothing is ever re-tokenised from decoded text.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from mrl.data.datasets import templated_prompt_ids
from mrl.rollout.client import LLMServerClient

logger = logging.getLogger(__name__)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: model token, 0: tool/observation token
    rollout_log_probs: list[float] = field(default_factory=list)
    # Weight versions that produced the model tokens (min, max): one value in sync mode.
    min_version: int = -1
    max_version: int = -1
    stop_reason: str = "stop"
    num_turns: int = 0
    seed: int | None = None  # the sampling seed of the session's first turn: a run can be replayed
    tool_errors: int = 0  # tool calls that raised or returned no text (the session ended there)

    def extend(self, ids: list[int], log_probs: list[float] | None, model: bool) -> None:
        self.response_ids += ids
        self.response_mask += [1 if model else 0] * len(ids)
        self.rollout_log_probs += list(log_probs) if model and log_probs is not None else [0.0] * len(ids)

    def record_version(self, version: int, min_version: int | None = None) -> None:
        """`min_version`: the oldest version of a turn that spans a weight sync (partial rollout), else `version`."""
        oldest = version if min_version is None else min_version
        self.min_version = oldest if self.min_version < 0 else min(self.min_version, oldest)
        self.max_version = max(self.max_version, version)


class AgentLoop(ABC):
    """Subclasses implement `run`; a loop object serves many concurrent sessions, so it keeps no per-session
    state on `self`."""

    def __init__(self, tokenizer: Any, client: LLMServerClient, max_response_length: int) -> None:
        self.tokenizer = tokenizer
        self.client = client
        self.max_response_length = max_response_length

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return templated_prompt_ids(self.tokenizer, messages)

    @abstractmethod
    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory: ...


class SingleTurnAgentLoop(AgentLoop):
    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory:
        traj = Trajectory(self.prompt_ids(sample["messages"]), seed=sampling.get("seed"))
        out = await self.client.generate(
            session_id, traj.prompt_ids, {**sampling, "max_tokens": self.max_response_length}
        )
        traj.extend(out.token_ids, out.log_probs, model=True)
        traj.record_version(out.version, getattr(out, "min_version", None))
        traj.stop_reason, traj.num_turns = out.stop_reason, 1
        return traj


class Tool(ABC):
    """A tool the model can call: `parse` finds a call in the model's latest turn, `execute` answers it."""

    name: str = "tool"

    @abstractmethod
    def parse(self, text: str) -> Any | None:
        """The call's arguments if `text` (the decoded model turn) asks for this tool, else None."""

    @abstractmethod
    async def execute(self, arguments: Any) -> str:
        """The observation text returned to the model."""


class ToolAgentLoop(AgentLoop):
    """Model turn → (tool call? → observation as a `tool` message) → … until no call, `max_turns` or the budget.

    The response budget counts model and observation tokens together (they all occupy the context)."""

    def __init__(self, tokenizer: Any, client: LLMServerClient, max_response_length: int,
                 tools: list[Tool] | None = None, max_turns: int = 4) -> None:
        super().__init__(tokenizer, client, max_response_length)
        self.tools = list(tools or [])
        self.max_turns = max_turns

    def observation_ids(self, text: str) -> list[int]:
        # The model's turn ended with its end-of-turn token; the template puts a newline after it.
        newline = self.tokenizer.encode("\n", add_special_tokens=False)
        return newline + self.prompt_ids([{"role": "tool", "content": text}])

    async def run(self, session_id: str, sample: dict[str, Any], sampling: dict[str, Any]) -> Trajectory:
        traj = Trajectory(self.prompt_ids(sample["messages"]), seed=sampling.get("seed"))
        while traj.num_turns < self.max_turns:
            budget = self.max_response_length - len(traj.response_ids)
            if budget <= 0:
                traj.stop_reason = "length"
                break
            out = await self.client.generate(
                session_id, traj.prompt_ids + traj.response_ids, {**sampling, "max_tokens": budget}
            )
            traj.extend(out.token_ids, out.log_probs, model=True)
            traj.record_version(out.version, getattr(out, "min_version", None))
            traj.stop_reason = out.stop_reason
            traj.num_turns += 1
            if out.stop_reason != "stop" or traj.num_turns >= self.max_turns:
                break  # an observation after the last turn would never be read by the model
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            observation = await self._observe(session_id, text, traj)
            if observation is None:
                break
            obs = self.observation_ids(observation)
            room = self.max_response_length - len(traj.response_ids)
            traj.extend(obs[:room], None, model=False)
        await self.client.end_session(session_id)
        return traj

    async def _observe(self, session_id: str, text: str, traj: Trajectory) -> str | None:
        """The observation for the tool call in `text`, or None: no call, or a malformed tool output (the tool
        raised, or returned something other than text). A malformed one is counted on the trajectory and logged,
        and the session ends on the model's turn: the trajectory still trains, the step never sees the error."""
        name = "?"
        try:
            call = self._find_call(text)
            if call is None:
                return None
            tool, arguments = call
            name = tool.name
            observation = await tool.execute(arguments)
            if not isinstance(observation, str):
                raise TypeError(f"returned {type(observation).__name__}, not text")
            return observation
        except Exception as err:  # a tool is user code: any failure ends this session, never the step
            traj.tool_errors += 1
            logger.warning("session %s: tool %s failed (%s: %s); the session ends at turn %d", session_id, name,
                           type(err).__name__, err, traj.num_turns)
            return None

    def _find_call(self, text: str) -> tuple[Tool, Any] | None:
        for tool in self.tools:
            arguments = tool.parse(text)
            if arguments is not None:
                return tool, arguments
        return None


AGENT_LOOPS: dict[str, type[AgentLoop]] = {"single_turn": SingleTurnAgentLoop, "tool": ToolAgentLoop}


def agent_loop_class(name: str) -> type[AgentLoop]:
    if name not in AGENT_LOOPS:
        raise ValueError(f"agent loop {name!r} unknown; known: {sorted(AGENT_LOOPS)}")
    return AGENT_LOOPS[name]
