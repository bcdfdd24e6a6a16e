"""Engine benchmark (one GPU): actor-update throughput against raw megatron-core, and log-prob path memory.

1. Throughput. The same Qwen3-shaped bf16 model and the same tokens (rows of equal length, so Megatron's stock
   local spec can run them) through
     raw:   GPTModel with the stock local spec (DotProductAttention), `model(ids, pos, None, labels=...)`,
            per-token cross entropy mean, backward; one [b, s] micro-batch after another;
     actor: MegatronEngine.forward_backward (packed THD micro-batches under a token budget, SdpaAttention,
            chunked vocab-parallel log-probs, injected token-mean policy-gradient loss, Megatron DDP buffers).
   Reported: tokens/s of each (median of timed iterations after warm-up) and actor/raw (goal ≥ 0.95).
2. Memory. Per-token log-probs of T tokens at vocabulary V: peak CUDA memory above the inputs for
     materialised: (h Wᵀ).float() → log_softmax → gather   (what a naive trainer does)
     chunked:      mrl.engine.megatron.logprob.vocab_parallel_logprobs (forward, and forward+backward)
   Reported: bytes and chunked/materialised (goal ≤ 0.25).

Prints one JSON object (and writes it to --out). Usage: python tools/bench/engine.py --out result.json
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

MODEL = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)


def make_model(folder: str, vocab: int) -> str:
    from mrl.models.tiny import make_tiny_hf_model

    return str(
        make_tiny_hf_model(
            "qwen3",
            folder,
            tokenizer=False,
            vocab_size=vocab,
            dtype=torch.bfloat16,
            init_std=0.02,
            max_position_embeddings=8192,
            **MODEL,
        )
    )


def timed(fn: Any, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def bench_throughput(rank: int, world: int, path: str, rows: int, seq: int, mb_rows: int, iters: int) -> dict:
    from megatron.core import parallel_state

    from mrl.algo.aggregation import agg_loss
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.model import build_model
    from mrl.engine.megatron.packing import JaggedBatch

    engine = MegatronEngine(
        path,
        MegatronConfig(params_dtype="bfloat16"),
        OptimConfig(lr=1e-6),
        micro_batch_size=None,
        max_tokens_per_micro_batch=mb_rows * seq,
    )
    engine.initialize()
    vocab = engine.bridge.model_kwargs()["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    batch = JaggedBatch.from_sequences(
        [{"input_ids": r, "response_mask": torch.ones(seq), "advantages": torch.randn(seq, generator=g)} for r in ids]
    )

    def loss_fn(outputs, mb, normalizer):
        return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}

    def actor_step() -> None:
        engine.forward_backward(batch, loss_fn)
        engine._zero_grads()

    torch.cuda.reset_peak_memory_stats()
    actor = timed(actor_step, iters, 2)
    actor_peak = torch.cuda.max_memory_allocated()

    # The raw baseline: stock local spec, same TransformerConfig, same tokens as [mb_rows, seq] micro-batches.
    engine.to("cpu")  # frees its parameter, gradient and optimizer memory for the baseline
    torch.cuda.empty_cache()
    raw = build_model(_config_for_raw(path), _kwargs(path), use_te=False)[0]
    pos = torch.arange(seq, device="cuda").expand(mb_rows, -1)
    cuda_ids = ids.cuda()

    def raw_step() -> None:
        for i in range(0, rows, mb_rows):
            x = cuda_ids[i : i + mb_rows]
            labels = torch.roll(x, -1, dims=1)
            raw(x, pos, None, labels=labels).float().mean().backward()
        raw.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    raw_t = timed(raw_step, iters, 2)
    raw_peak = torch.cuda.max_memory_allocated()
    tokens = rows * seq
    parallel_state.destroy_model_parallel()
    return {
        "tokens_per_step": tokens,
        "actor_tokens_per_s": tokens / statistics.median(actor),
        "raw_tokens_per_s": tokens / statistics.median(raw_t),
        "actor_over_raw": statistics.median(raw_t) / statistics.median(actor),
        "actor_peak_gib": actor_peak / 2**30,
        "raw_peak_gib": raw_peak / 2**30,
        "actor_step_s": actor,
        "raw_step_s": raw_t,
    }


def _kwargs(path: str) -> dict:
    from transformers import AutoConfig

    from bridges.registry import bridge_for

    return bridge_for(AutoConfig.from_pretrained(path)).model_kwargs()


def _config_for_raw(path: str) -> Any:
    from transformers import AutoConfig

    from bridges.registry import bridge_for
    from mrl.engine.megatron.model import runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout

    bridge = bridge_for(AutoConfig.from_pretrained(path))
    return bridge.transformer_config(**runtime_config(ParallelLayout(), params_dtype=torch.bfloat16))


def bench_logprob_memory(tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    from mrl.engine.megatron.logprob import vocab_parallel_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 0.02 * torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def peak(fn: Any) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def materialised(backward: bool) -> None:
        hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logp = torch.log_softmax((hh @ ww.t()).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
            if backward:
                logp.sum().backward()

    def chunked(backward: bool) -> None:
        hh, ww = h.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logp, _ = vocab_parallel_logprobs(hh, ww, labels, chunk_tokens=chunk)
            if backward:
                logp.sum().backward()

    with torch.no_grad():
        ref = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
        got, _ = vocab_parallel_logprobs(h, w, labels, chunk_tokens=chunk)
    out = {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "chunk_tokens": chunk,
        "fp32_logits_gib": tokens * vocab * 4 / 2**30,
        "max_abs_diff_vs_materialised": float((got - ref).abs().max()),
    }
    for mode in (False, True):
        m, c = peak(lambda mode=mode: materialised(mode)), peak(lambda mode=mode: chunked(mode))
        key = "fwd_bwd" if mode else "fwd"
        out[f"{key}_materialised_gib"] = m / 2**30
        out[f"{key}_chunked_gib"] = c / 2**30
        out[f"{key}_ratio"] = c / m
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb-rows", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--logprob-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/bench/engine.py needs CUDA")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": MODEL}
    result["logprob_memory"] = bench_logprob_memory(args.logprob_tokens, MODEL["hidden_size"], args.vocab, args.chunk)
    print(json.dumps(result["logprob_memory"]), flush=True)
    from mrl.utils.distributed import launch

    with tempfile.TemporaryDirectory() as folder:
        path = make_model(os.path.join(folder, "model"), args.vocab)
        result["throughput"] = launch(
            bench_throughput, 1, path, args.rows, args.seq, args.mb_rows, args.iters, timeout_s=540
        )[0]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
