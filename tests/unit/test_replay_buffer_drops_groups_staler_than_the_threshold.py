"""Staleness control: with a threshold, groups holding a sample more than `threshold` versions behind the trainer
(partial rollouts count from their oldest token) are dropped whole before a step takes its groups, and counted."""

from mrl.data.replay_buffer import ReplayBuffer


def group(uid: str, versions: list[tuple[int, int]]) -> list[dict]:
    return [{"key": f"{uid}-{i}", "uid": uid, "score": float(i), "min_version": lo, "max_version": hi}
            for i, (lo, hi) in enumerate(versions)]


def test_groups_staler_than_the_threshold_are_dropped_whole():
    buffer = ReplayBuffer(staleness_threshold=1)
    buffer.add(group("old", [(0, 0), (0, 0)]), n=2)
    buffer.add(group("spans", [(1, 2), (2, 2)]), n=2)  # one sample began on version 1
    buffer.add(group("fresh", [(2, 3), (3, 3)]), n=2)
    assert buffer.staleness(3) == [3, 3, 2, 1, 1, 0]
    taken = buffer.sample(1, current_version=3)
    assert [t["uid"] for t in taken] == ["fresh", "fresh"]  # "old" (3 behind) and "spans" (2 behind) dropped
    assert buffer.dropped_stale == 2 and len(buffer) == 0
    assert buffer.take_discarded() == ["old-0", "old-1", "spans-0", "spans-1"]  # for deletion from the store


def test_at_the_threshold_is_kept_and_no_threshold_keeps_everything():
    buffer = ReplayBuffer(staleness_threshold=1)
    buffer.add(group("a", [(2, 2), (2, 3)]), n=2)
    assert buffer.drop_stale(3) == 0 and buffer.ready(1)
    unbounded = ReplayBuffer()
    unbounded.add(group("a", [(0, 0), (0, 0)]), n=2)
    assert unbounded.drop_stale(100) == 0 and unbounded.sample(1, current_version=100)

