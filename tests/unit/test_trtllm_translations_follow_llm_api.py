"""TensorRT-LLM adapter translations, pure functions only (TensorRT-LLM cannot run on CPU machines).

Shapes followed: TensorRT-LLM main — `tensorrt_llm/sampling_params.py` @ 000a01de (SamplingParams, `_validate`:
logprobs=True means top-1, greedy is top_k in (None, 1)), `_torch/async_llm.py` @ 0acd798d (AsyncLLM.release /
resume / update_weights), `llmapi/rlhf_utils.py` @ 65b31db1 (update_weights payload), `_torch/virtual_memory.py`
(ExecutorMemoryType); CompletionOutput.logprobs is list[dict[token_id, Logprob(logprob, rank)]] (PR #5136 output),
raw log-probs by default on the PyTorch backend (PR #9302, #12514).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import pytest
import torch

from rollout_adapters.base import normalize_sampling
from rollout_adapters.trtllm import protocol
from rollout_adapters.trtllm.adapter import TRTLLMAdapter


class Logprob(NamedTuple):  # tensorrt_llm.executor.result.Logprob's fields
    logprob: float
    rank: int | None = None


def test_sampling_dict_becomes_sampling_params_kwargs():
    greedy = protocol.sampling_kwargs(normalize_sampling({"temperature": 0, "top_p": 0.5, "top_k": 5}), budget=9)
    assert greedy["temperature"] is None and greedy["top_k"] == 1 and greedy["top_p"] is None  # TRT-LLM's greedy
    assert greedy["max_tokens"] == 9 and greedy["logprobs"] == 1 and greedy["detokenize"] is False
    sampled = protocol.sampling_kwargs(
        normalize_sampling({"temperature": 0.7, "top_p": 0.9, "seed": 11, "stop_token_ids": [2], "ignore_eos": True,
                            "logprobs": False}), budget=4)
    assert sampled["temperature"] == 0.7 and sampled["top_k"] is None and sampled["top_p"] == 0.9
    assert sampled["seed"] == 11 and sampled["stop_token_ids"] == [2] and sampled["ignore_eos"] is True
    assert sampled["logprobs"] is None and sampled["n"] == 1
    assert protocol.sampling_kwargs(normalize_sampling({"top_k": 3}), 1)["top_k"] == 3
    assert protocol.sampling_kwargs(normalize_sampling({}), 1)["stop_token_ids"] is None
    assert protocol.token_prompt([1, 2]) == {"prompt_token_ids": [1, 2]}


def test_completion_output_becomes_aligned_log_probs():
    # logprobs=1: each position holds the sampled token, plus the top-1 when sampling picked another one.
    positions = [{17: Logprob(-0.2, 1)}, {402: Logprob(-2.5, 3), 8: Logprob(-0.1, 1)}, {2: Logprob(-0.05, 1)}]
    assert protocol.parse_completion([17, 402, 2], positions, "stop", True, 8) == ([17, 402, 2], [-0.2, -2.5, -0.05],
                                                                                  "stop")
    assert protocol.parse_completion([5], [-1.25], "length", True, 1) == ([5], [-1.25], "length")  # flat floats
    assert protocol.parse_completion([5, 6], None, "cancelled", False, 8) == ([5, 6], [], "aborted")


def test_malformed_completions_are_errors():
    with pytest.raises(RuntimeError, match="lack the sampled token 5"):
        protocol.parse_completion([5], [{6: Logprob(-0.1)}], "length", True, 4)
    with pytest.raises(RuntimeError, match="1 log-prob positions for 2 tokens"):
        protocol.parse_completion([5, 6], [{5: Logprob(-0.1)}], "length", True, 4)
    with pytest.raises(RuntimeError, match="over the budget"):
        protocol.parse_completion([5, 6], None, "length", False, 1)
    with pytest.raises(RuntimeError, match="unknown reason"):
        protocol.parse_completion([5], None, None, False, 4)


def test_memory_tags_map_to_executor_memory_types():
    assert protocol.memory_tags(["weights"]) == ["model", "draft_model"]
    kv = protocol.memory_tags(["kv_cache"])
    assert kv[0] == "kv_cache" and "sampler" in kv and "model" not in kv
    both = protocol.memory_tags(["weights", "kv_cache"])
    assert set(both) == set(protocol.MEMORY_TAGS["weights"]) | set(protocol.MEMORY_TAGS["kv_cache"])
    with pytest.raises(ValueError, match="unknown memory tag"):
        protocol.memory_tags(["cuda_graph"])


def test_weight_bucket_becomes_ipc_update_payload():
    named = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(3, 8))]
    payload = protocol.ipc_update_payload(named, "GPU-1234")
    assert list(payload) == ["GPU-1234"] and isinstance(payload["GPU-1234"], str)
    back = protocol.rebuild_ipc_payload(payload, "GPU-1234")
    assert [n for n, _ in back] == ["model.norm.weight", "lm_head.weight"]
    for (_, a), (_, b) in zip(back, named):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not in the weight payload"):
        protocol.rebuild_ipc_payload(payload, "GPU-other")


def test_errors_map_to_our_exceptions():
    class RequestError(RuntimeError):
        pass

    class ExecutorDeadError(RuntimeError):
        pass

    assert isinstance(protocol.map_error(RequestError("prompt length 5000 exceeds max_seq_len")), ValueError)
    assert isinstance(protocol.map_error(ExecutorDeadError("gone")), ConnectionError)
    mapped = protocol.map_error(KeyError("x"))
    assert type(mapped) is RuntimeError and "KeyError" in str(mapped)


def test_unsupported_features_name_themselves():
    adapter = TRTLLMAdapter("/m", tensor_parallel_size=2, engine_kwargs={"distributed_executor_backend": "ray"})
    assert adapter.llm_kwargs["tensor_parallel_size"] == 2 and adapter.llm_kwargs["enable_sleep"] is True
    assert adapter.llm_kwargs["backend"] == "pytorch"  # raw log-probs: the TRT engine backend applies temperature
    with pytest.raises(NotImplementedError, match=r"caller's NCCL group.*forwarded over IPC"):
        asyncio.run(adapter.init_weight_update_group("h", 1, 1, 2))
    with pytest.raises(NotImplementedError, match="caller's NCCL group"):
        asyncio.run(adapter.update_weights_from_distributed([], 1))
    with pytest.raises(NotImplementedError, match="sleep level 1"):
        asyncio.run(adapter._sleep(1))
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="CPU tensors"):
            asyncio.run(adapter._load_weights(_empty()))
        with pytest.raises(NotImplementedError, match="CPU tensors"):
            asyncio.run(adapter._receive_weights({"transport": "ipc"}, 1))


def test_one_update_call_carries_every_workers_bucket_under_its_device():
    """rlhf_utils.WorkerExtension.update_weights: each worker reads ipc_handles[its device UUID] and raises when its
    UUID is missing, so a worker with nothing this round still gets an (empty) entry."""
    rank0 = [("model.norm.weight", torch.randn(8))]
    payload = protocol.per_device_ipc_payload([rank0, []], ["GPU-a", "GPU-b"])
    assert sorted(payload) == ["GPU-a", "GPU-b"]
    back = protocol.rebuild_ipc_payload(payload, "GPU-a")
    assert [n for n, _ in back] == ["model.norm.weight"] and torch.equal(back[0][1], rank0[0][1])
    assert protocol.rebuild_ipc_payload(payload, "GPU-b") == []
    with pytest.raises(ValueError, match="one distinct device per rank"):
        protocol.per_device_ipc_payload([rank0, rank0], ["GPU-a", "GPU-a"])


async def _empty():
    for blob in ():
        yield blob


def _rebuild_in_child(payload, uuid, outbox) -> None:
    torch.cuda.set_device(0)
    named = protocol.rebuild_ipc_payload(payload, uuid, device_index=0)
    outbox.put([(name, str(t.device), t.double().sum().item(), tuple(t.shape)) for name, t in named])


@pytest.mark.gpu
def test_ipc_payload_rebuilds_in_another_cuda_process():
    """On a GPU: the payload's CUDA IPC handles open in a second process the way TensorRT-LLM's worker opens them
    (device index rewritten), without a copy through host memory."""
    import torch.multiprocessing as mp

    named = [("w", torch.randn(257, 3, device="cuda")), ("b", torch.arange(5, device="cuda", dtype=torch.bfloat16))]
    payload = protocol.ipc_update_payload(named, "GPU-test")
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    child = ctx.Process(target=_rebuild_in_child, args=(payload, "GPU-test", outbox))
    child.start()
    got = outbox.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    expected = [(n, "cuda:0", t.double().sum().item(), tuple(t.shape)) for n, t in named]
    assert [(n, d, s) for n, d, _, s in got] == [(n, d, s) for n, d, _, s in expected]
    for (_, _, got_sum, _), (_, _, want_sum, _) in zip(got, expected):
        assert got_sum == pytest.approx(want_sum, abs=1e-6)
