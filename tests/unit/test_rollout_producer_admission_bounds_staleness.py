"""The rollout producer's admission rule bounds staleness before any work is spent: in a simulated run (groups
generate while the actor trains, versions advance per step) no group trains more than `staleness_threshold`
versions after it started, whether generation is faster or slower than training, and with a threshold >= 1
generation overlaps training. Prompts drawn but not trained on are re-issued first after a checkpoint load; a group
that never finishes fails the run naming rollout.generate_timeout_s; with dynamic sampling a step takes a short
batch once max_sample_rounds × B groups were evicted instead of waiting forever."""

import itertools

import pytest

from mrl.data.replay_buffer import ReplayBuffer
from mrl.trainer.producer import RolloutProducer, may_start

B = 4  # groups per step


def simulate(threshold: int, gen_s: float, train_s: float, steps: int = 12) -> tuple[list[int], int]:
    """Time-stepped: (staleness of every trained group, ticks in which groups generated while the actor trained)."""
    tick = 0.01
    version = consumed = overlapped = 0
    in_flight: list[tuple[float, int]] = []  # (finish time, version at start)
    buffered: list[int] = []
    ages: list[int] = []
    training_until = None
    for t in (i * tick for i in itertools.count()):
        if training_until is not None and t >= training_until:
            version, training_until = version + 1, None  # the step's sync
        while may_start(consumed, len(buffered), len(in_flight), version, threshold, B):
            in_flight.append((t + gen_s, version))
        overlapped += training_until is not None and bool(in_flight)
        buffered += [v for done, v in in_flight if done <= t]
        in_flight = [(done, v) for done, v in in_flight if done > t]
        if training_until is None and len(buffered) >= B:
            taken, buffered = buffered[:B], buffered[B:]
            consumed += B
            ages += [version - v for v in taken]
            training_until = t + train_s
            if consumed == steps * B:
                return ages, overlapped
    raise AssertionError("unreachable")


@pytest.mark.parametrize("threshold", [0, 1, 2])
@pytest.mark.parametrize(("gen_s", "train_s"), [(0.05, 0.5), (0.5, 0.05), (0.3, 0.3)])
def test_no_group_trains_staler_than_the_threshold(threshold, gen_s, train_s):
    ages, overlapped = simulate(threshold, gen_s, train_s)
    assert max(ages) <= threshold
    if threshold == 0:
        assert ages == [0] * len(ages) and overlapped == 0  # on-policy: generation waits for every sync
    else:
        assert overlapped > 0 and max(ages) == threshold  # the bound is used, not just respected


def test_admission_formula():
    assert may_start(consumed=0, buffered=3, in_flight=4, version=0, staleness_threshold=1, groups_per_step=4)
    assert not may_start(consumed=0, buffered=4, in_flight=4, version=0, staleness_threshold=1, groups_per_step=4)
    assert may_start(consumed=4, buffered=0, in_flight=4, version=1, staleness_threshold=1, groups_per_step=4)


def rows(k: int) -> list[dict]:
    return [{"uid": f"p{i}", "messages": []} for i in range(k)]


def test_checkpoint_state_reissues_drawn_prompts_first():
    submitted: list[str] = []

    def submit(prompt, index):
        submitted.append(prompt["uid"].split("@")[0])
        return object()  # stands in for the ObjectRef of the group's trajectories

    def producer():
        return RolloutProducer(submit, lambda t, p: None, iter([rows(6), rows(6)]), ReplayBuffer(), n=2,
                               groups_per_step=2, staleness_threshold=1)

    first = producer()
    first._fill()  # starts (0 + 1 + 1) × 2 = 4 groups; 2 prompts of the batch stay pending
    assert submitted == ["p0", "p1", "p2", "p3"]
    state = first.state_dict()
    assert [r["uid"] for r in state["reissue"]] == ["p0", "p1", "p2", "p3", "p4", "p5"]
    submitted.clear()
    resumed = producer()
    resumed.load_state_dict(state, version=3)
    assert resumed.consumed == 6 and resumed.started == 4
    resumed._fill()
    assert submitted == ["p0", "p1", "p2", "p3"]  # the saved prompts, in order, before any new draw


def test_a_group_past_the_generate_timeout_fails_naming_the_knob():
    producer = RolloutProducer(lambda prompt, index: object(), lambda t, p: None, iter([rows(2)]), ReplayBuffer(),
                               n=1, groups_per_step=1, staleness_threshold=0, group_timeout_s=0.0)
    producer._fill()
    with pytest.raises(TimeoutError, match=r"p0@\w+'\] did not finish within 0 s \(rollout\.generate_timeout_s\)"):
        producer._check_overdue()


def test_dynamic_sampling_takes_a_short_batch_once_the_eviction_budget_is_spent():
    buffer = ReplayBuffer(filter_equal_rewards=True)
    producer = RolloutProducer(lambda prompt, index: object(), lambda t, p: None, iter([rows(2)]), buffer, n=2,
                               groups_per_step=2, staleness_threshold=1, max_evictions_per_step=2)
    group = [{"uid": "kept", "score": s, "min_version": 0, "max_version": 0} for s in (0.0, 1.0)]
    buffer.add(group, n=2)
    for uid in ("solved-a", "solved-b"):  # all-equal rewards: evicted on arrival, as the producer adds them
        buffer.add([{"uid": uid, "score": 1.0, "min_version": 0, "max_version": 0}] * 2, n=2)
    assert [t["uid"] for t in producer.take(2, current_version=0, poll_s=0.01)] == ["kept", "kept"]
    assert producer.consumed == 1
