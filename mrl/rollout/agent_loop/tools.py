"""Tools for multi-turn agent loops: OpenAI-style function schemas, tool-call parsers and the per-trajectory limits.

A `Tool` declares its schema (`{"type": "function", "function": {name, description, parameters}}`), which the
model's chat template renders into the prompt, and answers a call with text. A `ToolCallParser` finds the calls
in the decoded model turn; `hermes` reads the Hermes/Qwen format `<tool_call>{"name": …, "arguments": {…}}
</tool_call>`, and any "package.module:Class" with the same `parse` method can replace it. Every way a call can
go wrong (bad JSON, unknown tool, wrong arguments, a tool that raises) becomes an error observation that the
model reads on its next turn; nothing here ends a session or raises into the step.
"""

from __future__ import annotations

import importlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


class ToolError(Exception):
    """Raised by a tool for a failure the model should read (its message becomes the error observation)."""


class Tool(ABC):
    """A tool the model can call. Subclasses set `name`, `description` and `parameters` (a JSON schema object)
    and implement `execute`; one instance serves every concurrent session."""

    name: str = "tool"
    description: str = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema that chat templates render (`apply_chat_template(..., tools=[...])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @abstractmethod
    async def execute(self, arguments: dict[str, Any]) -> str:
        """The observation text for a call with these (schema-checked) arguments; raise ToolError to report a
        failure to the model."""


@dataclass
class ToolCall:
    """One call found in a model turn: a name and arguments, or the reason it could not be read (`error`)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """Every call in the decoded model turn `text`, in order; [] when the turn calls nothing (its answer)."""
        ...


class HermesToolParser:
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, as Hermes and Qwen2.5/Qwen3 chat templates
    ask; `arguments` may also be a JSON string of an object. An opened but unclosed block is a malformed call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._call(body) for body in self.BLOCK.findall(text)]
        tail = text[text.rfind(self.CLOSE) + len(self.CLOSE):] if self.CLOSE in text else text
        if self.OPEN in tail:
            calls.append(ToolCall(None, error=f"{self.OPEN} without a closing {self.CLOSE}"))
        return calls

    @staticmethod
    def _call(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return ToolCall(None, error=f"the tool call is not valid JSON ({err})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                return ToolCall(call["name"], error=f"the arguments are not valid JSON ({err})")
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], error="the arguments must be a JSON object")
        return ToolCall(call["name"], arguments)


PARSERS: dict[str, type] = {"hermes": HermesToolParser}

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
}


def argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's schema (required keys, unknown keys, top-level JSON types), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name}: missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(properties))
    if unknown and tool.parameters.get("additionalProperties", True) is False:
        return f"{tool.name}: unknown argument(s) {unknown}; it takes {sorted(properties)}"
    for key, value in arguments.items():
        kind = properties.get(key, {}).get("type")
        want = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if want is not None and (not isinstance(value, want) or (kind != "boolean" and isinstance(value, bool))):
            return f"{tool.name}: argument {key!r} must be a JSON {kind}"
    return None


def load_object(spec: str, what: str) -> Any:
    """The attribute named by "package.module:Name"; an error naming `what` (the setting) when it is not there."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what}={spec!r}: expected 'package.module:Name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{what}={spec!r} cannot be loaded: {type(err).__name__}: {err}") from err


def load_tools(specs: list[str]) -> list[Tool]:
    """Tools from "package.module:Class" strings (constructed without arguments)."""
    return [load_object(spec, "rollout.tools")() for spec in specs]


def load_parser(spec: str) -> ToolCallParser:
    """A built-in parser by name ("hermes") or a "package.module:Class" with a `parse(text)` method."""
    cls = PARSERS[spec] if spec in PARSERS else load_object(spec, "rollout.tool_parser")
    return cls()


@dataclass
class ToolBox:
    """What a tool-using loop is given: the tools, the parser that finds their calls, and the per-trajectory
    limits (turns; tool calls, past which a call is answered with an error observation)."""

    tools: list[Tool] = field(default_factory=list)
    parser: ToolCallParser = field(default_factory=HermesToolParser)
    max_turns: int = 4
    max_tool_calls: int = 8

    @property
    def schemas(self) -> list[dict[str, Any]] | None:
        return [t.schema for t in self.tools] or None

    def find(self, name: str | None) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)
