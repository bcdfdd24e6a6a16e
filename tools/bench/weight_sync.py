"""Weight-sync benchmark (GPU machine; multiprocessing, no Ray or vLLM): the `ipc` and `nccl` transports against one
device copy of the same bytes, measured in the same run.

A Qwen2-7B-shaped model (bf16, random weights) is built by the Megatron engine's own path (bridge config →
GPTModel chunks, local spec); its bridge export (the HF-named stream: convert) goes through a transport (pack)
into a receiver process that holds the model in an inference layout (fused qkv and gate_up, as vLLM keeps them)
and copies every tensor into place straight from the transport's buffers (load):
  ipc:  receiver on the same GPU, CUDA IPC buffers; swept over bucket sizes;
  nccl: receiver on GPU 1 (when there are two), a temporary NCCL group, bucketed broadcast; plus a raw broadcast
        of the same bytes in the same bucket sizes as its own baseline.
Reported: seconds from the first byte to the receiver's last load, GB/s and rate ÷ the device-copy rate (goal ≥ 0.33:
three copies' worth, convert + pack + load); apart, the per-sync group setup (rendezvous; nccl: communicator
creation) and teardown (nccl: communicator destruction).
On a CPU-only machine it runs a tiny shape (shared memory and gloo) to check the script.

`--one-copy` (weight_sync.one_copy): the sender shares its exported tensors' own memory instead of packing buckets
(mrl/weight_sync/handles.py) and the receiver copies each straight into its parameters: one device copy, goal ≥ 0.5×
the device-copy rate. Fused QKV's q/k/v go as row blocks of the trainer's linear_qkv (bridges/export.py), so the
sender copies nothing; `q/k/v copied` rows export them as contiguous tensors instead (the sender then stages them).
Rows: `ipc` (two copies), `ipc one-copy` and `ipc one-copy, q/k/v copied` into the receiver above (checked by
position-weighted sums of the embedding and layer 0's qkv_proj), then, unless --no-vllm, the same into a live vLLM
(random weights, sleep mode on as in hybrid runs, eager) whose worker extension loads them (one-copy: straight into
its parameter views, rollout_adapters/vllm/direct_load.py; two copies: today's layer-wise reload), each checked by
per-parameter sums read back from the engine. The Megatron parameters are first moved into
one flat buffer per dtype, as Megatron's DDP holds them with the distributed optimizer (the default), so the sync
shares a few storages, not one per tensor (--no-flat-params: one per tensor).

With --one-copy it also prints, per one-copy row, the best sync's timeline on the host's monotonic clock (the
sender's bucket announcements, the receiver's reads and its release of the mappings, the receiver's device span
from first to last copy), and the floor of the layout: the same copies in the sender's own process, no IPC, per
copy mode (handles.copy_all's default; every contiguous tensor batched; one copy_ each). --first-bucket-mb and
--copies sweep handles.FIRST_BUCKET_BYTES and the receiver's handles.BATCH_BELOW; --by-kind times each tensor's copy
with events and sums them per kind (where the host is behind the device, an interval is the host's launch time).

Usage: python tools/bench/weight_sync.py [--tiny] [--buckets-mb 64,256,1024] [--one-copy] [--out result.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from mrl.weight_sync.handles import BATCH_BELOW

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
# A stalled stage fails with the transport's error (stage, ranks) instead of eating the device lease.
SYNC_TIMEOUT_S = 60.0
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


# --copies: the receivers' handles.BATCH_BELOW (copies of fewer bytes go in multi-tensor batches)
COPY_MODES = {"default": BATCH_BELOW, "all_batched": 1 << 62, "per_tensor": 0}
# (one_copy, row_blocks) of the ipc rows: two copies; one copy; one copy with q/k/v exported as contiguous copies
VARIANTS = ((False, False), (True, True), (True, False))


def label(one_copy: bool, row_blocks: bool) -> str:
    return "ipc" if not one_copy else "ipc one-copy" if row_blocks else "ipc one-copy, q/k/v copied"


def _device(index: int = 0) -> torch.device:
    return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class InferenceModel:
    """Qwen2 weights as vLLM keeps them: qkv_proj (+bias) and gate_up_proj fused; `load` places an HF tensor."""

    def __init__(self, shape: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        hd = h // shape["num_attention_heads"]
        q, kv = h, shape["num_key_value_heads"] * hd
        self.params: dict[str, torch.Tensor] = {}
        self.slots: dict[str, tuple[str, int]] = {}  # hf name -> (param, first row)

        def add(name: str, *size: int) -> None:
            self.params[name] = torch.empty(*size, dtype=dtype, device=device)

        add("model.embed_tokens.weight", shape["vocab_size"], h)
        add("lm_head.weight", shape["vocab_size"], h)
        add("model.norm.weight", h)
        for i in range(layers):
            p = f"model.layers.{i}."
            add(p + "self_attn.qkv_proj.weight", q + 2 * kv, h)
            add(p + "self_attn.qkv_proj.bias", q + 2 * kv)
            add(p + "self_attn.o_proj.weight", h, q)
            add(p + "mlp.gate_up_proj.weight", 2 * inter, h)
            add(p + "mlp.down_proj.weight", h, inter)
            add(p + "input_layernorm.weight", h)
            add(p + "post_attention_layernorm.weight", h)
            for kind in ("weight", "bias"):
                for part, start in (("q", 0), ("k", q), ("v", q + kv)):
                    self.slots[f"{p}self_attn.{part}_proj.{kind}"] = (f"{p}self_attn.qkv_proj.{kind}", start)
            self.slots[p + "mlp.gate_proj.weight"] = (p + "mlp.gate_up_proj.weight", 0)
            self.slots[p + "mlp.up_proj.weight"] = (p + "mlp.gate_up_proj.weight", inter)
        self.loaded = 0
        self.views: dict[tuple[str, torch.Size], torch.Tensor] = {}

    def load(self, named: list[tuple]) -> None:
        """(name, tensor) or, one-copy, (name, row blocks [blocks, rows, *rest], ROW_BLOCKS) (handles.py)."""
        from bridges.export import ROW_BLOCKS
        from mrl.weight_sync.handles import copy_all

        pairs = []
        for name, tensor, *tags in named:
            key = (name, tensor.shape)
            if (dst := self.views.get(key)) is None:  # made once, like the vLLM loader's views
                blocks = bool(tags) and tags[-1] is ROW_BLOCKS
                target, start = self.slots.get(name, (name, None))
                param = self.params[target]
                rows = tensor.shape[0] * tensor.shape[1] if blocks else tensor.shape[0]
                dst = param if start is None else param.narrow(0, start, rows)
                dst = self.views[key] = dst.view(tensor.shape) if blocks else dst
            pairs.append((dst, tensor))
        copy_all(pairs)
        self.loaded += len(pairs)


def build_megatron(shape: dict[str, Any], folder: str) -> tuple[Any, list[torch.nn.Module]]:
    """The Megatron engine's construction path without reading weights (random init on the device)."""
    from transformers import AutoConfig, Qwen2Config

    from bridges.registry import bridge_for
    from mrl.engine.megatron.engine import build_chunks
    from mrl.engine.megatron.model import runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout, init_distributed, initialize_model_parallel

    Qwen2Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16").save_pretrained(folder)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    init_distributed(0, 1)
    initialize_model_parallel(ParallelLayout(), seed=0)
    bridge = bridge_for(AutoConfig.from_pretrained(folder))
    config = bridge.transformer_config(**runtime_config(ParallelLayout(), params_dtype=torch.bfloat16))
    chunks = build_chunks(config, bridge.model_kwargs())
    return bridge, chunks


