"""Where FP8 rollout's time goes (issue 38): a vLLM decode step's GPU kernels, BF16 against FP8, and the trainer's
quantise-on-send pass against a plain device copy of the same weights, in one run.

Generation: per variant (a subprocess each, so one engine's memory never meets the next), an in-process vLLM
engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs in this process, where torch's profiler sees its
kernels) built by the vllm adapter from the arguments mrl's replica gets (CUDA graphs on, as in a run). For each
size of `--batch` in turn (several show where FP8 starts to pay), it takes that many requests of
`--response-length` tokens (EOS ignored, the sampled token's log-prob returned, as the trainer asks) and is stepped
by hand, with no device sync between steps (vLLM schedules a step while the last one runs); `--profile-steps` steps
of the middle of the run (mean context about half the response) are profiled, and their wall time is taken with
the device drained at both ends. Kernels are grouped by name (gemm, attention, fp8 activation quantisation,
sampling and log-probs, norms and activations, other); the table gives ms per step per group, the GPU's busy share
of the wall time, and the ceiling that an infinitely fast GEMM would give (wall / (wall - gemm)): if that ceiling
is under 1.2, FP8 GEMMs alone cannot bring generation to 1.2x at that batch.

Quantise pass: the policy's linear weights (the tensors `rollout.quantization=fp8` quantises) on the device,
through `mrl.weight_sync.fp8.quantize` one by one (on a GPU the fused kernel), through the torch quantiser, and
`clone()` of the same tensors (what a BF16 send costs at least), medians of `--repeats`.

    python tools/bench/fp8_profile.py --shape 1.5b --variants bf16 fp8kvc        # a GPU machine
    python tools/bench/fp8_profile.py --shape 1.5b --batch 256 512 --gpu-memory-utilization 0.8  # two batches
    python tools/bench/fp8_profile.py                                            # CPU: a smoke check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e_gpu import make_task  # same folder: the GPU benchmark's model

for _key, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)

# Adapter settings per variant (as e2e_gpu.py's VARIANTS name them for a run).
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "fp8c": {"quantization": "fp8", "fp8_gemm": "cutlass"},
    "fp8kvc": {"quantization": "fp8", "fp8_gemm": "cutlass", "engine_kwargs": {"kv_cache_dtype": "fp8"}},
    "bf16kv": {"engine_kwargs": {"kv_cache_dtype": "fp8"}},
}
# Kernel name -> group; the first pattern that matches wins (attention before GEMMs: flash-decoding kernels are
# "splitkv"; CUTLASS's FP8 GEMM names carry "fp8" too).
GROUPS = (
    ("attention", re.compile(r"flash|attn|attention|fmha|paged|reshape_and_cache|kv_cache", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|wgmma|scaled_mm|splitkreduce|\bmm\b|_mm\b|::mm\b"
                        r"|addmm", re.I)),
    ("fp8 quant", re.compile(r"quant|fp8|group_", re.I)),
    ("sampling", re.compile(r"softmax|sort|topk|top_k|sampl|gumbel|exponential|argmax|logprob|cumsum|gather|"
                            r"scatter|index|max_|reduce", re.I)),
    ("norm/act", re.compile(r"rms|norm|silu|act_and_mul|rotary|rope|fused_add", re.I)),
)


def sync() -> None:
    """Wait for the device's queue (timings that end on the device)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def group_of(kernel: str) -> str:
    return next((name for name, pattern in GROUPS if pattern.search(kernel)), "other")


def engine(model: str, variant: str, args: argparse.Namespace) -> Any:
    import torch
    from vllm import LLM

    from rollout_adapters.vllm.adapter import VLLMAdapter

    on_gpu = torch.cuda.is_available()
    adapter = VLLMAdapter(model, max_model_len=64 + args.response_length, dtype="bfloat16",
                          seed=1, gpu_memory_utilization=args.gpu_memory_utilization if on_gpu else None,
                          enable_sleep_mode=False, max_num_seqs=max(args.batch), **VARIANTS[variant])
    adapter.prepare_quantized_model()
    return LLM(**adapter.engine_args)


