"""The unified sampling dict (defaults, greedy as temperature 0, validation), the token budget (response length and
context), weight buckets (size bound, exact round trip), replica layouts (PP > 1 refused by backends without it,
replica count = devices / footprint), and the hf backend's sampler (greedy, top-k, top-p, raw log-probs)."""

from __future__ import annotations

import pytest
import torch

from mrl.rollout.manager import replica_count
from mrl.rollout.replica import Footprint
from rollout_adapters.base import SleepState, normalize_sampling, token_budget
from rollout_adapters.buckets import pack_buckets, unpack_bucket
from rollout_adapters.hf.adapter import sample_token


def test_sampling_defaults_greedy_and_validation():
    params = normalize_sampling({"temperature": 0, "top_k": 0, "stop_token_ids": [3, 4]})
    assert params["temperature"] == 0 and params["top_k"] == -1 and params["stop_token_ids"] == (3, 4)
    assert normalize_sampling(None)["max_tokens"] > 0
    for bad, match in (
        ({"n": 2}, "generate_n"),
        ({"temprature": 1.0}, "unknown sampling keys"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            normalize_sampling(bad)


def test_token_budget_respects_response_and_context_length():
    assert token_budget(prompt_len=10, max_tokens=50, max_model_len=100) == 50
    assert token_budget(prompt_len=90, max_tokens=50, max_model_len=100) == 10
    assert token_budget(prompt_len=120, max_tokens=50, max_model_len=100) == 0


def test_buckets_bound_size_and_roundtrip_exactly():
    tensors = [(f"w{i}", torch.randn(16, 16)) for i in range(10)] + [("big", torch.randn(64, 64))]
    blobs = list(pack_buckets(iter(tensors), bucket_bytes=4 * 16 * 16 * 3))
    assert len(blobs) == 5  # 3 + 3 + 3 + 1 small ones, then the oversized tensor alone
    back = dict(pair for blob in blobs for pair in unpack_bucket(blob))
    assert set(back) == {name for name, _ in tensors}
    assert all(torch.equal(back[name], t) for name, t in tensors)
    with pytest.raises(ValueError, match="repeats"):
        list(pack_buckets([("a", torch.ones(1)), ("a", torch.ones(1))]))


def test_layouts_and_replica_count():
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2: the 'hf'"):
        Footprint(pp=2).check("hf")
    with pytest.raises(ValueError, match="'hf' backend runs one device"):
        Footprint(tp=2).check("hf")
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2: the 'sglang'"):
        Footprint(pp=2).check("sglang")
    with pytest.raises(ValueError, match="not a known backend"):
        Footprint().check("tgi")
    Footprint(tp=2, pp=2).check("vllm")
    Footprint(tp=2, pp=2).check("trtllm")
    assert Footprint(tp=2, dp=2, pp=2).devices == 8
    assert replica_count(8, 2) == 4
    with pytest.raises(ValueError, match="multiple of the replica footprint"):
        replica_count(6, 4)


def test_wake_up_order_is_weights_then_kv_cache():
    state = SleepState()
    state.sleep(2)
    with pytest.raises(RuntimeError, match="weights are still asleep"):
        state.wake_up(["kv_cache"])
    assert state.wake_up(["kv_cache", "weights"]) == ["weights", "kv_cache"]
    assert not state.asleep and state.level == 0
    with pytest.raises(ValueError, match="sleep level"):
        state.sleep(3)


def test_hf_sampler_greedy_topk_topp_and_logprobs_of_the_sampled_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    raw = torch.log_softmax(logits, -1)
    gen = torch.Generator().manual_seed(0)
    base = normalize_sampling({})
    token, logp = sample_token(logits, {**base, "temperature": 0}, gen)
    assert token == 0 and logp == pytest.approx(float(raw[0]))
    topk = {sample_token(logits, {**base, "temperature": 5.0, "top_k": 2}, gen)[0] for _ in range(200)}
    assert topk == {0, 1}
    # softmax(logits) ≈ [0.563, 0.207, 0.126, 0.076, 0.028]: the 0.7 nucleus is {0, 1}; 0.85 adds 2.
    assert {sample_token(logits, {**base, "top_p": 0.7}, gen)[0] for _ in range(300)} == {0, 1}
    assert {sample_token(logits, {**base, "top_p": 0.85}, gen)[0] for _ in range(300)} == {0, 1, 2}
    token, logp = sample_token(logits, {**base, "temperature": 3.0}, gen)
    # The trainer scores softmax(z / T): the log-prob is of the tempered distribution the token came from.
    assert logp == pytest.approx(float(torch.log_softmax(logits / 3.0, -1)[token]))
    token, logp = sample_token(logits, {**base, "temperature": 5.0, "top_k": 2}, gen)
    assert logp == pytest.approx(float(torch.log_softmax(logits[:2] / 5.0, -1)[token]))


@pytest.mark.parametrize("seeded", [True, False])
def test_trainer_seeds_each_request_unless_seed_requests_is_off(seeded):
    from types import SimpleNamespace

    from mrl.config.schema import RolloutConfig, TrainerConfig
    from mrl.trainer.ppo_trainer import PPOTrainer

    trainer = SimpleNamespace(config=SimpleNamespace(rollout=RolloutConfig(seed_requests=seeded),
                                                     trainer=TrainerConfig(seed=5)), global_steps=3)
    trainer.request_seed = lambda offset: PPOTrainer.request_seed(trainer, offset)
    train, val = PPOTrainer.sampling(trainer, train=True), PPOTrainer.sampling(trainer, train=False)
    if seeded:  # distinct per step and between training and validation draws
        assert train["seed"] == 5 * 1_000_003 + 3 * 10_007 and val["seed"] == train["seed"] + 7
    else:
        assert train["seed"] is None and val["seed"] is None
    assert normalize_sampling(train)["seed"] == train["seed"]  # what every adapter receives
