"""Agent loops: coroutines that turn one prompt into one trajectory through the token API (token in, token out).

`AgentLoopWorker`s are CPU Ray actors, each running many sessions concurrently; `AgentLoopManager` on the driver
fans prompts out to them and gathers trajectories in prompt order.
"""

from mrl.rollout.agent_loop.base import (
    AgentLoop,
    SingleTurnAgentLoop,
    Tool,
    ToolAgentLoop,
    Trajectory,
    agent_loop_class,
)
from mrl.rollout.agent_loop.worker import AgentLoopManager, AgentLoopWorker

__all__ = [
    "AgentLoop",
    "AgentLoopManager",
    "AgentLoopWorker",
    "SingleTurnAgentLoop",
    "Tool",
    "ToolAgentLoop",
    "Trajectory",
    "agent_loop_class",
]
