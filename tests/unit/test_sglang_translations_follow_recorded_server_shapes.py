"""SGLang adapter translations, pure functions only (SGLang cannot run on CPU machines).

Shapes followed: sglang main @ 001067ff (0.5.x) — `srt/managers/io_struct.py` (GenerateReqInput,
UpdateWeightsFromTensorReqInput, UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput,
Release/ResumeMemoryOccupationReqInput, AbortReq) and `srt/entrypoints/http_server.py` (/generate returns
{"output_ids", "meta_info": {"finish_reason": {"type", ...}, "output_token_logprobs": [[logprob, id, text]]}}).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rollout_adapters.base import normalize_sampling
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter, named_metas

# Recorded from the /generate handler with --skip-tokenizer-init and return_logprob=True.
RESPONSE_STOP = {
    "output_ids": [17, 402, 2],
    "meta_info": {
        "id": "r-1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25, 17, None], [-1.5, 402, None], [-0.01, 2, None]],
        "weight_version": "default",
    },
}
RESPONSE_LENGTH = {
    "output_ids": [5, 6],
    "meta_info": {"finish_reason": {"type": "length", "length": 2},
                  "output_token_logprobs": [[-3.0, 5, None], [-2.0, 6, None]]},
}
RESPONSE_ABORTED = {
    "output_ids": [9],
    "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"},
                  "output_token_logprobs": [[-0.5, 9, None]]},
}


def test_sampling_dict_becomes_generate_request():
    params = normalize_sampling({"temperature": 0, "top_k": 0, "max_tokens": 50, "seed": 3, "stop_token_ids": [7]})
    body = protocol.generate_request("rid-1", [1, 2, 3], params, budget=12)
    assert body["rid"] == "rid-1" and body["input_ids"] == [1, 2, 3]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 12  # the adapter's length budget, not the caller's max_tokens
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["top_p"] == 1.0
    assert sp["sampling_seed"] == 3 and sp["stop_token_ids"] == [7] and sp["no_stop_trim"] is True

    plain = protocol.generate_request("r", [4], normalize_sampling({"logprobs": False}), budget=1)
    assert plain["return_logprob"] is False and "sampling_seed" not in plain["sampling_params"]
    assert "stop_token_ids" not in plain["sampling_params"]
    routed = protocol.generate_request("r", [4], normalize_sampling({}), 1, bootstrap_room=5, bootstrap_port=8998)
    assert routed["bootstrap_room"] == 5 and routed["bootstrap_port"] == 8998


@pytest.mark.parametrize(
    ("response", "ids", "lps", "reason"),
    [
        (RESPONSE_STOP, [17, 402, 2], [-0.25, -1.5, -0.01], "stop"),
        (RESPONSE_LENGTH, [5, 6], [-3.0, -2.0], "length"),
        (RESPONSE_ABORTED, [9], [-0.5], "aborted"),
    ],
)
def test_responses_become_aligned_token_outputs(response, ids, lps, reason):
    assert protocol.parse_generate_response(response, want_logprobs=True, budget=8) == (ids, lps, reason)
    got_ids, got_lps, _ = protocol.parse_generate_response(response, want_logprobs=False, budget=8)
    assert got_ids == ids and got_lps == []


def test_misaligned_or_malformed_responses_are_errors():
    short = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                                 "output_token_logprobs": [[-1.0, 1, None]]}}
    with pytest.raises(RuntimeError, match="1 output log-probs for 2 tokens"):
        protocol.parse_generate_response(short, True, 8)
    swapped = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                                   "output_token_logprobs": [[-1.0, 1, None], [-1.0, 3, None]]}}
    with pytest.raises(RuntimeError, match="log-prob 1 is for token 3"):
        protocol.parse_generate_response(swapped, True, 8)
    with pytest.raises(RuntimeError, match="over the budget of 1"):
        protocol.parse_generate_response(RESPONSE_LENGTH, True, 1)
    with pytest.raises(RuntimeError, match="unknown reason"):
        protocol.parse_generate_response({"output_ids": [], "meta_info": {"finish_reason": None}}, True, 8)
    with pytest.raises(RuntimeError, match="no output_ids"):
        protocol.parse_generate_response({"text": "hi", "meta_info": {}}, True, 8)
    too_long = {"output_ids": [], "meta_info": {"finish_reason": {
        "type": "abort", "status_code": 400, "message": "input is longer than the context length"}}}
    with pytest.raises(ValueError, match="longer than the context"):
        protocol.parse_generate_response(too_long, True, 8)


# Recorded with logprob_start_len 0 for input_ids [11, 12, 13]: the first prompt entry is None (no context).
RESPONSE_PROMPT = {"output_ids": [14], "meta_info": {
    "finish_reason": {"type": "length", "length": 1},
    "input_token_logprobs": [[None, 11, None], [-2.5, 12, None], [-0.75, 0, None]],
    "output_token_logprobs": [[-0.5, 14, None]]}}


def test_prompt_log_probs_are_asked_from_token_zero_and_read_aligned():
    params = normalize_sampling({"max_tokens": 1, "temperature": 0, "logprobs": False, "prompt_logprobs": True})
    body = protocol.generate_request("r", [11, 12, 13], params, budget=1)
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    # a 0 stands for an id SGLang clips (vocab_size - 1 and above): not a mismatch
    assert protocol.parse_prompt_log_probs(RESPONSE_PROMPT, [11, 12, 13]) == [0.0, -2.5, -0.75]
    assert protocol.parse_generate_response(RESPONSE_PROMPT, False, 1) == ([14], [], "length")
    with pytest.raises(RuntimeError, match="3 prompt log-probs for a prompt of 4 tokens"):
        protocol.parse_prompt_log_probs(RESPONSE_PROMPT, [11, 12, 13, 15])
    with pytest.raises(RuntimeError, match="prompt log-prob 1 is for token 12, the prompt has 7"):
        protocol.parse_prompt_log_probs(RESPONSE_PROMPT, [11, 7, 13])
    with pytest.raises(RuntimeError, match="None prompt log-probs"):
        protocol.parse_prompt_log_probs(RESPONSE_STOP, [1, 2, 3, 4, 5])
    # SGLang may scale them by the request's temperature: only 0 and 1 give the untempered ones
    assert protocol.generate_request("r", [1], {**params, "temperature": 1.0}, 1)["logprob_start_len"] == 0
    with pytest.raises(ValueError, match=r"temperature 0\.7: the sglang adapter returns prompt log-probs only"):
        protocol.generate_request("r", [1], {**params, "temperature": 0.7}, 1)


def test_errors_map_to_our_exceptions():
    with pytest.raises(ValueError):
        protocol.check_control_response("/generate", 400, {"error": "bad"})
    with pytest.raises(ConnectionError):
        protocol.check_control_response("/generate", 503, "overloaded")
    with pytest.raises(RuntimeError, match="sglang /x failed \\(500\\)"):
        protocol.check_control_response("/x", 500, {"message": "boom"})
    with pytest.raises(RuntimeError, match="shape mismatch"):
        protocol.check_control_response("/update_weights_from_tensor", 200,
                                        {"success": False, "message": "shape mismatch"})
    assert protocol.check_control_response("/flush_cache", 200, "") == ""


def test_weight_bucket_becomes_tensor_update_payload_per_tp_rank():
    named = [("model.embed_tokens.weight", torch.randn(4, 3)), ("lm_head.weight", torch.arange(6.0).view(2, 3))]
    payload = protocol.tensor_update_payload(named, tp_size=2, version=9)
    assert payload["flush_cache"] is False and payload["abort_all_requests"] is False
    assert payload["weight_version"] == "9" and payload["load_format"] is None
    entries = payload["serialized_named_tensors"]
    assert len(entries) == 2 and all(isinstance(e, str) for e in entries)  # base64 text: JSON-safe
    for entry in entries:  # every rank rebuilds its own copy of the handles
        back = protocol.deserialize_named_tensors(entry)
        assert [n for n, _ in back] == [n for n, _ in named]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named))
    with pytest.raises(ValueError, match="tp_size"):
        protocol.tensor_update_payload(named, tp_size=0)


def test_serialized_handles_load_in_another_process():
    """CPU tensors travel as shared-memory handles: a separate process rebuilds them. SGLang's workers are
    multiprocessing children and share the parent's authkey, which the fd-passing handshake checks; so does this one."""
    import multiprocessing

    named = [("w", torch.linspace(-1, 1, 12).view(3, 4))]
    payload = protocol.serialize_named_tensors(named)
    code = ("import os, sys, multiprocessing as mp; mp.current_process().authkey = bytes.fromhex(os.environ['KEY']); "
            "from rollout_adapters.sglang.protocol import deserialize_named_tensors as d; "
            "[(n, t)] = d(sys.stdin.read()); print(n, float(t.sum()), tuple(t.shape))")
    env = {**os.environ, "KEY": multiprocessing.current_process().authkey.hex()}
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    name, total, shape = out.stdout.split(maxsplit=2)
    assert name == "w" and abs(float(total) - float(named[0][1].sum())) < 1e-6 and shape.strip() == "(3, 4)"


