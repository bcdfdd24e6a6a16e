"""`AgentLoopWorker` (a CPU Ray actor running sessions as coroutines) and the driver-side `AgentLoopManager`.

The per-token half of each trajectory (ids, mask, log-probs) goes into the sample store under a fresh key; the
caller gets a light record only: the key and scalar tags, including the decoded model tokens for the reward
(mrl/data/samples.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import ray

from mrl.data.jagged import JaggedTensor
from mrl.data.sample_store import SampleStore
from mrl.data.samples import TRAJECTORY_FIELDS, fill_unrouted, payload, routed_experts
from mrl.rollout.agent_loop.base import Trajectory, agent_loop_class
from mrl.rollout.agent_loop.tools import ToolBox, load_parser, load_tools
from mrl.rollout.client import FaultPolicy, FullyAsyncLLMServerClient, LLMServerClient, wait_within


def record(traj: Trajectory, key: str, session_id: str, response_text: str) -> dict[str, Any]:
    """The light half of a trajectory: what the replay buffer and the driver see (no per-token data)."""
    return {"key": key, "session_id": session_id, "prompt_len": len(traj.prompt_ids),
            "response_len": len(traj.response_ids), "model_tokens": sum(traj.response_mask),
            "min_version": traj.min_version, "max_version": traj.max_version, "stop_reason": traj.stop_reason,
            "num_turns": traj.num_turns, "seed": traj.seed, "tool_calls": traj.tool_calls,
            "tool_errors": traj.tool_errors, "tool_seconds": traj.tool_seconds, "version_spans": traj.version_spans,
            "reward_info": traj.reward_info, "response_text": response_text}


class AgentLoopWorker:
    def __init__(self, tokenizer_path: str, balancer: Any, loop: str, max_response_length: int,
                 store: SampleStore, tools: list[str] | None = None, max_turns: int = 4,
                 policy: FaultPolicy | None = None, fully_async: bool = False) -> None:
        """`policy`: the rollout config section (its tool parser and tool-call limit configure the toolbox)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer, self.store = tokenizer, store
        # Connect to the store's actors now: a first call from this process costs seconds on a busy host, which
        # would otherwise delay whichever trajectories finish first.
        store.wait_ready()
        policy = policy or FaultPolicy()
        toolbox = ToolBox(load_tools(tools or []), load_parser(policy.tool_parser), max_turns, policy.max_tool_calls)
        # Async trainer modes abort requests for weight syncs; the fully-async client continues them (partial rollout).
        client = (FullyAsyncLLMServerClient if fully_async else LLMServerClient)(balancer, policy)
        self.loop = agent_loop_class(loop)(tokenizer, client, max_response_length, toolbox)

    async def generate(self, samples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """`n` independent sessions per sample, all concurrent; records in (sample, i) order, their payloads in the
        store. A seeded sampling dict gives session k of this call seed + k, so a run is reproducible and sessions
        differ."""
        seed = sampling.get("seed")
        calls, sessions = [], []
        for s, sample in enumerate(samples):
            for i in range(n):
                k = s * n + i
                params = {**sampling, "seed": None if seed is None else seed + k}
                sessions.append(f"{sample['uid']}-{i}")
                calls.append(self.loop.run(sessions[-1], sample, params))
        trajectories = await asyncio.gather(*calls)
        keys = [uuid.uuid4().hex for _ in trajectories]  # unique per trajectory, whatever the uid
        payloads = [payload(t.prompt_ids, t.response_ids, t.response_mask, t.rollout_log_probs) for t in trajectories]
        columns = {f: JaggedTensor.from_list([p[f] for p in payloads]) for f in TRAJECTORY_FIELDS}
        routing = [routed_experts(t.turn_extras, len(p["input_ids"])) for t, p in zip(trajectories, payloads)]
        if any(r is not None for r in routing):  # the engine returned routed experts (router replay R3)
            columns["routed_experts"] = JaggedTensor.from_list(fill_unrouted(routing, payloads))
        await self.store.put_jagged_async(keys, columns)
        return [record(t, k, sid, self.decode_model_tokens(t)) for t, k, sid in zip(trajectories, keys, sessions)]

    def decode_model_tokens(self, traj: Trajectory) -> str:
        """The text the reward judges: the model's tokens only (tool observations are not the model's answer)."""
        model_ids = [i for i, m in zip(traj.response_ids, traj.response_mask) if m]
        return self.tokenizer.decode(model_ids, skip_special_tokens=True)

    def replica_failures(self) -> int:
        """Calls of this worker's sessions that failed with their replica (each retried, or the session failed)."""
        return self.loop.client.replica_failures


class AgentLoopManager:
    def __init__(self, num_workers: int, tokenizer_path: str, balancer: Any, loop: str = "single_turn",
                 max_response_length: int = 256, tools: list[str] | None = None, max_turns: int = 4,
                 policy: FaultPolicy | None = None, fully_async: bool = False,
                 store: SampleStore | None = None) -> None:
        """`store`: where payloads go (the trainer's); without one the manager makes and owns its own."""
        self.policy = policy or FaultPolicy()
        self.owns_store = store is None
        self.store = SampleStore.create() if store is None else store
        remote = ray.remote(AgentLoopWorker).options(num_cpus=0, max_concurrency=1024)
        self.workers = [
            remote.remote(tokenizer_path, balancer, loop, max_response_length, self.store, tools, max_turns,
                          self.policy, fully_async)
            for _ in range(num_workers)
        ]
        self._next_worker = 0

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every worker has started (tokenizer loaded, store connected): the workers start while
        whatever the caller starts next does, instead of inside the first generation round."""
        refs = {f"agent-loop worker {i}": w.__ray_ready__.remote() for i, w in enumerate(self.workers)}
        wait_within(refs, timeout_s, "start of the agent-loop workers", "timeout_s")
        ray.get(list(refs.values()))  # a constructor's error is raised here

    def submit(self, sample: dict[str, Any], n: int, sampling: dict[str, Any]) -> ray.ObjectRef:
        """The `n` records of one sample, without waiting (workers take turns): a ref to the list."""
        worker = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        return worker.generate.remote([sample], n, sampling)

    def generate(self, samples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Records of every sample (n each, grouped by sample, in sample order); payloads in the store."""
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
        if self.owns_store:
            self.store.shutdown()


def _offset(seed: int | None, by: int) -> int | None:
    return None if seed is None else seed + by
