"""Pure translations between the adapter protocol and SGLang's HTTP server (no SGLang import, no I/O).

Followed: sglang `python/sglang/srt/managers/io_struct.py` (GenerateReqInput, UpdateWeightsFromTensorReqInput,
UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput, Release/ResumeMemoryOccupationReqInput,
AbortReq) and `srt/entrypoints/http_server.py`, main branch as stored at commit 001067ff (the 0.5.x line).
Every request body built here is a JSON object those endpoints accept; every parser reads the response shapes they
return. The tests quote the recorded shapes (tests/unit/test_sglang_*).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rollout_adapters.base import StopReason

SGLANG_SOURCE = "sglang main @ 001067ff (0.5.x): srt/managers/io_struct.py, srt/entrypoints/http_server.py"

# SGLang reports the sampled token's log-prob under softmax(z / T) (before top-k / top-p), the distribution the
# trainer scores; SGLANG_RETURN_ORIGINAL_LOGPROB=1 would switch it to the raw logits, so no server we start sets it.
SERVER_ENV: dict[str, str] = {}

# Memory tags of /release_memory_occupation and /resume_memory_occupation ("Currently we only support `weights` and
# `kv_cache`", io_struct.ReleaseMemoryOccupationReqInput); ours have the same names.
MEMORY_TAGS = ("weights", "kv_cache")

_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "aborted"}


def sampling_params(params: dict[str, Any], budget: int) -> dict[str, Any]:
    """Unified (normalised) sampling dict -> SGLang's `sampling_params` object for `budget` new tokens.

    SGLang disables top-k with -1 and greedy is temperature 0 (it switches to argmax below 1e-6), like ours.
    `no_stop_trim` keeps a matched stop token in output_ids: our TokenOutput includes stop tokens.
    """
    out: dict[str, Any] = {
        "max_new_tokens": budget,
        "temperature": float(params["temperature"]),
        "top_p": float(params["top_p"]),
        "top_k": int(params["top_k"]),
        "ignore_eos": bool(params["ignore_eos"]),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params["stop_token_ids"]:
        out["stop_token_ids"] = list(params["stop_token_ids"])
    if params["seed"] is not None:
        out["sampling_seed"] = int(params["seed"])
    return out


def generate_request(
    rid: str, prompt_ids: Sequence[int], params: dict[str, Any], budget: int, **extra: Any
) -> dict[str, Any]:
    """Body of POST /generate for one sample given as token ids; `extra` carries routing fields such as the
    disaggregation bootstrap (bootstrap_host, bootstrap_port, bootstrap_room)."""
    if params["prompt_logprobs"] and float(params["temperature"]) not in (0.0, 1.0):
        # SGLang scales prompt log-probs by the request's temperature when SGLANG_TEMP_SCALED_LOGPROBS is set (and
        # greedy runs at 1): only at 0 or 1 are they the untempered ones the unified key promises, whatever the env.
        raise ValueError(f"sampling prompt_logprobs with temperature {params['temperature']}: the sglang adapter "
                         "returns prompt log-probs only at temperature 0 or 1 (untempered either way)")
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params(params, budget),
        "return_logprob": bool(params["logprobs"] or params["prompt_logprobs"]),
        # -1: log-probs of output tokens only; 0: every prompt token's as well (input_token_logprobs).
        "logprob_start_len": 0 if params["prompt_logprobs"] else -1,
        "top_logprobs_num": 0,
        "stream": False,
    }
    body.update(extra)
    return body


def parse_generate_response(
    body: dict[str, Any], want_logprobs: bool, budget: int
) -> tuple[list[int], list[float], StopReason]:
    """POST /generate response -> (token ids, their log-probs, stop reason), checked for alignment.

    Shape: {"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
    "output_token_logprobs": [[logprob, token_id, text|None], ...], ...}} ("text" as well unless the server skips
    the tokenizer). An abort that carries an error status is an error, not a partial sample.
    """
    meta = body.get("meta_info") or {}
    if "output_ids" not in body:
        raise RuntimeError(f"sglang /generate response has no output_ids (start the server with --skip-tokenizer-init? "
                           f"keys: {sorted(body)})")
    ids = [int(t) for t in body["output_ids"]]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH:
        raise RuntimeError(f"sglang finished a request with unknown reason {finish!r}")
    if kind == "abort" and finish.get("status_code", 200) >= 400:
        raise_for_error(finish.get("status_code"), finish.get("message", ""), "/generate")
    if len(ids) > budget:
        raise RuntimeError(f"sglang generated {len(ids)} tokens, over the budget of {budget}")
    lps: list[float] = []
    if want_logprobs:
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(ids):
            got = None if entries is None else len(entries)
            raise RuntimeError(f"sglang returned {got} output log-probs for {len(ids)} tokens")
        for position, (entry, token) in enumerate(zip(entries, ids)):
            if int(entry[1]) != token:
                raise RuntimeError(f"sglang log-prob {position} is for token {entry[1]}, the output has {token}")
            lps.append(float(entry[0]))
    return ids, lps, _FINISH[kind]


def parse_prompt_log_probs(body: dict[str, Any], prompt_ids: Sequence[int]) -> list[float]:
    """POST /generate response of a request sent with logprob_start_len 0 -> each prompt token's log-prob given the
    tokens before it (0.0 for the first, which SGLang reports as None), as vLLM's adapter returns them.

    Shape: meta_info["input_token_logprobs"] = [[None, id0, text], [logprob, id1, text], ...], one per prompt token
    (the scheduler pads the first with None and moves the sampled token's entry to the output side). SGLang writes
    ids at or above vocab_size - 1 as 0 there (its image-hash clipping), so a 0 is not checked against the prompt.
    """
    entries = (body.get("meta_info") or {}).get("input_token_logprobs")
    if entries is None or len(entries) != len(prompt_ids):
        got = None if entries is None else len(entries)
        raise RuntimeError(f"sglang returned {got} prompt log-probs for a prompt of {len(prompt_ids)} tokens")
    for position, (entry, token) in enumerate(zip(entries, prompt_ids)):
        if int(entry[1]) not in (token, 0):
            raise RuntimeError(f"sglang prompt log-prob {position} is for token {entry[1]}, the prompt has {token}")
    return [0.0] + [float(entry[0]) for entry in entries[1:]]


def raise_for_error(status: int | None, message: str, endpoint: str) -> None:
    """Map an SGLang error (HTTP status + message) onto our exceptions: what the caller sent (400-class, over-long
    prompts) is a ValueError, an overloaded or unavailable server a ConnectionError, the rest a RuntimeError."""
    text = f"sglang {endpoint} failed ({status}): {message}"
    if status is not None and 400 <= status < 500:
        raise ValueError(text)
    if status in (502, 503, 504):
        raise ConnectionError(text)
    raise RuntimeError(text)


def check_control_response(endpoint: str, status: int, body: Any) -> Any:
    """Control endpoints answer {"success": bool, "message": str} (weights; 400 with success false when the engine
    could not load) or plain 200s (memory, cache). A reported failure is the engine's, whatever the status."""
    if isinstance(body, dict) and body.get("success") is False:
        raise RuntimeError(f"sglang {endpoint} failed: {body.get('message', '')}")
    if status >= 400:
        message = body.get("error", body.get("message", body)) if isinstance(body, dict) else body
        if isinstance(message, dict):
            message = message.get("message", message)
        raise_for_error(status, str(message), endpoint)
    return body


# ---- weights --------------------------------------------------------------------------------------------------
def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One rank's share of an UpdateWeightsFromTensorReqInput: the list pickled with torch's ForkingPickler (CUDA
    tensors travel as IPC handles, CPU tensors through shared memory), base64 for JSON. The receiver must unpickle
    while the sender keeps the tensors alive."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(list(named_tensors))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of serialize_named_tensors (what an SGLang TP worker does with its entry)."""
    return pickle.loads(base64.b64decode(payload))


def tensor_update_payload(
    named_tensors: Sequence[tuple[str, torch.Tensor]], tp_size: int, version: int | None = None
) -> dict[str, Any]:
    """Body of POST /update_weights_from_tensor for one bucket.

    `serialized_named_tensors` holds one entry per TP rank (each rank deserialises its own index); every rank loads
    full HF tensors and slices them itself. The cache flush is ours to order (after the last bucket), and aborts are
    the adapter's (before the first), so both are off here.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return per_rank_tensor_update_payload([named_tensors] * tp_size, version)


def per_rank_tensor_update_payload(
    per_rank: Sequence[Sequence[tuple[str, torch.Tensor]]], version: int | None = None
) -> dict[str, Any]:
    """Body of POST /update_weights_from_tensor whose entry j is TP rank j's own list (TP rank j deserialises
    `serialized_named_tensors[tp_rank]`; an empty list loads nothing on that rank)."""
    if not per_rank:
        raise ValueError("a tensor weight update needs one entry per TP rank, got none")
    payload: dict[str, Any] = {
        # One serialisation per rank: a CPU shared-memory handle passes its file descriptor once only.
        "serialized_named_tensors": [serialize_named_tensors(named) for named in per_rank],
        "load_format": None,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    if version is not None:
        payload["weight_version"] = str(version)
    return payload


def init_group_payload(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """Body of POST /init_weights_update_group: the trainer is rank 0 and this server's TP ranks are rank_offset +
    tp_rank of a temporary group of `world_size` (trainer + every engine rank)."""
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}): rank 0 is the trainer")
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def distributed_update_payload(
    metas: Iterable[tuple[str, torch.dtype, Sequence[int]]], group_name: str, version: int | None = None
) -> dict[str, Any]:
    """Body of POST /update_weights_from_distributed: names, dtypes (torch names without the prefix, which the
    receiver resolves with getattr(torch, dtype)) and shapes of the tensors the trainer broadcasts next, in order."""
    names, dtypes, shapes = [], [], []
    for name, dtype, shape in metas:
        names.append(name)
        dtypes.append(str(dtype).removeprefix("torch."))
        shapes.append([int(s) for s in shape])
    if not names:
        raise ValueError("a distributed weight update needs at least one tensor")
    payload: dict[str, Any] = {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    if version is not None:
        payload["weight_version"] = str(version)
    return payload


def memory_payload(tags: Iterable[str]) -> dict[str, Any]:
    """Body of /release_memory_occupation and /resume_memory_occupation for our tags (same names as SGLang's)."""
    tags = list(tags)
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; sglang knows {list(MEMORY_TAGS)}")
    return {"tags": tags}


def abort_all_payload() -> dict[str, Any]:
    """Body of POST /abort_request that aborts everything (AbortReq with abort_all; rid '' is the 'all' marker)."""
    return {"rid": "", "abort_all": True}


def server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    dp_size: int = 1,
    dtype: str = "auto",
    context_length: int | None = None,
    seed: int = 0,
    mem_fraction_static: float | None = None,
    weights_cpu_backup: bool = False,
    disable_cuda_graph: bool = False,
    disable_radix_cache: bool = False,
    enable_memory_saver: bool = True,
    max_running_requests: int | None = None,
    chunked_prefill_size: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv of `python -m sglang.launch_server` for one replica.

    --skip-tokenizer-init: token ids in and out (no detokenizer process). --enable-memory-saver: tagged release of
    weights and KV cache (torch_memory_saver). --enable-weights-cpu-backup keeps a host copy of released weights,
    which is what sleep level 1 (offload, keep) needs.
    """
    argv = [
        "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dp-size", str(dp_size),
        "--dtype", dtype,
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
    ]
    valued = {"--context-length": context_length, "--mem-fraction-static": mem_fraction_static,
              "--max-running-requests": max_running_requests, "--chunked-prefill-size": chunked_prefill_size}
    for flag, value in valued.items():
        if value is not None:
            argv += [flag, str(value)]
    switches = {"--enable-memory-saver": enable_memory_saver, "--enable-weights-cpu-backup": weights_cpu_backup,
                "--disable-cuda-graph": disable_cuda_graph, "--disable-radix-cache": disable_radix_cache}
    return argv + [flag for flag, on in switches.items() if on] + list(extra_args)
