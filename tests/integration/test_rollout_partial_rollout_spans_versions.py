"""Partial rollout on each backend: a long request is aborted mid-generation for a weight sync; the fully-async
client retries at once with the tokens so far appended to the prompt and a smaller budget; the retry waits in the
paused server, runs on the new weights after resume, and the trajectory completes as the concatenation of both
spans, each scored by the weights that produced it, with min_version < max_version recorded."""

from __future__ import annotations

import asyncio

import pytest
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import (
    MAX_MODEL_LEN,
    PROMPT,
    current_versions,
    exported,
    max_logprob_error,
    next_version,
    restore_seed0,
    run,
    wait_for,
)

from rollout_adapters.base import TokenOutput

pytestmark = pytest.mark.integration

BUDGET = MAX_MODEL_LEN - len(PROMPT) - 8


def test_abort_update_resume_completes_trajectory(manager, hf_models):
    client = manager.client(fully_async=True)
    replica = next(iter(manager.replicas.values()))
    old_version = current_versions(manager)[0]
    new_version = next_version()

    async def scenario():
        sampling = {"temperature": 1.0, "max_tokens": BUDGET, "seed": 5, "ignore_eos": True}
        trajectory = asyncio.create_task(client.generate("partial-1", PROMPT, sampling))
        await wait_for(replica, "in_flight", 1)
        # Let it produce some tokens, not all: the hf backend on an idle host finishes the budget in about a second
        # (a 1 s pause here let the request complete before the abort in whole-suite runs).
        await asyncio.sleep(0.3)
        aborted = await replica.abort_all()
        assert aborted == 1, "the request finished before the abort: nothing to continue"
        # The client's retry is now parked in the paused server: it must not run on the old weights.
        await wait_for(replica, "waiting", 1)
        assert not trajectory.done()
        await asyncio.to_thread(manager.update_weights, exported(hf_models[1]).items(), new_version)
        await replica.resume_generation()
        return aborted, await trajectory

    try:
        aborted, out = run(scenario())
        assert aborted == 1
        assert out.num_aborts == 1 and out.stop_reason == "length" and len(out.token_ids) == BUDGET
        assert out.min_version == old_version < out.max_version == new_version == out.version
        (start0, end0, v0), (start1, end1, v1) = out.spans
        assert (start0, end1, v0, v1) == (0, BUDGET, old_version, new_version) and 0 < end0 == start1 < BUDGET
        first = TokenOutput(out.token_ids[:end0], out.log_probs[:end0], "aborted", v0)
        second = TokenOutput(out.token_ids[end0:], out.log_probs[end0:], "length", v1)
        assert max_logprob_error(hf_models[0], PROMPT, first) <= 1e-4
        assert max_logprob_error(hf_models[1], PROMPT + first.token_ids, second) <= 1e-4
        assert max_logprob_error(hf_models[0], PROMPT + first.token_ids, second) > 1e-2
    finally:
        restore_seed0(manager, hf_models)