def flatten_params(chunks: list[torch.nn.Module]) -> int:
    """Move every parameter into one flat buffer per dtype (Megatron's DDP param buffer); returns the buffers."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, params in by_dtype.items():
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += p.numel()
    _sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the per-tensor storages: give them back for the receivers
    return len(by_dtype)


def receiver_main(shape: dict[str, Any], device_index: int, inbox: Any, outbox: Any) -> None:
    """Holds the inference-layout model; runs one receiver per spec until told to stop."""
    from mrl.weight_sync import handles, receive_into
    from mrl.weight_sync.base import Control
    from mrl.weight_sync.handles import HandleReader
    from mrl.weight_sync.nccl import broadcast, new_group

    if torch.cuda.is_available():
        torch.cuda.set_device(device_index)
    model = InferenceModel(shape, _device(device_index))
    while (job := inbox.get()) is not None:
        kind, spec = job
        if kind == "raw":  # the raw-broadcast baseline: same group construction, no packing or loading
            c = Control(spec, 1)
            c.join()
            group = new_group(c.store, c.prefix, 1, 2, _device(device_index), c.timeout_s)
            buf = torch.empty(spec["bucket_bytes"], dtype=torch.uint8, device=_device(device_index))
            for n in spec["sizes"][:1] + spec["sizes"]:  # the sender's warm-up, then the timed ones
                broadcast(group, buf[:n]).wait()
            _sync()
            c.set(1, "done", 1)
            outbox.put(0)
            continue
        handles.BATCH_BELOW = spec.get("bench_batch_below", handles.BATCH_BELOW)
        model.loaded = 0
        for param in model.params.values():  # the checksum then shows this sync's bytes, not an earlier one's
            param.zero_()
        _sync()
        span = GpuSpan()
        try:
            count = receive_into(spec, 1, span.around(model.load), keep_parts=bool(spec.get("one_copy")))
        except Exception as error:  # reported by the sender's row; the next job still runs
            outbox.put((-1, {}, {}))
            print(f"receiver failed: {type(error).__name__}: {error}", flush=True)
            continue
        _sync()
        outbox.put((count, {n: fingerprint(model.params[n]) for n in CHECKED},
                    {**HandleReader.last, "gpu_load_ms": span.ms()} if spec.get("one_copy") else {}))


class GpuSpan:
    """Device time from the first load's first copy to the last load's last copy (CUDA events on the loads' stream):
    how long the copies themselves kept the GPU, beside the sync's wall time."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def around(self, load: Any) -> Any:
        def timed(named: list[tuple]) -> None:
            if torch.cuda.is_available() and not self.events:
                self.events.append(torch.cuda.Event(enable_timing=True))
                self.events[0].record()
            load(named)
            if self.events:
                self.events[1:] = [torch.cuda.Event(enable_timing=True)]
                self.events[1].record()
        return timed

    def ms(self) -> float:
        if len(self.events) < 2:
            return float("nan")
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1])


