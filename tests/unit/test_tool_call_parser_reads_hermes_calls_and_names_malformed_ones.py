"""The Hermes/Qwen tool-call parser: well-formed calls become (name, arguments); anything else becomes a call
with an error the model will read, never an exception. Arguments are checked against the tool's schema."""

from typing import ClassVar

import pytest

from mrl.rollout.agent_loop import HermesToolParser, Tool, ToolCall
from mrl.rollout.agent_loop.tools import argument_error, load_parser


def parse(text):
    return HermesToolParser().parse(text)


def test_well_formed_calls_are_read_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1+1)"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')
    assert parse(text) == [ToolCall("python", {"code": "print(1+1)"}), ToolCall("search", {"q": "x"})]
    assert parse("the answer is 4") == []
    assert parse('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize(("text", "error"), [
    ('<tool_call>{"name": "python", "arguments": {"code": </tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "arguments are not valid JSON"),
    ('<tool_call>{"name": "f", "arguments": {}}', "without a closing </tool_call>"),
])
def test_malformed_calls_carry_their_error(text, error):
    (call,) = parse(text)
    assert call.error is not None and error in call.error


def test_a_closed_call_then_an_unclosed_one_gives_both():
    calls = parse('<tool_call>{"name": "f", "arguments": {}}</tool_call> and <tool_call>{"name"')
    assert calls[0] == ToolCall("f", {}) and "without a closing" in calls[1].error


class Python(Tool):
    name = "python"
    parameters: ClassVar[dict] = {"type": "object",
                                  "properties": {"code": {"type": "string"}, "n": {"type": "integer"}},
                                  "required": ["code"], "additionalProperties": False}

    async def execute(self, arguments):
        return ""


@pytest.mark.parametrize(("arguments", "error"), [
    ({"code": "x"}, None),
    ({"code": "x", "n": 3}, None),
    ({}, "missing required argument(s) ['code']"),
    ({"code": 1}, "'code' must be a JSON string"),
    ({"code": "x", "n": True}, "'n' must be a JSON integer"),
    ({"code": "x", "m": 1}, "unknown argument(s) ['m']"),
])
def test_arguments_are_checked_against_the_schema(arguments, error):
    found = argument_error(Python(), arguments)
    assert found == error if error is None else error in found


def test_the_schema_is_openai_style_and_parsers_load_by_name_or_path():
    assert Python().schema == {"type": "function", "function": {
        "name": "python", "description": "", "parameters": Python.parameters}}
    assert isinstance(load_parser("hermes"), HermesToolParser)
    assert isinstance(load_parser("mrl.rollout.agent_loop.tools:HermesToolParser"), HermesToolParser)
    with pytest.raises(ValueError, match=r"rollout\.tool_parser"):
        load_parser("mrl.rollout.agent_loop.tools:Nope")
