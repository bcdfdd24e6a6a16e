"""PDRouter over real in-process hf adapters standing in for the members (the KV transfer itself is the engines';
tests/integration/test_pd_vllm_cpu_* runs it with vLLM). Each member records the transfer parameters it was given
and answers with its own, so the test sees which member got which request with which handshake.

Proves: vLLM flow (prefill gets the prompt with max_tokens 1 and do_remote_decode, the decode partner gets the
prefill's answer and produces the sample); SGLang flow (both get one bootstrap room, the decode produces the sample);
sessions stick to one decode partner and concurrent sessions spread; weight updates and control calls reach every
member and versions agree.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mrl.models.tiny import make_tiny_hf_model
from mrl.rollout.pd import TRANSFER, VLLM_PREFILL_TRANSFER, LocalMember, PDRouter
from rollout_adapters.buckets import pack_buckets
from rollout_adapters.hf.adapter import HFAdapter

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0, "max_tokens": 4, "seed": 0}


class RecordingMember(HFAdapter):
    """An hf adapter that notes each request's transfer parameters and returns a handshake naming itself."""

    def __init__(self, name: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        self.seen: list[tuple[dict, int]] = []

    async def _generate(self, request_id, prompt_ids, params, budget):
        transfer = TRANSFER.get()
        if transfer is not None:
            self.seen.append((transfer["send"], budget))
            transfer["received"] = {"from": self.name, "request": request_id}
        return await super()._generate(request_id, prompt_ids, params, budget)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("pd") / "qwen2", seed=0))


def _router(backend: str, model_dir: str, n_decode: int) -> tuple[PDRouter, list[RecordingMember]]:
    names = ["prefill"] + [f"d{i}" for i in range(n_decode)]
    members = [RecordingMember(n, model_dir, max_model_len=256) for n in names]
    router = PDRouter(backend, LocalMember(members[0]), [LocalMember(m) for m in members[1:]],
                      bootstrap=("127.0.0.1", 8998) if backend == "sglang" else None)
    return router, members


def test_vllm_flow_prefills_one_token_then_decodes_with_the_handshake(model_dir):
    router, (prefill, decode) = _router("vllm", model_dir, 1)

    async def scenario():
        return await router.generate("s", PROMPT, GREEDY), await decode.generate("plain", PROMPT, GREEDY)

    out, plain = asyncio.run(scenario())
    assert prefill.seen == [(VLLM_PREFILL_TRANSFER, 1)]  # max_tokens 1 on the prefill server
    [(send, budget)] = decode.seen
    assert send["from"] == "prefill" and send["request"].startswith("s-") and budget == 4
    assert out.token_ids == plain.token_ids and out.log_probs == plain.log_probs  # the sample is the decode's
    assert out.extra["pd_decode"] == "decode0"


def test_vllm_flow_with_no_room_left_returns_the_prefill_answer(model_dir):
    router, (_, decode) = _router("vllm", model_dir, 1)
    full = asyncio.run(router.generate("s", list(range(1, 257)), GREEDY))  # the prompt fills max_model_len
    assert full.token_ids == [] and full.stop_reason == "length" and decode.seen == []


def test_sglang_flow_sends_one_room_to_both_servers(model_dir):
    router, (prefill, decode) = _router("sglang", model_dir, 1)
    out = asyncio.run(router.generate("s", PROMPT, GREEDY))
    [(p_send, p_budget)], [(d_send, d_budget)] = prefill.seen, decode.seen
    assert p_send == d_send and p_send["bootstrap_host"] == "127.0.0.1" and p_send["bootstrap_port"] == 8998
    assert p_budget == d_budget == 4 and len(out.token_ids) == 4


def test_sessions_stick_and_concurrent_sessions_spread(model_dir):
    router, members = _router("vllm", model_dir, 2)

    async def scenario():
        a, b = await asyncio.gather(router.generate("a", PROMPT, GREEDY), router.generate("b", PROMPT, GREEDY))
        a2 = await router.generate("a", PROMPT + a.token_ids, GREEDY)
        return a, b, a2

    a, b, a2 = asyncio.run(scenario())
    assert {a.extra["pd_decode"], b.extra["pd_decode"]} == {"decode0", "decode1"}
    assert a2.extra["pd_decode"] == a.extra["pd_decode"]
    assert len(members[0].seen) == 3  # every request went through the prefill server
    assert sorted(router.routes.values()) == [1, 2]