def test_distributed_update_and_group_payloads():
    metas = named_metas([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(5))])
    payload = protocol.distributed_update_payload(metas, "grp", version=4)
    assert payload["names"] == ["a", "b"] and payload["dtypes"] == ["bfloat16", "float32"]
    assert payload["shapes"] == [[2, 3], [5]] and payload["group_name"] == "grp" and payload["weight_version"] == "4"
    assert getattr(torch, payload["dtypes"][0]) is torch.bfloat16  # how the receiver resolves it
    with pytest.raises(ValueError, match="at least one tensor"):
        protocol.distributed_update_payload([], "grp")
    group = protocol.init_group_payload("10.0.0.1", 29500, 1, 3, "grp", "nccl")
    assert group == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
                     "group_name": "grp", "backend": "nccl"}
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        protocol.init_group_payload("h", 1, 0, 2, "g", "nccl")


def test_memory_abort_and_launch_translations():
    assert protocol.memory_payload(["weights", "kv_cache"]) == {"tags": ["weights", "kv_cache"]}
    with pytest.raises(ValueError, match="unknown memory tags"):
        protocol.memory_payload(["cuda_graph"])
    assert protocol.abort_all_payload() == {"rid": "", "abort_all": True}
    argv = protocol.server_command("/m", port=30001, tp_size=2, context_length=1024, weights_cpu_backup=True,
                                   extra_args=["--disaggregation-mode", "decode"])
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--context-length") + 1] == "1024"
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-weights-cpu-backup"):
        assert flag in argv
    assert argv[-2:] == ["--disaggregation-mode", "decode"]
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in protocol.SERVER_ENV  # tempered log-probs, as the trainer scores


