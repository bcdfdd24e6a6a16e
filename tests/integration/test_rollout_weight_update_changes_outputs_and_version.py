"""A weight update from a stream of (hf_name, tensor) reaches the engine in place on each backend: afterwards the
outputs' log-probs match the new weights and no longer the old ones, the version advances and is returned with
every output, and loading the original weights back reproduces the original greedy output exactly."""

from __future__ import annotations

import pytest
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import (
    PROMPT,
    current_versions,
    exported,
    max_logprob_error,
    next_version,
    restore_seed0,
    run,
)

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_tokens": 24, "seed": 3, "ignore_eos": True}


def test_update_switches_weights_and_version(manager, hf_models):
    client = manager.client()
    before = run(client.generate("upd-before", PROMPT, GREEDY))
    assert before.version == current_versions(manager)[0]
    assert max_logprob_error(hf_models[0], PROMPT, before) <= 1e-4

    version = next_version()
    update = exported(hf_models[1])  # the tied lm_head is not sent: the logits follow the embedding
    loaded = manager.update_weights(update.items(), version)
    try:
        assert loaded == [len(update)]
        assert current_versions(manager) == [version]
        after = run(client.generate("upd-after", PROMPT, SAMPLED))
        assert after.version == version > before.version
        assert max_logprob_error(hf_models[1], PROMPT, after) <= 1e-4
        assert max_logprob_error(hf_models[0], PROMPT, after) > 1e-2, "log-probs still follow the old weights"
        greedy_new = run(client.generate("upd-greedy", PROMPT, GREEDY))
        assert greedy_new.token_ids != before.token_ids
    finally:
        restore_seed0(manager, hf_models)
    back = run(client.generate("upd-back", PROMPT, GREEDY))
    assert back.token_ids == before.token_ids and back.version > version
    assert max_logprob_error(hf_models[0], PROMPT, back) <= 1e-4
