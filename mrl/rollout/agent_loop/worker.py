"""`AgentLoopWorker` (a CPU Ray actor running sessions as coroutines) and the driver-side `AgentLoopManager`."""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import asdict
from typing import Any

import ray

from mrl.rollout.agent_loop.base import Tool, agent_loop_class
from mrl.rollout.client import FaultPolicy, FullyAsyncLLMServerClient, LLMServerClient, wait_within


def load_tools(specs: list[str]) -> list[Tool]:
    """Tools from "package.module:Class" strings (constructed without arguments)."""
    tools = []
    for spec in specs:
        module, _, name = spec.partition(":")
        tools.append(getattr(importlib.import_module(module), name)())
    return tools


class AgentLoopWorker:
    def __init__(self, tokenizer_path: str, balancer: Any, loop: str, max_response_length: int,
                 tools: list[str] | None = None, max_turns: int = 4, policy: FaultPolicy | None = None,
                 fully_async: bool = False) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        cls = agent_loop_class(loop)
        kwargs = {"tools": load_tools(tools or []), "max_turns": max_turns} if loop == "tool" else {}
        # Async trainer modes abort requests for weight syncs; the fully-async client continues them (partial rollout).
        client = (FullyAsyncLLMServerClient if fully_async else LLMServerClient)(balancer, policy)
        self.loop = cls(tokenizer, client, max_response_length, **kwargs)

    async def generate(self, samples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """`n` independent sessions per sample, all concurrent; trajectories in (sample, i) order. A seeded
        sampling dict gives session k of this call seed + k, so a run is reproducible and sessions differ."""
        seed = sampling.get("seed")
        calls, sessions = [], []
        for s, sample in enumerate(samples):
            for i in range(n):
                k = s * n + i
                params = {**sampling, "seed": None if seed is None else seed + k}
                sessions.append(f"{sample['uid']}-{i}")
                calls.append(self.loop.run(sessions[-1], sample, params))
        trajectories = await asyncio.gather(*calls)
        return [{**asdict(t), "session_id": sid} for t, sid in zip(trajectories, sessions)]

    def replica_failures(self) -> int:
        """Calls of this worker's sessions that failed with their replica (each retried, or the session failed)."""
        return self.loop.client.replica_failures


class AgentLoopManager:
    def __init__(self, num_workers: int, tokenizer_path: str, balancer: Any, loop: str = "single_turn",
                 max_response_length: int = 256, tools: list[str] | None = None, max_turns: int = 4,
                 policy: FaultPolicy | None = None, fully_async: bool = False) -> None:
        self.policy = policy or FaultPolicy()
        remote = ray.remote(AgentLoopWorker).options(num_cpus=0, max_concurrency=1024)
        self.workers = [
            remote.remote(tokenizer_path, balancer, loop, max_response_length, tools, max_turns, self.policy,
                          fully_async)
            for _ in range(num_workers)
        ]
        self._next_worker = 0

    def submit(self, sample: dict[str, Any], n: int, sampling: dict[str, Any]) -> ray.ObjectRef:
        """The `n` trajectories of one sample, without waiting (workers take turns): a ref to the list."""
        worker = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        return worker.generate.remote([sample], n, sampling)

    def generate(self, samples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Trajectories of every sample (n each, grouped by sample, in sample order)."""
        k = len(self.workers)
        size = -(-len(samples) // k)
        chunks = [samples[i * size : (i + 1) * size] for i in range(k)]
        refs = {
            i: w.generate.remote(chunk, n, {**sampling, "seed": _offset(sampling.get("seed"), i * size * n)})
            for i, (w, chunk) in enumerate(zip(self.workers, chunks))
            if chunk
        }
        wait_within(refs, self.policy.generate_timeout_s, "rollout generate on agent-loop workers",
                    "rollout.generate_timeout_s")
        return [t for ref in refs.values() for t in ray.get(ref)]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def _offset(seed: int | None, by: int) -> int | None:
    return None if seed is None else seed + by
