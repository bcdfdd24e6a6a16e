"""`algorithm.rollout_correction` reaches the actor loss: each correction's loss and gradient against hand-computed
values, the rows `actor.on_policy_first_update` trains on-policy corrected like stored ones, exact step metrics
summed over ranks and split by staleness, and start-up validation that names the setting."""

import math

import pytest
import torch

from mrl.algo.actor_loss import ActorLossConfig, actor_loss
from mrl.algo.rollout_correction import (
    RolloutCorrectionConfig,
    correction_metrics,
    correction_stats,
)
from mrl.config.startup import ConfigError, load_config
from mrl.workers.actor_rollout_ref import actor_loss_config, make_actor_loss_fn

# ρ = π_old / π_rollout per token; row 1's third token is masked (its ρ = 100 must never matter)
RHO = [[3.0, 0.5, 1.5], [0.25, 1.2, 100.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
N_TOKENS = 5


def _log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = -torch.rand(2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.1
    return rollout + torch.tensor(RHO, dtype=torch.float64).log(), rollout


def _loss_and_grad(correction: RolloutCorrectionConfig, current_shift: torch.Tensor | None = None):
    """Token-mean loss with A = 1 everywhere; π_θ = π_old unless shifted (log-ratio per token)."""
    old, rollout = _log_probs()
    log_prob = (old + (current_shift if current_shift is not None else 0.0)).requires_grad_(True)
    config = ActorLossConfig(rollout_correction=correction)
    loss, metrics = actor_loss(log_prob, old, torch.ones_like(old), MASK, None, config, rollout_log_prob=rollout)
    loss.backward()
    return float(loss.detach()), log_prob.grad, metrics


# With π_θ = π_old the PPO term is −A·ratio = −1 per token and its gradient −w_t / N; the denominator stays N = 5.
CASES = {
    "token TIS, C = 2": (RolloutCorrectionConfig(rollout_is="token"), [[2.0, 0.5, 1.5], [0.25, 1.2, 0.0]]),
    "sequence TIS, C = 2 (Π ρ = 2.25 → 2, 0.3)": (
        RolloutCorrectionConfig(rollout_is="sequence"), [[2.0, 2.0, 2.0], [0.3, 0.3, 0.0]]),
    "token RS [0.4, 2]": (RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0,
                                                  rollout_rs_threshold_lower=0.4), [[0, 1, 1], [0, 1, 0]]),
    "sequence RS [0.5, 3] (arithmetic)": (RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=3.0,
                                                                  rollout_rs_threshold_lower=0.5),
                                          [[1, 1, 1], [0, 0, 0]]),
    "geometric RS [0.6, 2] (1.31 kept, 0.548 dropped)": (
        RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.6),
        [[1, 1, 1], [0, 0, 0]]),
    "IcePop [0.4, 2.5]": (RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.5, rollout_rs="token",
                                                  rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.4),
                          [[0.0, 0.5, 1.5], [0.0, 1.2, 0.0]]),
    "veto 0.3 (row 1 holds 0.25)": (RolloutCorrectionConfig(rollout_token_veto_threshold=0.3),
                                    [[1, 1, 1], [0, 0, 0]]),
    "decoupled, cap 2": (RolloutCorrectionConfig(use_decoupled_loss=True, behav_imp_weight_cap=2.0),
                         [[0.0, 0.5, 1.5], [0.25, 1.2, 0.0]]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_correction_weighs_the_policy_gradient_by_hand(name):
    correction, weights = CASES[name]
    w = torch.tensor(weights, dtype=torch.float64)
    loss, grad, _ = _loss_and_grad(correction)
    assert loss == pytest.approx(-float(w.sum()) / N_TOKENS)
    torch.testing.assert_close(grad, -w / N_TOKENS)


def test_decoupled_clips_around_the_proximal_policy_and_weights_by_the_behaviour_one():
    # token 1: π_θ / π_old = 1.5 is clipped to 1.2 (A > 0): loss −1.2·0.5 and no gradient there
    shift = torch.zeros(2, 3, dtype=torch.float64)
    shift[0, 1] = math.log(1.5)
    loss, grad, metrics = _loss_and_grad(RolloutCorrectionConfig(use_decoupled_loss=True), shift)
    assert loss == pytest.approx(-(3.0 + 1.2 * 0.5 + 1.5 + 0.25 + 1.2) / N_TOKENS)
    torch.testing.assert_close(grad, -torch.tensor([[3.0, 0.0, 1.5], [0.25, 1.2, 0.0]], dtype=torch.float64) / 5)
    assert float(metrics["actor/behav_imp_weight"]) == pytest.approx((3.0 + 0.5 + 1.5 + 0.25 + 1.2) / 5)
    # without a cap, decoupled PPO is token IS with no truncation (both clip around π_old here)
    untruncated, _, _ = _loss_and_grad(RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9), shift)
    assert untruncated == pytest.approx(loss)


