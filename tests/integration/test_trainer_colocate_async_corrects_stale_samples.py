"""colocate_async at staleness 2 with the rollout correction on (IcePop: token IS and token rejection): the producer
starts three steps' worth of groups on version 0, so step k trains on samples k − 1 versions old; their π_old
(recomputed by the trained actor) drifts from π_rollout, and the step's `rollout_corr/*` metrics show it per
staleness level: fresh samples agree with the engine (weights 1), stale ones carry weights ≠ 1 and a growing
mismatch KL. The loss reads the rollout's log-probs as a field of their own beside π_old."""

from __future__ import annotations

import pytest
from trainer_fixtures import KeepsStepTensors, stepped, tiny_trainer

from mrl.trainer.modes import ColocateAsyncTrainer

pytestmark = pytest.mark.integration

B, M, N, STEPS = 2, 1, 2, 3


class Trainer(KeepsStepTensors, ColocateAsyncTrainer):
    pass


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    trainer = tiny_trainer(Trainer, "tiny/grpo_colocate_async", tmp_path_factory.mktemp("corrected_async"), [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        "data.max_response_length=16", f"trainer.total_training_steps={STEPS}",
        "weight_sync.staleness_threshold=2", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=1.5", "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.rollout_rs_threshold=1.5",
    ], list("abc"), prompts=16)
    with stepped(trainer, STEPS) as result:
        yield result


def test_stale_samples_get_weights_and_fresh_ones_do_not(run):
    _, metrics, _ = run
    assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 2.0]
    fresh = metrics[0]
    assert fresh["rollout_corr/staleness_0/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert fresh["rollout_corr/rs_masked_frac"] == 0.0
    kl = {k: metrics[k]["rollout_corr/mismatch_kl"] for k in range(STEPS)}
    assert min(kl[1], kl[2]) > 100 * max(kl[0], 1e-9)  # trained-on weights drift from the ones that sampled
    stale = metrics[1:]  # the rows of the old log-prob pass: those of the step's second update
    assert max(m[f"rollout_corr/staleness_{k}/is_weight_std"] for k, m in enumerate(stale, 1)) > 0
    assert all(m["rollout_corr/is_weight_max"] <= 1.5 for m in metrics)  # truncated at C
    assert max(m["rollout_corr/rs_masked_frac"] for m in stale) > 0  # IcePop drops tokens outside [1/1.5, 1.5]
    for m in metrics:
        assert m["rollout_corr/ppl_ratio"] > 0 and m["actor/updates"] == B * N // (M * N)


def test_the_three_log_probs_stay_separate_fields(run):
    trainer, _, _ = run
    # the rows of the step's first update trained on-policy (no stored π_old); the others have both fields
    stored = [v for v in trainer.step_payloads[-1].values() if "old_log_probs" in v]
    assert stored and all("rollout_log_probs" in v for v in stored)
    drift = max(float((v["old_log_probs"] - v["rollout_log_probs"]).abs().max()) for v in stored)
    assert drift > 1e-3  # π_old recomputed by the twice-trained actor, π_rollout as sampled two versions back
