"""Per-device weight sync at trainer TP = k: what one device's sender moves with TP slices (`tp_slices`, engine TP =
trainer TP) against whole tensors, measured in the same run on every rank.

Each of k ranks (gloo on CPU, NCCL on GPUs) builds a Qwen2-shaped model with TP = k (random weights, bf16), then
times its export into a double-buffered `ipc` bucket ring on its own device (the sender's half of the per-device
sync: export → pack; no receiver), once with whole tensors (TP all-gathers) and once with TP slices. Reported per
rank: bytes packed, seconds, and the ratios sliced ÷ whole (bytes: ~1/k of the TP-split share; time: the gathers
saved). The receiver's side (the engine's loads) is not in it.

Usage: python tools/bench/weight_sync_per_device.py [--tp 2] [--shape tiny|7b] [--bucket-mb 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False)


def _pack(stream: Any, buffers: list[torch.Tensor]) -> int:
    from mrl.weight_sync.buckets import fill_buckets

    used = 0
    for _, _, _, nbytes in fill_buckets(stream, buffers, lambda k: None):
        used += nbytes
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return used


def run_rank(rank: int, world: int, shape: dict[str, Any], folder: str, bucket_bytes: int, repeats: int) -> dict:
    from transformers import AutoConfig, Qwen2Config

    from bridges.registry import bridge_for
    from mrl.engine.megatron.engine import build_chunks
    from mrl.engine.megatron.model import runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout, init_distributed, initialize_model_parallel

    if rank == 0:
        Qwen2Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16").save_pretrained(folder)
    init_distributed()
    torch.distributed.barrier()
    layout = ParallelLayout(tp=world)
    initialize_model_parallel(layout, seed=0)
    bridge = bridge_for(AutoConfig.from_pretrained(folder))
    chunks = build_chunks(bridge.transformer_config(**runtime_config(layout, params_dtype=torch.bfloat16)),
                          bridge.model_kwargs())
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    out: dict[str, Any] = {}
    for name, slices in (("whole", False), ("sliced", True)):
        _pack(bridge.export(chunks, tp_slices=slices), buffers)  # warm: plans, caches
        seconds = []
        for _ in range(repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            nbytes = _pack(bridge.export(chunks, tp_slices=slices), buffers)
            seconds.append(time.perf_counter() - start)
        out[name] = {"bytes": nbytes, "s": statistics.median(seconds)}
    out["bytes_ratio"] = out["sliced"]["bytes"] / out["whole"]["bytes"]
    out["time_ratio"] = out["sliced"]["s"] / out["whole"]["s"]
    return out


def main() -> None:
    from mrl.utils.distributed import launch

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", choices=("tiny", "7b"), default="7b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = QWEN2_7B if args.shape == "7b" else TINY
    with tempfile.TemporaryDirectory() as folder:
        per_rank = launch(run_rank, args.tp, shape, folder, args.bucket_mb << 20, args.repeats, timeout_s=1800)
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: whole {r['whole']['bytes'] / 1e6:.1f} MB in {r['whole']['s'] * 1e3:.1f} ms, sliced "
              f"{r['sliced']['bytes'] / 1e6:.1f} MB in {r['sliced']['s'] * 1e3:.1f} ms: bytes ×{r['bytes_ratio']:.3f}, "
              f"time ×{r['time_ratio']:.3f}")
    print(json.dumps({"tp": args.tp, "shape": args.shape, "per_rank": per_rank}))


if __name__ == "__main__":
    main()