def test_adapter_refuses_layouts_and_level_one_sleep_without_backup():
    with pytest.raises(ValueError, match="PP=1"):
        SGLangAdapter("/m", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="unknown sglang engine_kwargs"):
        SGLangAdapter("/m", engine_kwargs={"gpu_memory_utilization": 0.5})
    adapter = SGLangAdapter("/m", tensor_parallel_size=2)
    assert adapter.launch["tp_size"] == 2
    import asyncio

    with pytest.raises(NotImplementedError, match="sleep level 1"):
        asyncio.run(adapter._sleep(1))


def _deserialize_in_child(entry, outbox) -> None:
    torch.cuda.set_device(0)
    outbox.put([(n, str(t.device), t.double().sum().item()) for n, t in protocol.deserialize_named_tensors(entry)])


@pytest.mark.gpu
def test_serialized_cuda_handles_open_in_another_process():
    """On a GPU: each TP rank's entry carries CUDA IPC handles that a second process (an SGLang TP worker) opens."""
    import torch.multiprocessing as mp

    named = [("w", torch.randn(33, 7, device="cuda")), ("e", torch.randn(4, device="cuda", dtype=torch.bfloat16))]
    payload = protocol.tensor_update_payload(named, tp_size=2)
    ctx = mp.get_context("spawn")
    for entry in payload["serialized_named_tensors"]:
        outbox = ctx.Queue()
        child = ctx.Process(target=_deserialize_in_child, args=(entry, outbox))
        child.start()
        got = outbox.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert [(n, d) for n, d, _ in got] == [("w", "cuda:0"), ("e", "cuda:0")]
        for (_, _, got_sum), (_, t) in zip(got, named):
            assert got_sum == pytest.approx(t.double().sum().item(), abs=1e-6)