def test_off_means_plain_ppo_and_on_without_rollout_log_probs_is_an_error():
    old, rollout = _log_probs()
    plain, _ = actor_loss(old, old, torch.ones_like(old), MASK, None, ActorLossConfig(), rollout_log_prob=rollout)
    assert float(plain) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        actor_loss(old, old, torch.ones_like(old), MASK, None,
                   ActorLossConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token")))


@pytest.mark.parametrize("name", CASES)
def test_rows_trained_on_policy_are_corrected_against_the_rollout_like_stored_rows(name):
    """`on_policy_first_update`: π_old is the forward's own log-probs (no stored field); the weights against the
    rollout's log-probs apply as for a stored π_old equal to them."""
    correction, weights = CASES[name]
    old, rollout = _log_probs()
    config = ActorLossConfig(rollout_correction=correction)
    grads = []
    for on_policy, mb in ((True, {}), (False, {"old_log_probs": old.clone()})):
        log_prob = old.clone().requires_grad_(True)
        mb = {**mb, "advantages": torch.ones_like(old), "response_mask": MASK, "rollout_log_probs": rollout}
        loss, _ = make_actor_loss_fn(config, on_policy=on_policy)({"log_probs": log_prob}, mb, None)
        loss.backward()
        grads.append((float(loss.detach()), log_prob.grad))
    (on_loss, on_grad), (stored_loss, stored_grad) = grads
    assert on_loss == pytest.approx(stored_loss) == pytest.approx(-sum(map(sum, weights)) / N_TOKENS)
    torch.testing.assert_close(on_grad, stored_grad)


def test_step_metrics_are_exact_over_ranks_and_split_by_staleness():
    old, rollout = _log_probs()
    config = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.5,
                                     rollout_rs_threshold_lower=0.4)  # IcePop: tokens ρ = 3 and 0.25 dropped
    # rank 0 holds row 0 (weights of version 3), rank 1 row 1 (version 2); the trainer is at version 4
    ranks = [correction_stats(old[i:i + 1], rollout[i:i + 1], MASK[i:i + 1], config, torch.tensor([v]))
             for i, v in ((0, 3), (1, 2))]
    m = correction_metrics(ranks, trainer_version=4)
    kept = [0.5, 1.5, 1.2]
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(sum(kept) / 3)
    assert m["rollout_corr/is_weight_min"] == 0.5 and m["rollout_corr/is_weight_max"] == 1.5
    assert m["rollout_corr/is_weight_std"] == pytest.approx(torch.tensor(kept).std(unbiased=False).item())
    assert m["rollout_corr/is_clip_frac"] == 0.0 and m["rollout_corr/rs_masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rs_seq_masked_frac"] == 0.0
    rhos = [3.0, 0.5, 1.5, 0.25, 1.2]
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rhos) / 5)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(-sum(map(math.log, rhos)) / 5))
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(math.log(4))
    # staleness 1: row 0 only (ρ = 3, 0.5, 1.5; 3 dropped), staleness 2: row 1 (0.25 dropped, 1.2 kept)
    assert m["rollout_corr/staleness_1/tokens"] == 3 and m["rollout_corr/staleness_2/tokens"] == 2
    assert m["rollout_corr/staleness_1/is_weight_mean"] == pytest.approx(1.0)
    assert m["rollout_corr/staleness_2/is_weight_mean"] == pytest.approx(1.2)
    assert m["rollout_corr/staleness_2/rs_masked_frac"] == pytest.approx(0.5)
    off = correction_metrics(ranks[:1], trainer_version=3)  # mismatch only when no correction is on
    assert correction_metrics([correction_stats(old, rollout, MASK * 0, config, torch.tensor([0, 0]))], 0) == {}
    assert "rollout_corr/staleness_0/mismatch_kl" in off


VALID = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]


@pytest.mark.parametrize(("overrides", "setting", "words"), [
    (["algorithm.rollout_correction.rollout_is=batch"], "algorithm.rollout_correction", "rollout_is must be one"),
    (["algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=0.5",
      "algorithm.rollout_correction.rollout_rs_threshold_lower=2"], "algorithm.rollout_correction", "lower"),
    (["algorithm.rollout_correction.use_decoupled_loss=true", "algorithm.rollout_correction.rollout_is=token"],
     "algorithm.rollout_correction", "use_decoupled_loss"),
    (["algorithm.rollout_correction.behav_imp_weight_cap=2"], "algorithm.rollout_correction", "needs"),
    (["algorithm.rollout_correction.rollout_is=token", "rollout.recompute_old_log_prob=false"],
     "rollout.recompute_old_log_prob", "bypass"),
])
def test_start_up_validation_names_the_setting_and_the_rule(overrides, setting, words):
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", VALID + overrides, check_paths=False)
    (violation,) = err.value.violations
    assert violation.setting == setting and words in violation.rule
    cfg = load_config("tiny/grpo", [*VALID, "algorithm.rollout_correction.rollout_is=sequence"], check_paths=False)
    assert cfg.algorithm.rollout_correction.rollout_is == "sequence"


def test_every_setting_reaches_the_actor_loss():
    settings = {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "geometric",
                "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99, "rollout_token_veto_threshold": 1e-4}
    cfg = load_config("tiny/grpo", [*VALID, *(f"algorithm.rollout_correction.{k}={v}" for k, v in settings.items())],
                      check_paths=False)
    correction = actor_loss_config(cfg).rollout_correction
    assert {k: getattr(correction, k) for k in settings} == settings and correction.enabled
    decoupled = load_config("tiny/grpo", [*VALID, "algorithm.rollout_correction.use_decoupled_loss=true",
                                          "algorithm.rollout_correction.behav_imp_weight_cap=4"], check_paths=False)
    correction = actor_loss_config(decoupled).rollout_correction
    assert correction.use_decoupled_loss and correction.behav_imp_weight_cap == 4.0
