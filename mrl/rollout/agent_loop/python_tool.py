"""`PythonTool`: the model runs Python in the sandbox (mrl/rollout/agent_loop/sandbox.py) and reads what it prints.

Use it as `rollout.tools=[mrl.rollout.agent_loop.python_tool:PythonTool]`; subclass it to change the pool size or
the limits. A failed run (an exception, a nonzero exit, a limit) is an error observation carrying the reason and
the output, so the model sees its traceback.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mrl.rollout.agent_loop.sandbox import SandboxLimits, SandboxPool
from mrl.rollout.agent_loop.tools import Tool, ToolError


class PythonTool(Tool):
    name = "python"
    description = "run Python code and return what it prints"
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"code": {"type": "string", "description": "a Python 3 program"}},
        "required": ["code"],
    }
    slots: int = 4  # snippets running at once per agent-loop worker
    limits: SandboxLimits = SandboxLimits()

    def __init__(self) -> None:
        self.pool = SandboxPool(self.slots, self.limits)

    async def execute(self, arguments: dict[str, Any]) -> str:
        result = await self.pool.run(arguments["code"])
        if not result.ok:
            raise ToolError(f"{result.error}\n{result.output}".rstrip())
        return result.output