def time_copy(nbytes: int, device: torch.device, reps: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        _sync()
        start = time.perf_counter()
        dst.copy_(src)
        _sync()
        times.append(time.perf_counter() - start)
    del src, dst
    return statistics.median(times[1:])


def time_in_process(shape: dict[str, Any], bridge: Any, chunks: Any, repeats: int) -> dict[str, dict[str, float]]:
    """The floor of one copy in this layout: the row-block export copied into an inference-layout model in the
    sender's own process (no IPC, no control messages, no second process), best of `repeats` + 1, per COPY_MODES
    setting: wall ms, host ms to issue the export and the copies, and device ms of the copies alone (events around
    them, issued after the export so the device is never starved)."""
    from mrl.weight_sync import handles

    model = InferenceModel(shape, _device(0))
    out = {}
    for mode, below in COPY_MODES.items():
        handles.BATCH_BELOW = below
        best: dict[str, float] = {}
        for _ in range(repeats + 1):
            _sync()
            start = time.perf_counter()
            model.load(list(bridge.export(chunks, row_blocks=True)))
            issued = time.perf_counter()
            _sync()
            run = {"wall_ms": 1e3 * (time.perf_counter() - start), "host_ms": 1e3 * (issued - start)}
            named = list(bridge.export(chunks, row_blocks=True))
            span = GpuSpan()
            _sync()
            span.around(model.load)(named)
            run["device_ms"] = span.ms()
            if not best or run["wall_ms"] < best["wall_ms"]:
                best = run
        out[mode] = best
    handles.BATCH_BELOW = COPY_MODES["default"]
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def time_by_kind(shape: dict[str, Any], bridge: Any, chunks: Any) -> list[dict[str, Any]]:
    """Device time of each tensor's copy into the inference layout (events around each, issued with the host ahead
    of the device), summed per kind of tensor (its name without the layer index): which copies run below the
    device-copy rate."""
    import re

    model = InferenceModel(shape, _device(0))
    named = list(bridge.export(chunks, row_blocks=True))
    sizes = [t.numel() * t.element_size() for _, t, *_ in named]
    src = torch.empty(sum(sizes), dtype=torch.uint8, device=_device(0))
    dst = torch.empty_like(src)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def timed(copy: Any) -> list[float]:
        for _ in range(2):  # the second pass is timed
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(named) + 1)]
            _sync()
            events[0].record()
            for i, event in enumerate(events[1:]):
                copy(i)
                event.record()
            _sync()
        return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]

    layout = timed(lambda i: model.load([named[i]]))
    # the same sizes as plain byte copies between two flat buffers: the per-copy cost apart from the layout
    plain = timed(lambda i: dst.narrow(0, offsets[i], sizes[i]).copy_(src.narrow(0, offsets[i], sizes[i])))
    kinds: dict[str, dict[str, Any]] = {}
    for (name, *_), nbytes, ms, plain_ms in zip(named, sizes, layout, plain):
        key = re.sub(r"\.\d+\.", ".N.", name)
        kind = kinds.setdefault(key, {"kind": key, "count": 0, "bytes": 0, "ms": 0.0, "plain_ms": 0.0})
        kind["count"] += 1
        kind["bytes"] += nbytes
        kind["ms"] += ms
        kind["plain_ms"] += plain_ms
    return sorted(kinds.values(), key=lambda k: -k["ms"])


