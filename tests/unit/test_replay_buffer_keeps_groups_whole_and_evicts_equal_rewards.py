"""Replay buffer: groups enter and leave whole, all-equal-reward groups are evicted under dynamic sampling (their
store keys queued for deletion, like the surplus a sync step clears), and no-op padding makes counts divisible
without contributing a single loss token."""

import pytest

from mrl.data.replay_buffer import ReplayBuffer, pad_with_noops


def group(uid: str, scores: list[float]) -> list[dict]:
    return [
        {"key": f"{uid}-{i}", "uid": uid, "score": s, "prompt_len": 2, "response_len": i + 1, "min_version": 0}
        for i, s in enumerate(scores)
    ]


def test_dynamic_sampling_evicts_groups_whose_rewards_are_all_equal():
    buffer = ReplayBuffer(filter_equal_rewards=True)
    kept = buffer.add(group("a", [1, 1]) + group("b", [0, 1]) + group("c", [0, 0]), n=2)
    assert kept == 1 and buffer.evicted == 2 and buffer.added == 3
    assert not buffer.ready(2)
    buffer.add(group("d", [1, 0]), n=2)
    buffer.add(group("e", [0, 1]), n=2)
    out = buffer.sample(2)
    assert [t["uid"] for t in out] == ["b", "b", "d", "d"]  # whole groups, oldest first
    assert buffer.take_discarded() == ["a-0", "a-1", "c-0", "c-1"] and buffer.discarded == []
    assert buffer.keys() == ["e-0", "e-1"]
    assert buffer.clear() == 1 and len(buffer) == 0  # the surplus group "e"
    assert buffer.take_discarded() == ["e-0", "e-1"]


def test_without_dynamic_sampling_every_group_is_kept():
    buffer = ReplayBuffer()
    buffer.add(group("a", [1, 1]) + group("b", [0, 0]), n=2)
    assert len(buffer) == 2 and buffer.evicted == 0


def test_a_group_must_hold_one_prompt():
    with pytest.raises(ValueError, match="one uid"):
        ReplayBuffer().add(group("a", [1]) + group("b", [0]), n=2)
    with pytest.raises(ValueError, match="groups of 2"):
        ReplayBuffer().add(group("a", [1, 0, 1]), n=2)


def test_noop_padding_makes_counts_divisible_with_flagged_copies():
    samples = group("a", [1, 0, 1])
    padded = pad_with_noops(samples, 4)
    assert len(padded) == 4 and padded[:3] == samples
    noop = padded[3]
    assert noop["is_noop"] and noop["score"] == 0.0 and noop["uid"] == "noop-0"
    # the shortest sample's tokens (workers zero its mask, samples.fetch) under a key of its own
    assert noop["noop_of"] == samples[0]["key"] and noop["key"] not in {t["key"] for t in samples}
    assert pad_with_noops(samples, 3) == samples
