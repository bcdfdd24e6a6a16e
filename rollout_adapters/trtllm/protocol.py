"""Pure translations between the adapter protocol and TensorRT-LLM's LLM API (no tensorrt_llm import, no I/O).

Followed: TensorRT-LLM main as stored: `tensorrt_llm/sampling_params.py` (SamplingParams fields and `_validate`:
`logprobs=True` means top-1, greedy is top_k in (None, 1) with top_p in (None, 0)), `tensorrt_llm/_torch/
async_llm.py` (AsyncLLM.release/resume/update_weights/collective_rpc), `tensorrt_llm/llmapi/rlhf_utils.py`
(WorkerExtension.update_weights: {device_uuid: base64(pickle([(name, (rebuild_fn, args)), ...]))}, then a call with
None to finalise), `tensorrt_llm/_torch/virtual_memory.py` (ExecutorMemoryType tags). Log-prob convention from
PR #9302 / #12514: the PyTorch backend reports the sampled token's log-prob under the raw logits by default
(LogprobMode.RAW); the TRT engine backend reports it after temperature, so only the PyTorch backend is used.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rollout_adapters.base import StopReason

TRTLLM_SOURCE = ("TensorRT-LLM main: tensorrt_llm/sampling_params.py @ 000a01de, _torch/async_llm.py @ 0acd798d, "
                 "llmapi/rlhf_utils.py @ 65b31db1, _torch/virtual_memory.py; log-prob modes: PR #9302, #12514")

# Our memory tags -> TensorRT-LLM's ExecutorMemoryType values. Weights are the model engine's allocations; the KV
# cache goes together with the runtime buffers that only generation needs (sampler, drafter, guided decoder, ...).
MEMORY_TAGS: dict[str, tuple[str, ...]] = {
    "weights": ("model", "draft_model"),
    "kv_cache": ("kv_cache", "sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra",
                 "executor_extra"),
}

# CompletionOutput.finish_reason values; "cancelled" is what RequestOutput.abort() leaves.
_FINISH: dict[str | None, StopReason] = {"stop": "stop", "length": "length", "cancelled": "aborted",
                                         "timeout": "aborted"}


def sampling_kwargs(params: dict[str, Any], budget: int) -> dict[str, Any]:
    """Unified (normalised) sampling dict -> keyword arguments of tensorrt_llm.SamplingParams.

    Temperature 0 becomes TRT-LLM's greedy form (top_k=1, no temperature: it requires temperature > 0). top_k -1
    becomes None (the runtime's 0 = all tokens). logprobs=1 is the smallest request that returns anything: the
    PyTorch backend returns log-probs only when `bool(logprobs)`; each position's dict then holds the sampled
    token (and the top-1 when they differ).
    """
    greedy = params["temperature"] == 0
    kwargs: dict[str, Any] = {
        "max_tokens": budget,
        "temperature": None if greedy else float(params["temperature"]),
        "top_k": 1 if greedy else (None if params["top_k"] < 0 else int(params["top_k"])),
        "top_p": None if greedy or params["top_p"] >= 1.0 else float(params["top_p"]),
        "seed": params["seed"],
        "stop_token_ids": list(params["stop_token_ids"]) or None,
        "ignore_eos": bool(params["ignore_eos"]),
        "logprobs": 1 if params["logprobs"] else None,
        "detokenize": False,
        "n": 1,
    }
    return kwargs


def token_prompt(prompt_ids: Sequence[int]) -> dict[str, list[int]]:
    """The LLM API's TokensPrompt: a token-id prompt skips the tokenizer."""
    return {"prompt_token_ids": [int(t) for t in prompt_ids]}


def parse_completion(
    token_ids: Sequence[int], logprobs: Sequence[Any] | None, finish_reason: str | None, want_logprobs: bool,
    budget: int,
) -> tuple[list[int], list[float], StopReason]:
    """CompletionOutput (token_ids, logprobs: list[dict[token_id, Logprob(logprob, rank)]] or list[float],
    finish_reason) -> (ids, log-prob of each sampled token, stop reason), checked for alignment."""
    ids = [int(t) for t in token_ids]
    if finish_reason not in _FINISH:
        raise RuntimeError(f"tensorrt-llm finished a request with unknown reason {finish_reason!r}")
    if len(ids) > budget:
        raise RuntimeError(f"tensorrt-llm generated {len(ids)} tokens, over the budget of {budget}")
    lps: list[float] = []
    if want_logprobs:
        if logprobs is None or len(logprobs) != len(ids):
            got = None if logprobs is None else len(logprobs)
            raise RuntimeError(f"tensorrt-llm returned {got} log-prob positions for {len(ids)} tokens")
        for position, (entry, token) in enumerate(zip(logprobs, ids)):
            if isinstance(entry, dict):
                if token not in entry:
                    raise RuntimeError(f"tensorrt-llm log-probs at position {position} lack the sampled token {token}")
                value = entry[token]
                lps.append(float(getattr(value, "logprob", value)))
            else:
                lps.append(float(entry))  # older releases: a flat float per position
    return ids, lps, _FINISH[finish_reason]


def memory_tags(tags: Iterable[str]) -> list[str]:
    """Our tags -> TensorRT-LLM ExecutorMemoryType strings for AsyncLLM.release / resume, in our wake order."""
    out: list[str] = []
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise ValueError(f"unknown memory tag {tag!r}; known: {sorted(MEMORY_TAGS)}")
        out.extend(MEMORY_TAGS[tag])
    return out


def ipc_update_payload(
    named_tensors: Sequence[tuple[str, torch.Tensor]], device_uuid: str
) -> dict[str, str]:
    """One bucket for AsyncLLM.update_weights: {device_uuid: base64(pickle([(name, (rebuild_fn, args)), ...]))}.

    The handles come from torch's `reduce_tensor` (CUDA IPC for CUDA tensors); the worker whose device has that
    UUID rebuilds each tensor on its own device index and loads it. The sender keeps the tensors alive until the
    call returns. A final `update_weights(None)` runs the post-load processing and resets the prefix cache.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    handles = [(name, reduce_tensor(tensor.detach().contiguous())) for name, tensor in named_tensors]
    return {device_uuid: base64.b64encode(pickle.dumps(handles)).decode("ascii")}


def per_device_ipc_payload(
    per_rank: Sequence[Sequence[tuple[str, torch.Tensor]]], device_uuids: Sequence[str]
) -> dict[str, str]:
    """One bucket for every worker at once: rank j's tensors under the UUID of rank j's device. A rank without
    tensors this round still gets its (empty) entry: a worker whose UUID is missing raises."""
    if len(per_rank) != len(device_uuids) or len(set(device_uuids)) != len(device_uuids):
        raise ValueError(f"one distinct device per rank: {len(per_rank)} ranks, devices {list(device_uuids)}")
    payload: dict[str, str] = {}
    for named, uuid in zip(per_rank, device_uuids):
        payload.update(ipc_update_payload(named, uuid))
    return payload


def rebuild_ipc_payload(
    payload: dict[str, str], device_uuid: str, device_index: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """What the TensorRT-LLM worker does with its entry: unpickle, point each CUDA handle at its own device index
    (argument 6 of torch's rebuild_cuda_tensor) and rebuild."""
    if device_uuid not in payload:
        raise ValueError(f"device {device_uuid} not in the weight payload (devices: {sorted(payload)})")
    named = []
    for name, (rebuild, args) in pickle.loads(base64.b64decode(payload[device_uuid])):
        args = list(args)
        if device_index is not None and len(args) > 6:
            args[6] = device_index
        named.append((name, rebuild(*args)))
    return named


def map_error(exc: BaseException) -> BaseException:
    """TensorRT-LLM exceptions -> ours: request errors (over-long prompts, invalid sampling) are ValueError, a dead
    executor ConnectionError, the rest RuntimeError; the original stays the cause."""
    text = f"tensorrt-llm: {type(exc).__name__}: {exc}"
    name = type(exc).__name__
    if isinstance(exc, ValueError) or name in ("RequestError",) or "exceeds" in str(exc) or "too long" in str(exc):
        return ValueError(text)
    if name in ("ExecutorDeadError", "EngineDeadError") or isinstance(exc, (ConnectionError, EOFError)):
        return ConnectionError(text)
    if isinstance(exc, NotImplementedError):
        return exc
    return RuntimeError(text)