def timeline(shared: dict[str, Any]) -> str:
    """A one-copy sync's timeline in ms from the sender's start (sender and receiver stamps share the host's
    monotonic clock)."""
    t0 = shared.get("send_start")
    if not t0 or not shared.get("read_at"):
        return ""
    ms = [round((t - t0) * 1e3, 2) for t in shared["announced_at"]]
    reads = [round((t - t0) * 1e3, 2) for t in shared["read_at"]]
    gpu_ms = shared.get("gpu_load_ms", float("nan"))
    return (f"announced {ms}; read {reads}; release {1e3 * (shared['release_at'] - t0):.2f} -> "
            f"{1e3 * (shared['released_at'] - t0):.2f}; copies on the GPU {gpu_ms:.2f}")


def time_sync(sender: Any, bridge: Any, chunks: Any, inbox: Any, outbox: Any, row_blocks: bool = False,
              batch_below: int = COPY_MODES["default"]) -> dict[str, Any]:
    """One sync through `sender`; a sender that keeps its group (keep_group) still holds it afterwards.
    `batch_below`: the receiver's handles.BATCH_BELOW."""
    spec = sender.prepare()
    inbox.put(("sync", {**spec, "bench_batch_below": batch_below}))
    start = time.perf_counter()
    sender.init_process_group()  # joins the receivers; nccl also creates its communicator, unless it kept one
    _sync()
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        sent = sender.send_weights(bridge.export(chunks, row_blocks=row_blocks))
        sender.wait_done()  # the receiver has loaded every bucket
    except BaseException:
        sender.finalize(wait=False)
        raise
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    sender.finalize()  # nccl: destroys its communicator and frees the buffers, or keeps both and clears the keys
    teardown_s = time.perf_counter() - start
    count, sums, mapping = outbox.get(timeout=2 * SYNC_TIMEOUT_S)
    return {"seconds": seconds, "setup_s": setup_s, "teardown_s": teardown_s, "tensors": sent, "received": count,
            "sums": sums, "shared": {**getattr(sender, "shared", {}), **mapping}}


# The receiver's parameters whose position-weighted sums check a sync (layer 0's qkv_proj: q/k/v rows in place).
CHECKED = ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
           "model.layers.0.self_attn.qkv_proj.bias")


def fingerprint(tensor: torch.Tensor) -> float:
    """A position-weighted float64 sum: unlike a plain sum, it changes when rows land in the wrong place."""
    flat = tensor.detach().reshape(-1).double()
    return float((flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)).sum())


