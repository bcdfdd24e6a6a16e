"""Export throughput of the bridge at TP=1 against a device-to-device copy of the same bytes, in one run.

    python tools/bench/bridge_export.py --tiny                  # CPU, tiny shapes (gloo, one process)
    python tools/bench/bridge_export.py --shapes 1.5b 7b        # GPU: Qwen2.5-1.5B / 7B shapes, random bf16

For each shape a Megatron GPTModel is built with random weights (no checkpoint) and exported three ways:
- `stream`: iterate `bridge.export(...)` (HF names, QKV/gate-up split as views, no copy): the bridge's overhead;
- `packed`: `bridge.export_buckets(...)` packed into flat bucket buffers, as a weight sync must do (one copy);
- `d2d`: one device copy of a flat buffer of the same byte count: the floor for `packed`.
GB/s = exported HF bytes / seconds (1 GB = 1e9 bytes). Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

# HF config fields of the measured shapes (Qwen2.5 family: GQA with q/k/v biases).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: builds the export plan and bucket bounds once
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape: str, dtype: torch.dtype, bucket_bytes: int, repeats: int) -> dict[str, Any]:
    from transformers import Qwen2Config

    from bridges import bridge_for
    from mrl.engine.megatron.model import build_model, runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout

    hf_config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, architectures=["Qwen2ForCausalLM"])
    bridge = bridge_for(hf_config)
    config = bridge.transformer_config(
        **runtime_config(ParallelLayout(), params_dtype=dtype), perform_initialization=False
    )
    chunks = build_model(config, bridge.model_kwargs())
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.normal_(0.0, 0.02)
    sizes = [t.numel() * t.element_size() for _, t in bridge.export(chunks, dtype=dtype)]
    exported = sum(sizes)

    def stream() -> None:
        for _name, tensor in bridge.export(chunks, dtype=dtype):
            del tensor

    device = next(chunks[0].parameters()).device
    # A tensor larger than the bucket forms a bucket of its own, so the buffer holds at least the largest one.
    buffer = torch.empty(max(bucket_bytes, max(sizes)), dtype=torch.uint8, device=device)

    def packed() -> None:
        for bucket in bridge.export_buckets(chunks, bucket_bytes, dtype=dtype):
            offset = 0
            for _name, tensor in bucket:
                nbytes = tensor.numel() * tensor.element_size()
                buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                offset += nbytes

    source = torch.empty(exported, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def d2d() -> None:
        target.copy_(source)

    times = {name: _best(fn, repeats) for name, fn in (("stream", stream), ("packed", packed), ("d2d", d2d))}
    result: dict[str, Any] = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": exported,
        "tensors": len(sizes),
        "bucket_bytes": bucket_bytes,
    }
    for name, seconds in times.items():
        result[f"{name}_ms"] = round(seconds * 1e3, 3)
        result[f"{name}_GBps"] = round(exported / seconds / 1e9, 2)
    result["packed_vs_d2d"] = round(times["packed"] / times["d2d"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--shapes", nargs="+", default=["1.5b", "7b"], choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from mrl.engine.megatron.parallel import ParallelLayout, init_distributed, initialize_model_parallel, teardown

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from mrl.utils.distributed import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    init_distributed(0, 1)
    initialize_model_parallel(ParallelLayout())
    shapes = ["tiny"] if args.tiny else args.shapes
    bucket_bytes = (1 if args.tiny else args.bucket_mb) * 1024**2
    for shape in shapes:
        print(json.dumps(measure(shape, getattr(torch, args.dtype), bucket_bytes, args.repeats)), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the previous shape's model is garbage once measure() returns
    teardown()


if __name__ == "__main__":
    main()