def profile_one(model: str, variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One variant's decode runs, one per batch size: wall ms per step, and the kernels of the profiled steps by
    group."""
    start = time.monotonic()
    llm = engine(model, variant, args)
    startup = time.monotonic() - start
    decoder = Decoder(llm, args.response_length)
    decoder.run(max(args.batch), 8)  # warm-up: the first steps of an engine pay one-off costs
    results = [decoder.measure(batch, args.profile_steps) | {"variant": variant, "startup_s": startup}
               for batch in args.batch]
    return results


class Decoder:
    """Steps an in-process engine by hand through batches of random prompts, each request `length` tokens long."""

    def __init__(self, llm: Any, length: int) -> None:
        import random

        self.core, self.length, self.rng = llm.llm_engine, length, random.Random(0)
        self.vocab = len(llm.get_tokenizer())  # the engine validates prompt ids against its tokenizer

    def run(self, batch: int, length: int, profiled: range | None = None) -> tuple[list[float], float, Any]:
        """Host seconds per step (no device sync between steps: vLLM schedules step k+1 while step k runs), and
        the wall ms per step over the `profiled` steps (device drained at both ends) with their profile."""
        import torch
        from torch.profiler import ProfilerActivity, profile
        from vllm import SamplingParams

        for i in range(batch):
            ids = [self.rng.randrange(3, self.vocab) for _ in range(32)]
            params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, logprobs=0, seed=i,
                                    detokenize=False)
            self.core.add_request(f"{length}-{i}-{self.rng.random()}", {"prompt_token_ids": ids}, params)
        steps, prof, step, window_ms, start = [], None, 0, float("nan"), 0.0
        while self.core.has_unfinished_requests():
            if profiled is not None and step == profiled.start:
                activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
                sync()
                prof = profile(activities=activities)
                prof.__enter__()
                start = time.perf_counter()
            t0 = time.perf_counter()
            self.core.step()
            steps.append(time.perf_counter() - t0)
            if prof is not None and step == profiled.stop - 1:
                sync()
                window_ms = 1e3 * (time.perf_counter() - start) / len(profiled)
                prof.__exit__(None, None, None)
            step += 1
        return steps, window_ms, prof

    def measure(self, batch: int, profile_steps: int) -> dict[str, Any]:
        """A timed decode of `batch` sequences, then a second one whose middle steps are profiled."""
        import torch

        t0 = time.perf_counter()
        steps, _, _ = self.run(batch, self.length)
        sync()
        total = time.perf_counter() - t0
        middle = self.length // 2
        window = range(middle, middle + profile_steps)
        _, wall_ms, prof = self.run(batch, self.length, window)
        kernels: dict[str, float] = {}
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
            if torch.cuda.is_available() and event.device_type.name == "CUDA" and device_us:
                kernels[event.key] = device_us / 1e3 / len(window)
            elif not torch.cuda.is_available() and event.self_cpu_time_total:
                kernels[event.key] = event.self_cpu_time_total / 1e3 / len(window)
        groups: dict[str, float] = {}
        for name, ms in kernels.items():
            group = group_of(name)
            groups[group] = groups.get(group, 0.0) + ms
        return {"batch": batch, "middle": middle, "gen_s": total, "tokens": batch * self.length,
                "tokens_per_s": batch * self.length / total,
                "step_ms_median": 1e3 * statistics.median(steps), "profiled_wall_ms": wall_ms,
                "device_ms": sum(kernels.values()), "groups_ms": groups,
                "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:15]}


def quantise_pass(model: str, repeats: int) -> dict[str, Any]:
    """Seconds to quantise every linear weight of `model` on the device (as a sync does, and with the torch
    quantiser), and to clone the same tensors."""
    import torch
    from safetensors.torch import load_file

    from mrl.weight_sync.fp8 import is_quantized, quantize, quantize_with_torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors = []
    for file in sorted(Path(model).glob("*.safetensors")):
        tensors += [t.to(device) for n, t in load_file(file).items() if is_quantized(n, t)]

    def timed(fn: Any) -> float:
        times = []
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            for t in tensors:
                fn(t)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"tensors": len(tensors), "gb": nbytes / 1e9, "quantize_s": timed(quantize),
            "torch_quantize_s": timed(quantize_with_torch), "clone_s": timed(torch.clone)}


def report(results: list[dict[str, Any]], quant: dict[str, Any] | None) -> None:
    for batch in dict.fromkeys(r["batch"] for r in results):
        report_batch([r for r in results if r["batch"] == batch])
    if quant:
        print(f"\nquantise pass: {quant['tensors']} linear weights, {quant['gb']:.2f} GB: quantize "
              f"{1e3 * quant['quantize_s']:.1f} ms (x{quant['quantize_s'] / quant['clone_s']:.2f} of a clone), torch "
              f"quantiser {1e3 * quant['torch_quantize_s']:.1f} ms "
              f"(x{quant['torch_quantize_s'] / quant['clone_s']:.2f}), clone {1e3 * quant['clone_s']:.1f} ms")


def report_batch(results: list[dict[str, Any]]) -> None:
    """The variants at one batch size, each against the first."""
    base = results[0]
    names = sorted({g for r in results for g in r["groups_ms"]}, key=lambda g: -base["groups_ms"].get(g, 0.0))
    head = " | ".join(f"{r['variant']:>9}" for r in results)
    print(f"\nms per decode step ({base['batch']} sequences, profiled steps around token {base['middle']}):")
    print(f"{'':<25} | {head}")
    for label, key in (("wall (profiled)", "profiled_wall_ms"), ("host (median, unprofiled)", "step_ms_median"),
                       ("device kernels", "device_ms")):
        print(f"{label:<25} | " + " | ".join(f"{r[key]:9.3f}" for r in results))
    for g in names:
        print(f"  {g:<23} | " + " | ".join(f"{r['groups_ms'].get(g, 0.0):9.3f}" for r in results))
    for r in results:
        gemm = r["groups_ms"].get("gemm", 0.0)
        wall = r["profiled_wall_ms"]
        speed = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['variant']}: {r['tokens_per_s']:.0f} tok/s ({r['gen_s']:.2f} s; x{speed:.3f} of {base['variant']}),"
              f" device busy {r['device_ms'] / wall:.0%} of the wall, gemm {gemm / wall:.0%}; "
              f"ceiling with free GEMMs x{wall / max(wall - gemm, 1e-9):.2f}; engine up in {r['startup_s']:.0f} s")
        print("  top kernels: " + "; ".join(f"{k[:60]} {v:.3f}" for k, v in r["top"][:8]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smoke", help="smoke (tiny, for CPUs), 0.5b, 1.5b or 7b")
    parser.add_argument("--variants", nargs="+", default=["bf16", "fp8kvc"], choices=sorted(VARIANTS))
    parser.add_argument("--batch", type=int, nargs="+", default=[256], help="sequences decoded together (each "
                        "size in turn, on the same engine)")
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="of the quantise pass")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--json", default="")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child: MODEL:VARIANT:OUT
    args = parser.parse_args()
    if args.one:
        model, variant, out = args.one.split(":")
        Path(out).write_text(json.dumps(profile_one(model, variant, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = make_task(Path(tmp), args.shape, seed=1, variants=[])["model"]
        results = []
        for variant in args.variants:
            out = Path(tmp) / f"{variant}.json"
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", f"{model}:{variant}:{out}"], check=True,
                           env=env)
            results += json.loads(out.read_text())
        quant = quantise_pass(model, args.repeats)
    report(results, quant)
    if args.json:
        Path(args.json).write_text(json.dumps({"generation": results, "quantise": quant}, indent=2))


if __name__ == "__main__":
    main()