def expected_fingerprints(bridge: Any, chunks: Any) -> dict[str, float]:
    """`fingerprint` of each CHECKED parameter as the export fills it (q, k, v rows in order)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name, tensor in bridge.export(chunks):
        if name == CHECKED[0]:
            parts[name] = [tensor]
        elif name.startswith("model.layers.0.self_attn.") and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            parts.setdefault(name.replace(name.split(".")[-2], "qkv_proj"), []).append(tensor.clone())
    return {name: fingerprint(torch.cat(parts[name])) for name in CHECKED}


def expected_sums(bridge: Any, chunks: Any) -> dict[str, float]:
    """Per vLLM parameter: the float64 sum of what the export puts into it, in the engine's bf16 (fused parts
    summed; the vocabulary padding rows are zero after a load)."""
    from rollout_adapters.vllm.readback import STACKED

    sums: dict[str, float] = {}
    for name, tensor in bridge.export(chunks):
        target = name
        for fused, parts in STACKED.items():
            for part in parts:
                target = target.replace(f".{part}.", f".{fused}.")
        sums[target] = sums.get(target, 0.0) + float(tensor.to(torch.bfloat16).double().sum())
    return sums


def vllm_sync(llm: Any, bridge: Any, chunks: Any, bucket: int, one_copy: bool, row_blocks: bool) -> dict[str, Any]:
    """One sync into the live engine (its worker extension's receive, called from a thread: LLM.collective_rpc
    blocks). `seconds`: until the engine reported every bucket loaded; `rpc_s`: until its call returned (the
    two-copy path finalises the layer-wise reload after that)."""
    import threading

    from mrl.weight_sync import make_sender

    sender = make_sender("ipc", 2, bucket, SYNC_TIMEOUT_S, device=_device(0), one_copy=one_copy)
    spec = sender.prepare()
    out: dict[str, Any] = {}
    ended: list[float] = []

    def receive() -> None:
        try:
            out["received"] = llm.collective_rpc("mrl_receive_weights", args=(spec, 1))[0]
        except Exception as error:  # reported with the row
            out["error"] = f"{type(error).__name__}: {error}"
        ended.append(time.perf_counter())

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        start = time.perf_counter()
        sender.init_process_group()
        setup_s = time.perf_counter() - start
        start = time.perf_counter()
        sent = sender.send_weights(bridge.export(chunks, row_blocks=row_blocks))
        sender.wait_done()
        seconds = time.perf_counter() - start
        sender.finalize()
    finally:
        sender.finalize(wait=False)
        thread.join(timeout=2 * SYNC_TIMEOUT_S)
    stats = llm.collective_rpc("mrl_load_stats")[0]  # this sync's receiver side: its timeline joins the sender's
    return {"seconds": seconds, "rpc_s": (ended[0] - start) if ended else float("nan"), "setup_s": setup_s,
            "teardown_s": 0.0, "tensors": sent, "shared": {**sender.shared, **stats}, "load_stats": stats, **out}


def time_vllm(args: Any, folder: str, bridge: Any, chunks: Any, total: int, copy_s: float,
              variants: list[tuple[bool, bool]]) -> list[dict[str, Any]]:
    """Two-copy then one-copy syncs into a live vLLM of the same shape (random weights), each checked by sums."""
    from vllm import LLM

    from rollout_adapters.vllm.adapter import UNIPROC_EXECUTOR, WORKER_EXTENSION

    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    # vLLM-CPU reads gpu_memory_utilization as the share of the host's memory to reserve (default 0.92: more than a
    # shared CI machine has free).
    extra = {"gpu_memory_utilization": args.vllm_util}
    if not cuda:
        extra["distributed_executor_backend"] = UNIPROC_EXECUTOR
    llm = LLM(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              enforce_eager=True, enable_sleep_mode=cuda, worker_extension_cls=WORKER_EXTENSION, seed=0, **extra)
    print(f"vLLM started in {time.perf_counter() - start:.1f} s", flush=True)
    bucket = int(float(args.vllm_bucket_mb) * 2**20) if cuda else 64 << 10
    rows = []
    try:
        for i, (one_copy, blocks) in enumerate(variants):
            if i:  # other weights than the previous syncs left in the engine, so the sums tell them apart
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.data.neg_()
            want = expected_sums(bridge, chunks)
            try:
                runs = [vllm_sync(llm, bridge, chunks, bucket, one_copy, blocks) for _ in range(args.repeats + 1)]
            except Exception as error:  # the other paths still run
                traceback.print_exc()
                rows.append({"transport": label(one_copy, blocks), "receiver_device": "vLLM",
                             "error": f"{type(error).__name__}: {error}"})
                continue
            got = llm.collective_rpc("mrl_weight_sums")[0]
            # vLLM-CPU repacks its linear weights after loading: on CPU only the others are comparable
            names = [n for n in want if cuda or not n.endswith("proj.weight")]
            bad = sorted(n for n in names if n not in got or abs(got[n] - want[n]) > 1e-6 * (1 + abs(want[n])))
            best = min(runs[1:], key=lambda r: r["seconds"])  # the first builds the one-copy map, opens handles
            row = {"transport": label(one_copy, blocks), "receiver_device": "vLLM",
                   "bucket_mb": bucket / 2**20, **best, "gb_s": total / best["seconds"] / 1e9,
                   "ratio_vs_copy": copy_s / best["seconds"], "rpc_ratio_vs_copy": copy_s / best["rpc_s"],
                   "all_seconds": [r["seconds"] for r in runs], "all_rpc_s": [r["rpc_s"] for r in runs],
                   "checksum_ok": not bad and "error" not in best, "mismatched": bad[:8]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        del llm
    return rows


def time_kept_group(bridge: Any, chunks: Any, bucket: int, inbox: Any, outbox: Any, repeats: int) -> dict[str, Any]:
    """nccl with keep_group: the syncs after the first, which built the group, reuse it."""
    from mrl.weight_sync import make_sender

    sender = make_sender("nccl", 2, bucket, SYNC_TIMEOUT_S, device=_device(0), keep_group=True)
    try:
        runs = [time_sync(sender, bridge, chunks, inbox, outbox) for _ in range(repeats + 1)][1:]
    finally:
        sender.finalize(wait=False)
    return {"kept_group_setup_s": statistics.median(r["setup_s"] for r in runs),
            "kept_group_seconds": min(r["seconds"] for r in runs),
            "kept_group_clear_s": statistics.median(r["teardown_s"] for r in runs)}


def time_raw_broadcast(nbytes: int, bucket: int, inbox: Any, outbox: Any) -> float:
    from mrl.weight_sync.base import Control
    from mrl.weight_sync.nccl import broadcast, new_group

    c = Control.host("nccl", 2, SYNC_TIMEOUT_S)
    sizes = [min(bucket, nbytes - i) for i in range(0, nbytes, bucket)]
    inbox.put(("raw", {**c.spec, "bucket_bytes": bucket, "sizes": sizes}))
    c.join()
    group = new_group(c.store, c.prefix, 0, 2, _device(0), SYNC_TIMEOUT_S)
    buf = torch.empty(bucket, dtype=torch.uint8, device=_device(0))
    broadcast(group, buf[: sizes[0]]).wait()  # warm-up: the communicator is created lazily
    _sync()
    start = time.perf_counter()
    for n in sizes:
        broadcast(group, buf[:n]).wait()
    _sync()
    c.wait("raw done", {1: c.key("done", 1)})
    seconds = time.perf_counter() - start
    outbox.get(timeout=2 * SYNC_TIMEOUT_S)
    return seconds


def main() -> None:
    from mrl.weight_sync import handles, make_sender

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="tiny shape (default on a CPU-only machine)")
    parser.add_argument("--buckets-mb", default="64,256,512,1024,2048")
    parser.add_argument("--nccl-buckets-mb", default="512,2048")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one-copy", action="store_true", help="ipc rows with and without one_copy, and vLLM")
    parser.add_argument("--no-vllm", action="store_true", help="with --one-copy: skip the live vLLM rows")
    parser.add_argument("--vllm-util", type=float, default=0.3, help="the live vLLM's gpu_memory_utilization")
    parser.add_argument("--vllm-bucket-mb", default="1024")
    parser.add_argument("--no-flat-params", action="store_true", help="keep one storage per Megatron parameter")
    parser.add_argument("--variants", default="two,one,qkv",
                        help="ipc rows to run: two (two copies), one (one copy), qkv (one copy, q/k/v copied)")
    parser.add_argument("--by-kind", action="store_true", help="one-copy: device time of the copies by tensor kind")
    parser.add_argument("--copies", default="default", help=f"receivers' copies, a sweep of {list(COPY_MODES)}")
    parser.add_argument("--first-bucket-mb", default="",
                        help="one-copy: sweep the first bucket's limit (handles.FIRST_BUCKET_BYTES; 0: no ramp)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    shape = TINY if args.tiny or not cuda else QWEN2_7B
    buckets = [int(float(x) * 2**20) for x in args.buckets_mb.split(",")]
    if not cuda:
        buckets = [max(b // 1024, 4096) for b in buckets]  # tiny model: KiB-sized buckets still split tensors
    folder = tempfile.mkdtemp(prefix="mrl_ws_bench_")
    bridge, chunks = build_megatron(shape, folder)
    flat = 0 if args.no_flat_params else flatten_params(chunks)
    total = sum(t.numel() * t.element_size() for _, t in bridge.export(chunks))
    expected = expected_fingerprints(bridge, chunks)
    _sync()
    start = time.perf_counter()
    for _ in bridge.export(chunks):  # convert only: the export's own copies (e.g. splitting fused qkv)
        pass
    _sync()
    export_s = time.perf_counter() - start
    copy_s = time_copy(total, _device(0))
    in_process = time_in_process(shape, bridge, chunks, args.repeats) if args.one_copy else {}
    if args.by_kind and cuda:
        for kind in time_by_kind(shape, bridge, chunks):
            print(f"copy by kind: {kind['kind']:48s} x{kind['count']:3d} {kind['bytes'] / 1e9:7.3f} GB "
                  f"{kind['ms']:7.3f} ms {kind['bytes'] / max(kind['ms'], 1e-9) / 1e6:6.0f} GB/s; as plain byte "
                  f"copies {kind['plain_ms']:7.3f} ms", flush=True)
        torch.cuda.empty_cache()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "shape": shape,
                              "bytes": total, "copy_s": copy_s, "copy_gb_s": total / copy_s / 1e9,
                              "export_only_s": export_s, "in_process_one_copy": in_process,
                              "flat_param_buffers": flat, "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    ctx = mp.get_context("spawn")
    peers = [(0, "ipc", buckets)]
    if not args.one_copy and (not cuda or torch.cuda.device_count() > 1):
        nccl_buckets = [int(float(x) * 2**20) for x in args.nccl_buckets_mb.split(",")]
        peers.append((1 if cuda else 0, "nccl", nccl_buckets if cuda else buckets[:2]))
    chosen = [v for v, key in zip(VARIANTS, ("two", "one", "qkv")) if key in args.variants.split(",")]
    firsts = [int(float(x) * 2**20) for x in args.first_bucket_mb.split(",")] if args.first_bucket_mb else [None]
    copy_modes = args.copies.split(",")
    for device_index, transport, sizes in peers:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=receiver_main, args=(shape, device_index, inbox, outbox))
        proc.start()
        try:
            for bucket, (one_copy, blocks), first, mode in [
                    (b, v, f, m) for b in sizes for v in (chosen if args.one_copy else VARIANTS[:1])
                    for f in (firsts if v[0] else [None]) for m in (copy_modes if v[0] else ["default"])]:
                kw = {"one_copy": True} if one_copy else {}
                name = transport if transport == "nccl" else label(one_copy, blocks)
                if first is not None:
                    handles.FIRST_BUCKET_BYTES = first
                    name += f", first bucket {first / 2**20:g} MB"
                if one_copy and len(copy_modes) > 1:
                    name += f", copies {mode}"
                try:
                    runs = [time_sync(make_sender(transport, 2, bucket, SYNC_TIMEOUT_S, device=_device(0), **kw),
                                      bridge, chunks, inbox, outbox, blocks, COPY_MODES[mode])
                            for _ in range(args.repeats)]
                except Exception as error:  # the next rows still run
                    traceback.print_exc()
                    with contextlib.suppress(Exception):
                        outbox.get(timeout=SYNC_TIMEOUT_S)  # the receiver's failure report
                    result["rows"].append({"transport": name, "receiver_device": device_index,
                                           "error": f"{type(error).__name__}: {error}"})
                    continue
                best = min(runs, key=lambda r: r["seconds"])
                row = {"transport": name, "receiver_device": device_index,
                       "bucket_mb": bucket / 2**20,
                       **best, "gb_s": total / best["seconds"] / 1e9, "ratio_vs_copy": copy_s / best["seconds"],
                       "all_seconds": [r["seconds"] for r in runs],
                       "checksum_ok": all(abs(best["sums"].get(n, float("nan")) - want) <= 1e-9 * max(1.0, abs(want))
                                          for n, want in expected.items())}
                if transport == "nccl":
                    raw = time_raw_broadcast(total, bucket, inbox, outbox)
                    row.update(raw_broadcast_s=raw, ratio_vs_raw_broadcast=raw / best["seconds"],
                               **time_kept_group(bridge, chunks, bucket, inbox, outbox, args.repeats))
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            inbox.put(None)
            proc.join(timeout=120)
    if args.one_copy and not args.no_vllm:
        result["rows"].extend(time_vllm(args, folder, bridge, chunks, total, copy_s, chosen))
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def print_table(result: dict[str, Any]) -> None:
    failed = [r for r in result["rows"] if "error" in r and "seconds" not in r]
    result = {**result, "rows": [r for r in result["rows"] if r not in failed]}
    for r in failed:
        print(f"FAILED {r['transport']} into {r['receiver_device']}: {r['error']}")
    gb = result["bytes"] / 1e9
    print(f"\n{result['device']}: {gb:.2f} GB of weights; one device copy {result['copy_s'] * 1e3:.1f} ms "
          f"({result['copy_gb_s']:.0f} GB/s); export alone {result['export_only_s'] * 1e3:.1f} ms")
    for mode, r in result.get("in_process_one_copy", {}).items():
        print(f"one copy of the row-block export into the inference layout in the sender's own process, copies "
              f"{mode}: {r['wall_ms']:.1f} ms (÷ copy rate {result['copy_s'] * 1e3 / r['wall_ms']:.3f}); host "
              f"{r['host_ms']:.1f} ms, device {r['device_ms']:.1f} ms")
    print("| transport | receiver | bucket MB | group setup s | seconds | GB/s | ÷ copy rate | ÷ raw broadcast "
          "| group teardown s | tensors | checksum |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        raw = f"{r['ratio_vs_raw_broadcast']:.2f}" if "ratio_vs_raw_broadcast" in r else ""
        print(f"| {r['transport']} | dev {r['receiver_device']} | {r['bucket_mb']:g} | {r['setup_s']:.3f} | "
              f"{r['seconds']:.4f} | {r['gb_s']:.1f} | {r['ratio_vs_copy']:.3f} | {raw} | {r['teardown_s']:.3f} | "
              f"{r.get('received', '-')}/{r['tensors']} | "
              f"{'ok' if r['checksum_ok'] else 'MISMATCH'} |")
    for r in result["rows"]:
        if r.get("shared"):
            stats = {k: v for k, v in r["shared"].items() if k not in ("send_start", "announced_at", "read_at",
                                                                      "release_at", "released_at")}
            print(f"{r['transport']} ({r['receiver_device']}): buckets and storage handles shared, the receiver's "
                  f"mappings and host seconds mapping / unmapping, best sync: {stats}")
            if line := timeline(r["shared"]):
                print(f"  timeline (ms), bucket {r['bucket_mb']:g} MB, sync {r['seconds'] * 1e3:.2f} ms: {line}")
    for r in result["rows"]:
        if "rpc_s" in r:
            print(f"{r['transport']} into vLLM: engine call returned after {r['rpc_s'] * 1e3:.1f} ms "
                  f"(÷ copy rate {r['rpc_ratio_vs_copy']:.3f}); load stats {r['load_stats']}; "
                  f"all runs {[round(x * 1e3, 1) for x in r['all_seconds']]} ms"
                  + (f"; mismatched {r['mismatched']}" if r["mismatched"] else "")
                  + (f"; error {r['error']}" if "error" in r else ""))
    for r in result["rows"]:
        if "kept_group_setup_s" in r:
            print(f"nccl, bucket {r['bucket_mb']:g} MB, group kept from the previous sync: setup "
                  f"{r['kept_group_setup_s']:.4f} s (built per sync: {r['setup_s']:.3f} s + teardown "
                  f"{r['teardown_s']:.3f} s), transfer {r['kept_group_seconds']:.4f} s, key clearing "
                  f"{r['kept_group_clear_s']:.4f} s")


if __name__ == "__main__":
    main()
