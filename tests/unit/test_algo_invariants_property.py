"""Property tests: masking, finiteness under extreme log-probs, and padding invariance of the aggregation."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mrl.algo.actor_loss import ActorLossConfig, actor_loss
from mrl.algo.advantages import ADV_ESTIMATORS, compute_advantage
from mrl.algo.aggregation import LOSS_AGG_MODES, agg_loss
from mrl.algo.kl import kl_penalty
from mrl.algo.policy_loss import POLICY_LOSSES, PolicyLossConfig
from mrl.algo.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def padded_batch(draw, low: float, high: float):
    batch, width = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    floats = st.floats(low, high, allow_nan=False, allow_infinity=False)

    def matrix():
        return torch.from_numpy(draw(hnp.arrays(np.float64, (batch, width), elements=floats)))

    mask = torch.from_numpy(draw(hnp.arrays(np.bool_, (batch, width))))
    index = draw(st.lists(st.integers(0, 2), min_size=batch, max_size=batch))
    return matrix, mask, index


@SETTINGS
@given(padded_batch(-10.0, 10.0))
def test_advantages_are_zero_where_the_mask_is_zero(data):
    matrix, mask, index = data
    rewards, values = matrix(), matrix()
    for name in ADV_ESTIMATORS.names():
        adv, returns = compute_advantage(name, rewards, mask, index=index, values=values)
        assert torch.all(adv[~mask] == 0) and torch.all(returns[~mask] == 0), name
        assert torch.isfinite(adv).all() and torch.isfinite(returns).all(), name


@SETTINGS
@given(padded_batch(-1e4, 0.0), st.sampled_from(LOSS_AGG_MODES))
def test_losses_and_gradients_are_finite_for_extreme_log_prob_differences(data, mode):
    matrix, mask, _ = data
    old, rollout, ref = matrix(), matrix(), matrix()
    advantages = matrix() / 100.0
    log_prob = matrix().requires_grad_(True)
    correction = compute_rollout_correction(
        old,
        rollout,
        mask,
        RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=5.0),
    )
    assert torch.isfinite(correction.is_weights).all()
    assert all(np.isfinite(v) for v in correction.metrics.values())
    for loss_mode in POLICY_LOSSES.names():
        log_prob.grad = None
        config = ActorLossConfig(
            PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01
        )
        total, metrics = actor_loss(
            log_prob,
            old,
            advantages,
            correction.response_mask,
            None,
            config,
            entropy=matrix().abs(),
            ref_log_prob=ref,
            rollout_is_weights=correction.is_weights,
        )
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(log_prob.grad).all(), loss_mode
        assert all(torch.isfinite(v) for v in metrics.values()), loss_mode
    assert torch.isfinite(kl_penalty(log_prob, ref, "low_var_kl")).all()


@SETTINGS
@given(padded_batch(-100.0, 100.0), st.integers(1, 4), st.floats(-1e6, 1e6))
def test_aggregation_is_invariant_to_padding_rows_with_mask_zero(data, extra_rows, pad_value):
    matrix, mask, _ = data
    loss = matrix()
    padded_loss = torch.cat([loss, torch.full((extra_rows, loss.shape[1]), pad_value, dtype=loss.dtype)])
    padded_mask = torch.cat([mask, torch.zeros(extra_rows, mask.shape[1], dtype=torch.bool)])
    order = torch.randperm(padded_loss.shape[0], generator=torch.Generator().manual_seed(extra_rows))
    for mode in LOSS_AGG_MODES:
        plain = agg_loss(loss, mask, mode, loss_scale_factor=8)
        padded = agg_loss(padded_loss[order], padded_mask[order], mode, loss_scale_factor=8)
        torch.testing.assert_close(padded, plain, rtol=1e-12, atol=1e-12)


CORRECTIONS = [
    RolloutCorrectionConfig(rollout_is="token"),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1.5),
    RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.01),
    RolloutCorrectionConfig(rollout_rs="sequence"),
    RolloutCorrectionConfig(rollout_is="token", rollout_rs="geometric", rollout_token_veto_threshold=0.9),
    RolloutCorrectionConfig(use_decoupled_loss=True, behav_imp_weight_cap=1.0),
]


@SETTINGS
@given(padded_batch(-5.0, 0.0), st.sampled_from(LOSS_AGG_MODES), st.sampled_from(CORRECTIONS))
def test_corrections_are_the_identity_when_behaviour_equals_proximal(data, mode, correction):
    """π_rollout = π_old (so also when both equal π_θ): every weight is 1, nothing is rejected, and the loss and
    its gradient are plain PPO's, whatever the current policy."""
    matrix, mask, _ = data
    old, advantages, current = matrix(), matrix(), matrix()
    result = compute_rollout_correction(old, old.clone(), mask, correction)
    assert torch.equal(result.response_mask.bool(), mask)
    if result.is_weights is not None:
        assert torch.all(result.is_weights[mask] == 1.0)
    for log_prob_of in (lambda: old.clone(), lambda: current):  # π_θ = π_old = π_rollout, then any π_θ
        losses, grads = [], []
        for config in (ActorLossConfig(loss_agg_mode=mode),
                       ActorLossConfig(loss_agg_mode=mode, rollout_correction=correction)):
            log_prob = log_prob_of().requires_grad_(True)
            loss, _ = actor_loss(log_prob, old, advantages, mask, None, config, rollout_log_prob=old.clone())
            loss.backward()
            losses.append(loss.detach())
            grads.append(log_prob.grad)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