def test_a_burst_in_one_call_spreads_and_matches_single_calls(model_dir):
    """`generate_many` (what the rollout client sends a server a loop tick's calls with) runs each call through
    the PD flow: results come back by index, with what the same call alone returns, spread over the decodes."""
    router, members = _router("vllm", model_dir, 2)
    prompts = [PROMPT, PROMPT[:3], PROMPT[1:]]

    async def scenario():
        results = {}
        async for group in router.generate_many([(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)]):
            results.update(group)
        singles = [await members[1].generate(f"plain{i}", p, GREEDY) for i, p in enumerate(prompts)]
        return results, singles

    results, singles = asyncio.run(scenario())
    assert sorted(results) == [0, 1, 2]
    assert [results[i].token_ids for i in range(3)] == [s.token_ids for s in singles]
    assert {results[i].extra["pd_decode"] for i in range(3)} == {"decode0", "decode1"}
    assert len(members[0].seen) == 3  # each went through the prefill server


def test_weight_updates_and_control_reach_every_member(model_dir):
    router, members = _router("vllm", model_dir, 2)
    state = {k: v + 0.5 for k, v in members[0].model.state_dict().items()}

    async def scenario():
        before = await router.generate("s", PROMPT, GREEDY)
        counts = await router.update_weights(list(pack_buckets(state.items())), 3)
        after = await router.generate("s", PROMPT, GREEDY)
        await router.abort_all()
        await router.resume_generation()
        await router.release_kv_cache()
        await router.resume_kv_cache()
        return before, counts, after, await router.health()

    before, counts, after, health = asyncio.run(scenario())
    assert counts == {"prefill": len(state), "decode0": len(state), "decode1": len(state)}
    assert health["versions_agree"] and health["version"] == 3 and after.version == 3 and before.version == 0
    assert after.log_probs != before.log_probs
    for member in members:
        # The update is gated router-wide: every member stops admitting before any loads.
        assert list(member.events) == ["abort_all", "update_weights:3", "clear_kv_cache", "resume_generation",
                                 "abort_all", "resume_generation", "release_kv_cache", "wake_up:kv_cache"]
        assert torch.equal(member.model.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_update_during_generation_keeps_versions_whole_and_caller_pause(model_dir):
    """A request running when the update starts returns aborted under the old version; one sent during the update
    waits and runs entirely on the new weights; an update inside the caller's abort -> resume window does not
    reopen admission early."""
    router, members = _router("vllm", model_dir, 1)
    state = {k: v * 1.01 for k, v in members[0].model.state_dict().items()}
    long = {"max_tokens": 200, "ignore_eos": True, "seed": 1}

    async def until(predicate):
        while not predicate():
            await asyncio.sleep(0.01)

    async def scenario():
        running = asyncio.create_task(router.generate("r", PROMPT, long))
        await asyncio.wait_for(until(lambda: members[1]._running), 60)
        update = asyncio.create_task(router.update_weights(list(pack_buckets(state.items())), 4))
        await asyncio.wait_for(until(lambda: members[0].events), 60)  # admission closed on the prefill member
        parked = asyncio.create_task(router.generate("p", PROMPT, GREEDY))
        await update
        aborted, after = await running, await parked
        await router.abort_all()
        await router.update_weights(list(pack_buckets(state.items())), 5)
        paused = [(await m.health())["paused"] for m in members]
        await router.resume_generation()
        return aborted, after, paused

    aborted, after, paused = asyncio.run(scenario())
    assert aborted.stop_reason == "aborted" and aborted.version == 0
    assert after.stop_reason == "length" and after.version == 4
    assert paused == [True, True]


def test_router_refuses_incomplete_members(model_dir):
    with pytest.raises(ValueError, match="at least one decode"):
        PDRouter("vllm", None, [])
    with pytest.raises(ValueError, match="bootstrap"):
        PDRouter("sglang", None, [None])
    with pytest.raises(ValueError, match="no PD routing"):
        PDRouter("trtllm", None, [None])
