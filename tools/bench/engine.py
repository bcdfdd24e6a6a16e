"""Engine benchmark (one GPU): actor-update speed against Megatron's stock local spec, and log-prob path memory.

1. Throughput, per Qwen-shaped bf16 model (0.6B- and 1.5B-shaped, or a Qwen3-MoE shape of mrl.models.tiny:
   moe2.6b, moe2.9b) and workload (rows × length, or a packed batch of mixed lengths), in the same process:
     local: GPTModel with the stock local spec (DotProductAttention, S×S scores), `model(ids, pos, None,
            labels=...)`, per-token cross entropy mean, backward; one [rows, length] micro-batch after another
            (equal-length rows only: the local spec cannot take packed sequences);
     ours:  MegatronEngine.forward_backward (packed THD micro-batches under a token budget, SdpaAttention with
            the variable-length flash kernel, chunked vocab-parallel log-probs, a token-mean policy-gradient
            loss, Megatron DDP buffers and gradient reduction).
   Both use the same TransformerConfig (including the CUDA-only fusions of mrl.engine.megatron.model).
   Reported: tokens/s, TFLOP/s and MFU (the trainer's count, mrl.trainer.metrics.ModelFlops: 6·N + 12·L·H·Q·T per
   token, N the parameters a token passes through (MoE: its active experts; the output layer, tied or not; not the
   input embedding), L layers, H heads, Q head dim, T the document's length; MFU against the device's dense bf16
   peak, as the trainer's perf/mfu: 989 TFLOP/s on an H100 or H200. Before 2026-12-06 this script counted a tied
   output layer out and divided by 790, the GEMM rate measured on the H200), peak memory, and ours/local (the
   issue-3 goal is ≥ 0.95; MoE shapes have no local run, whose spec is ours).
   `--variants` also times ours with one speed-up switched off at a time (MoE shapes: also the stock all-to-all
   dispatcher and the loop over experts); `--profile` prints the top CUDA kernels of one step of ours;
   `--with-optimizer` also times the update's whole step (forward, backward and the optimizer step), the step whose
   MFU the trainer's update reports.
2. Memory. Per-token log-probs of T tokens at vocabulary V: peak CUDA memory above the inputs for
     materialised: (h Wᵀ).float() → log_softmax → gather   (what a naive trainer does)
     chunked:      mrl.engine.megatron.logprob.vocab_parallel_logprobs (forward; forward+backward with the
                   logits kept and recomputed)
   Reported per token count and chunk size (default: the engine's defaults, logits kept within the engine's
   default budget): bytes and chunked/materialised (goal ≤ 0.25).

Prints tables and writes the raw results as JSON to --out. Usage: python tools/bench/engine.py --out r.json
(`--smoke` runs tiny fp32 shapes on CPU to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

VOCAB = 151936
SHAPES = {
    "0.6B": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
    ),
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
SHAPES["smoke-moe"] = dict(SHAPES["smoke"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# name → (document lengths of one step, token budget of one micro-batch of ours, rows per local micro-batch)
WORKLOADS = {
    "4x2048": ([2048] * 8, 8192, 4),
    "2x4096": ([4096] * 4, 8192, 2),
    # Mixed lengths as RL rollouts give them (seeded): ~16k tokens, two or three packed micro-batches.
    "packed": ([3100, 220, 1750, 4096, 610, 2900, 95, 1280, 3333, 480, 1900], 8192, 0),
    # The MoE GPU step's shape (tools/bench/e2e_gpu.py): 1k-token responses, 16k-token micro-batches.
    "32x1024": ([1024] * 32, 16384, 0),
    "32x1024-32k": ([1024] * 32, 32768, 0),  # the same step in micro-batches twice as large
    "32x1024-8k": ([1024] * 32, 8192, 0),  # half as large: room for the optimizer state on an 80 GB device
}
SMOKE_WORKLOADS = {"4x2048": ([32] * 4, 64, 2), "packed": ([40, 7, 25, 60, 13], 64, 0)}


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if cuda() else float("nan")


def reset_peak() -> None:
    if cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed(fn: Any, iters: int, warmup: int) -> float:
    """Median seconds of `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def make_model(folder: str, shape: str, vocab: int) -> str:
    from mrl.models.tiny import QWEN3_MOE_SHAPES, make_tiny_hf_model

    dims = {"vocab_size": vocab, "max_position_embeddings": 8192, **(QWEN3_MOE_SHAPES.get(shape) or SHAPES[shape])}
    return str(
        make_tiny_hf_model(
            "qwen3_moe" if "num_experts" in dims else "qwen3",
            folder,
            tokenizer=False,
            dtype=torch.bfloat16 if cuda() else torch.float32,
            init_std=0.02,
            **dims,
        )
    )


def bench_model(rank: int, world: int, path: str, workloads: dict, opts: dict) -> dict:
    """All workloads of one model: ours (engine) first, then the stock local spec on the freed memory."""
    from megatron.core import parallel_state

    from mrl.algo.aggregation import agg_loss
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron import attention, logprob
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.trainer.metrics import ModelFlops, peak_flops

    dtype = "bfloat16" if cuda() else "float32"
    engine = MegatronEngine(
        path,
        MegatronConfig(params_dtype=dtype),
        OptimConfig(lr=1e-6),
        micro_batch_size=None,
        max_tokens_per_micro_batch=max(budget for _, budget, _ in workloads.values()),
    )
    engine.initialize()
    config = engine.tf_config
    model = engine.unwrapped()[0]
    n_params = sum(p.numel() for p in model.parameters()) - model.embedding.word_embeddings.weight.numel()
    vocab = engine.bridge.model_kwargs()["vocab_size"]
    flops = ModelFlops.from_model_path(path)
    device_peak = peak_flops(torch.cuda.get_device_name() if cuda() else "CPU", None)

    def loss_fn(outputs, mb, normalizer):
        return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}

    g = torch.Generator().manual_seed(0)
    batches = {}
    for name, (lengths, _, _) in workloads.items():
        batches[name] = JaggedBatch.from_sequences(
            [
                {
                    "input_ids": torch.randint(0, vocab, (n,), generator=g),
                    "response_mask": torch.ones(n),
                    "advantages": torch.randn(n, generator=g),
                }
                for n in lengths
            ]
        )

    def actor_step(name: str, optimizer: bool = False) -> None:
        """Forward and backward of a workload; with `optimizer`, the update's whole step (the optimizer step
        too: clip, Adam, and the fp32 master copies' cast back)."""
        engine.max_tokens = workloads[name][1]
        engine.forward_backward(batches[name], loss_fn)
        if optimizer:
            engine.optimizer_step()
        else:
            engine._zero_grads()

    def row(name: str, seconds: float, peak: float) -> dict:
        lengths = workloads[name][0]
        tflops = 3 * flops.forward(lengths) / seconds / 1e12
        return {
            "tokens_per_s": sum(lengths) / seconds,
            "tflops": tflops,
            "mfu": tflops * 1e12 / device_peak,
            "peak_gib": peak,
            "step_s": seconds,
        }

    out: dict[str, Any] = {"n_params": n_params, "flops_params": flops.params, "ours": {}, "local": {}, "variants": {},
                           "update": {}}
    for key, optimizer in [("ours", False)] + ([("update", True)] if opts["with_optimizer"] else []):
        for name in workloads:
            reset_peak()
            try:
                seconds = timed(lambda n=name, o=optimizer: actor_step(n, o), opts["iters"], opts["warmup"])
            except torch.OutOfMemoryError as e:  # the larger micro-batches may not fit: the other rows still count
                out[key][name] = {"error": f"out of memory: {str(e)[:120]}"}
                engine._zero_grads()
            else:
                out[key][name] = row(name, seconds, peak_gib())
            print(f"  {key} {name}: {out[key][name]}", flush=True)

    if opts["variants"]:
        name = opts["variant_workload"]
        switches = {
            "per-document SDPA (no varlen flash)": [(attention, "FLASH_VARLEN", False)],
            "RMSNorm eager (not compiled)": [(attention, "COMPILE_NORM", False)],
            "log-prob elementwise eager (no torch.compile)": [(logprob, "COMPILE_ELEMENTWISE", False)],
            "logits recomputed in backward": [(engine.cfg, "logprob_keep_logits_gib", 0.0)],
            **moe_switches(engine.model),
        }
        for label, triples in switches.items():
            befores = [getattr(obj, attr) for obj, attr, _ in triples]
            for obj, attr, value in triples:
                setattr(obj, attr, value)
            try:
                reset_peak()
                out["variants"][label] = row(name, timed(lambda: actor_step(name), opts["iters"], 1), peak_gib())
            finally:
                for (obj, attr, _), before in zip(triples, befores):
                    setattr(obj, attr, before)
            print(f"  variant {label}: {out['variants'][label]}", flush=True)
        for chunk in opts["chunks"]:
            before, engine.chunk_tokens = engine.chunk_tokens, chunk
            reset_peak()
            out["variants"][f"chunk_tokens={chunk}"] = row(
                name, timed(lambda: actor_step(name), opts["iters"], 1), peak_gib()
            )
            engine.chunk_tokens = before
            print(f"  variant chunk {chunk}: {out['variants'][f'chunk_tokens={chunk}']}", flush=True)

    if opts["profile"] and cuda():
        from torch.profiler import ProfilerActivity, profile

        name = opts["variant_workload"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            actor_step(name)
            sync()
        out["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        print(out["profile"], flush=True)

    if config.num_moe_experts:
        parallel_state.destroy_model_parallel()
        return out  # the local spec's MoE layers are ours (grouped experts), no baseline
    # The stock local spec on the same TransformerConfig, after freeing the engine's memory.
    engine.to("cpu")  # frees its parameters, gradients and optimizer state on the device
    model = None
    reset_peak()
    from mrl.engine.megatron.model import build_model

    local = build_model(config, _kwargs(path), use_te=False)[0]
    device = next(local.parameters()).device
    for name, (lengths, _, rows) in workloads.items():
        if not rows:
            continue
        ids = torch.cat([b for b in batches[name].token_fields["input_ids"].split(lengths)]).view(-1, lengths[0])
        ids = ids.to(device)
        pos = torch.arange(lengths[0], device=device).expand(rows, -1)

        def local_step(ids: torch.Tensor = ids, pos: torch.Tensor = pos, rows: int = rows) -> None:
            for i in range(0, ids.shape[0], rows):
                x = ids[i : i + rows]
                local(x, pos, None, labels=torch.roll(x, -1, dims=1)).float().mean().backward()
            local.zero_grad(set_to_none=True)

        reset_peak()
        try:
            out["local"][name] = row(name, timed(local_step, opts["iters"], opts["warmup"]), peak_gib())
        except torch.OutOfMemoryError as e:
            out["local"][name] = {"error": f"out of memory: {str(e)[:120]}"}
            local.zero_grad(set_to_none=True)
        print(f"  local {name}: {out['local'][name]}", flush=True)
    parallel_state.destroy_model_parallel()
    return out


def moe_switches(chunks: list[Any]) -> dict[str, list[tuple[Any, str, Any]]]:
    """The MoE speed-ups as variant switches: the in-rank dispatcher (back to Megatron's all-to-all one) and the
    grouped GEMMs (back to SequentialMLP's loop). Empty for a dense model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mrl.engine.megatron.grouped_experts import GroupedGemmExperts, InRankTokenDispatcher

    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    if not layers:
        return {}
    in_rank = [m.token_dispatcher for m in layers if isinstance(m.token_dispatcher, InRankTokenDispatcher)]
    return {
        "stock all-to-all dispatcher (host sync, identity sort, atomics)": [
            (d, "__class__", MoEAlltoAllTokenDispatcher) for d in in_rank
        ],
        "stock dispatcher and the loop over experts (SequentialMLP)": [
            *((d, "__class__", MoEAlltoAllTokenDispatcher) for d in in_rank),
            (GroupedGemmExperts, "_grouped", lambda self, hidden: False),
        ],
    }


def _kwargs(path: str) -> dict:
    from transformers import AutoConfig

    from bridges.registry import bridge_for

    return bridge_for(AutoConfig.from_pretrained(path)).model_kwargs()


def bench_logprob_memory(tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """Peaks of one T-token log-prob pass: materialised vs chunked with the engine's keep budget and recomputing."""
    from mrl.engine.megatron.logprob import DEFAULT_KEEP_LOGITS_BYTES, vocab_parallel_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 0.02 * torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    coeff = torch.randn(tokens, device="cuda", generator=g)

    def peak(fn: Any) -> int:
        fn()  # warm-up: compiled kernels and their workspaces are not part of the path's steady state
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def materialised(backward: bool) -> None:
        hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logp = torch.log_softmax((hh @ ww.t()).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
            if backward:
                (logp * coeff).sum().backward()
                grads["materialised"] = (hh.grad, ww.grad)

    def chunked(backward: bool, keep: int, key: str) -> None:
        hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logp, _ = vocab_parallel_logprobs(hh, ww, labels, chunk_tokens=chunk, keep_logits_bytes=keep)
            if backward:
                (logp * coeff).sum().backward()
                grads[key] = (hh.grad, ww.grad)

    with torch.no_grad():
        ref = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
        got, _ = vocab_parallel_logprobs(h, w, labels, chunk_tokens=chunk)
    keep_default = DEFAULT_KEEP_LOGITS_BYTES
    out: dict[str, Any] = {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "chunk_tokens": chunk,
        "keep_logits_gib": keep_default / 2**30,
        "logits_kept": tokens * vocab * 2 <= keep_default,
        "fp32_logits_gib": tokens * vocab * 4 / 2**30,
        "max_abs_diff_vs_materialised": float((got - ref).abs().max()),
    }
    fwd_m = peak(lambda: materialised(False))
    fwd_c = peak(lambda: chunked(False, 0, "fwd"))
    out.update(fwd_materialised_gib=fwd_m / 2**30, fwd_chunked_gib=fwd_c / 2**30, fwd_ratio=fwd_c / fwd_m)
    bwd_m = peak(lambda: materialised(True))
    for key, keep in (("recompute", 0), ("default_keep", keep_default)):
        c = peak(lambda keep=keep, key=key: chunked(True, keep, key))
        out[f"fwd_bwd_{key}_gib"] = c / 2**30
        out[f"fwd_bwd_{key}_ratio"] = c / bwd_m
        rel = [
            float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads[key], grads["materialised"])
        ]
        out[f"fwd_bwd_{key}_grad_rel_err"] = rel
    out["fwd_bwd_materialised_gib"] = bwd_m / 2**30
    grads.clear()
    return out


def print_memory_table(rows: list[dict]) -> None:
    print("\n| tokens | chunk | fp32 logits GiB | fwd: materialised / chunked GiB (ratio) | fwd+bwd: materialised GiB "
          "| chunked, default keep GiB (ratio) | chunked, recompute GiB (ratio) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        kept = "kept" if r["logits_kept"] else "over budget: recomputed"
        print(f"| {r['tokens']} | {r['chunk_tokens']} | {r['fp32_logits_gib']:.2f} | {r['fwd_materialised_gib']:.2f} / "
              f"{r['fwd_chunked_gib']:.2f} ({r['fwd_ratio']:.3f}) | {r['fwd_bwd_materialised_gib']:.2f} | "
              f"{r['fwd_bwd_default_keep_gib']:.2f} ({r['fwd_bwd_default_keep_ratio']:.3f}, {kept}) | "
              f"{r['fwd_bwd_recompute_gib']:.2f} ({r['fwd_bwd_recompute_ratio']:.3f}) |")


def print_tables(result: dict) -> None:
    print(
        "\n| model | workload | tokens | ours tok/s | ours TFLOP/s | ours MFU | ours peak GiB | local tok/s | "
        "local TFLOP/s | local MFU | local peak GiB | ours/local |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, r in result["models"].items():
        for name, ours in r["ours"].items():
            if "error" in ours:
                print(f"| {shape} | {name} | {ours['error']} |")
                continue
            local = r["local"].get(name, {})
            tokens = sum(result["workloads"][name][0])
            if "tokens_per_s" in local:
                cols = (
                    f"{local['tokens_per_s']:,.0f} | {local['tflops']:.0f} | {local['mfu']:.1%} | "
                    f"{local['peak_gib']:.1f} | {ours['tokens_per_s'] / local['tokens_per_s']:.2f}×"
                )
            else:
                cols = f"{local.get('error', 'n/a (packed)')} | | | | "
            print(
                f"| {shape} | {name} | {tokens} | {ours['tokens_per_s']:,.0f} | {ours['tflops']:.0f} | "
                f"{ours['mfu']:.1%} | {ours['peak_gib']:.1f} | {cols} |"
            )
    for shape, r in result["models"].items():
        for name, update in r.get("update", {}).items():
            fb = r["ours"].get(name, {})
            if "error" in update or "error" in fb:
                print(f"update's whole step, {shape} {name}: {update.get('error') or fb.get('error')}")
                continue
            print(f"update's whole step (forward, backward, optimizer step), {shape} {name}: "
                  f"{update['tokens_per_s']:,.0f} tok/s, MFU {update['mfu']:.1%} (forward and backward alone "
                  f"{fb['mfu']:.1%}; the optimizer step {update['step_s'] - fb['step_s']:.3f} s), "
                  f"peak {update['peak_gib']:.1f} GiB")
    for shape, r in result["models"].items():
        if r["variants"]:
            print(f"\nvariants of ours, {shape}, {result['variant_workload']} (one switch off at a time):")
            print("| variant | tok/s | TFLOP/s | MFU | peak GiB |\n|---|---|---|---|---|")
            base = r["ours"][result["variant_workload"]]
            for label, v in {"all on": base, **r["variants"]}.items():
                print(
                    f"| {label} | {v['tokens_per_s']:,.0f} | {v['tflops']:.0f} | {v['mfu']:.1%} | {v['peak_gib']:.1f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6B,1.5B")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default="", help="shapes (comma-separated) whose variants are timed")
    parser.add_argument("--variant-workload", default="2x4096")
    parser.add_argument("--chunks", default="", help="extra log-prob chunk sizes timed as variants, e.g. 1024")
    parser.add_argument("--profile", default="", help="shapes whose step is profiled")
    parser.add_argument("--logprob-tokens", default="8192,16384", help="token counts of the memory table")
    parser.add_argument("--logprob-chunks", default="", help="chunk sizes of the memory table (default: engine's)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also time the update's whole step (forward, backward and the optimizer step)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU: checks the script only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not cuda() and not args.smoke:
        raise SystemExit("tools/bench/engine.py needs CUDA (or --smoke)")
    shapes = ["smoke", "smoke-moe"] if args.smoke else [s for s in args.shapes.split(",") if s]
    workloads = SMOKE_WORKLOADS if args.smoke else {k: WORKLOADS[k] for k in args.workloads.split(",")}
    vocab = 512 if args.smoke else VOCAB
    variant_workload = "4x2048" if args.smoke else args.variant_workload
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda() else "cpu",
        "workloads": workloads,
        "variant_workload": variant_workload,
        "models": {},
    }
    if cuda():
        from mrl.engine.megatron.logprob import DEFAULT_CHUNK_TOKENS

        chunks = [int(c) for c in args.logprob_chunks.split(",") if c] or [DEFAULT_CHUNK_TOKENS]
        result["logprob_memory"] = []
        for tokens in (int(t) for t in args.logprob_tokens.split(",") if t):
            for chunk in chunks:
                result["logprob_memory"].append(bench_logprob_memory(tokens, 1024, vocab, chunk))
                print(json.dumps(result["logprob_memory"][-1]), flush=True)
                torch.cuda.empty_cache()
        print_memory_table(result["logprob_memory"])
    from mrl.utils.distributed import launch

    for shape in shapes:
        opts = dict(
            iters=args.iters,
            warmup=args.warmup,
            variants=args.smoke or shape in args.variants.split(","),
            variant_workload=variant_workload,
            chunks=[int(c) for c in args.chunks.split(",") if c],
            profile=shape in args.profile.split(","),
            with_optimizer=args.with_optimizer or args.smoke,
        )
        print(f"== {shape}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            path = make_model(os.path.join(folder, "model"), shape, vocab)
            result["models"][shape] = launch(bench_model, 1, path, workloads, opts, timeout_s=900)[0]
    print_tables(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
