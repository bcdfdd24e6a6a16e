"""Trainer metrics of multi-turn trajectories, against hand-computed values."""

import pytest

from mrl.trainer.metrics import agent_loop_metrics


def test_turns_calls_errors_time_and_observation_share():
    records = [
        {"num_turns": 3, "tool_calls": 2, "tool_errors": 1, "tool_seconds": 0.5, "response_len": 100,
         "model_tokens": 60},
        {"num_turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "response_len": 20,
         "model_tokens": 20},
        {"num_turns": 2, "tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.25, "response_len": 40,
         "model_tokens": 30},
    ]
    m = agent_loop_metrics(records)
    assert m["rollout/turns_mean"] == 2.0
    assert m["rollout/tool_calls_mean"] == 1.0
    assert m["rollout/tool_errors"] == 2.0 and m["rollout/tool_error_rate"] == pytest.approx(2 / 3)
    assert m["rollout/tool_seconds"] == 0.75
    assert m["rollout/observation_token_share"] == pytest.approx(50 / 160)
    assert m["rollout/tool_success_rate"] == pytest.approx(1 / 3)  # only the first has a call without error
    assert set(agent_loop_metrics(records, prefix="val")) == {k.replace("rollout/", "val/") for k in m}
