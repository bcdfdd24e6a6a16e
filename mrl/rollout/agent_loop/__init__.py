"""Agent loops: coroutines that turn one prompt into one trajectory through the token API (token in, token out).

`AgentLoopWorker`s are CPU Ray actors, each running many sessions concurrently; `AgentLoopManager` on the driver
fans prompts out to them and gathers trajectories in prompt order.
"""

from mrl.rollout.agent_loop.base import (
    AgentLoop,
    FunctionAgentLoop,
    SingleTurnAgentLoop,
    ToolAgentLoop,
    Trajectory,
    agent_loop_class,
)
from mrl.rollout.agent_loop.tools import HermesToolParser, Tool, ToolBox, ToolCall, ToolCallParser, ToolError
from mrl.rollout.agent_loop.worker import AgentLoopManager, AgentLoopWorker

__all__ = [
    "AgentLoop",
    "AgentLoopManager",
    "AgentLoopWorker",
    "FunctionAgentLoop",
    "HermesToolParser",
    "SingleTurnAgentLoop",
    "Tool",
    "ToolAgentLoop",
    "ToolBox",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "Trajectory",
    "agent_loop_class",
]
