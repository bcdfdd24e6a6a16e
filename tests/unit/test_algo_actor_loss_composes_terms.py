"""The actor objective is pg + kl_coef·kl − entropy_coeff·entropy, each aggregated alike, with IS weights applied."""

import pytest
import torch

from mrl.algo.actor_loss import ActorLossConfig, actor_loss
from mrl.algo.aggregation import LossNormalizer, agg_loss, loss_counts
from mrl.algo.kl import kl_penalty
from mrl.algo.policy_loss import PolicyLossConfig, compute_policy_loss


def _batch():
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) - 0.1
    log_prob = old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    entropy = torch.rand(4, 6, generator=gen, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    weights = torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in (6, 3, 1, 4)])
    return log_prob, old, ref, entropy, advantages, weights, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_loss_equals_its_terms(mode: str):
    log_prob, old, ref, entropy, advantages, weights, mask = _batch()
    config = ActorLossConfig(
        PolicyLossConfig(clip_ratio_high=0.28),
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
    )
    total, metrics = actor_loss(
        log_prob, old, advantages, mask, None, config, entropy=entropy, ref_log_prob=ref, rollout_is_weights=weights
    )
    pg = agg_loss(
        compute_policy_loss(log_prob, old, advantages, mask, config.policy_loss).loss_mat * weights, mask, mode
    )
    kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), mask, mode)
    ent = agg_loss(entropy, mask, mode)
    torch.testing.assert_close(total, pg + 0.1 * kl - 0.01 * ent)
    torch.testing.assert_close(metrics["actor/pg_loss"], pg)
    torch.testing.assert_close(metrics["actor/kl_loss"], kl)
    torch.testing.assert_close(metrics["actor/entropy"], ent)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= metrics.keys()


def test_micro_batch_shares_of_the_actor_loss_sum_to_the_step_loss():
    log_prob, old, ref, entropy, advantages, weights, mask = _batch()
    config = ActorLossConfig(entropy_coeff=0.01, use_kl_loss=True)
    full, _ = actor_loss(
        log_prob, old, advantages, mask, None, config, entropy=entropy, ref_log_prob=ref, rollout_is_weights=weights
    )
    normalizer = LossNormalizer.from_counts(loss_counts(mask[:2]) + loss_counts(mask[2:]))
    halves = [
        actor_loss(
            log_prob[s],
            old[s],
            advantages[s],
            mask[s],
            normalizer,
            config,
            entropy=entropy[s],
            ref_log_prob=ref[s],
            rollout_is_weights=weights[s],
        )[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(halves[0] + halves[1], full)


def test_metrics_are_the_micro_batch_own_values_not_shares():
    log_prob, old, ref, entropy, advantages, _, mask = _batch()
    config = ActorLossConfig(use_kl_loss=True)
    step = LossNormalizer.from_mask(mask)  # a step 10x larger than this micro-batch would shrink shares, not metrics
    step = LossNormalizer(step.num_tokens * 10, step.num_seqs * 10)
    total, metrics = actor_loss(log_prob, old, advantages, mask, step, config, entropy=entropy, ref_log_prob=ref)
    _, alone = actor_loss(log_prob, old, advantages, mask, None, config, entropy=entropy, ref_log_prob=ref)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        torch.testing.assert_close(metrics[key], alone[key])
    pg = agg_loss(compute_policy_loss(log_prob, old, advantages, mask, config.policy_loss).loss_mat, mask)
    kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), mask)
    torch.testing.assert_close(total, (pg + 0.001 * kl) / 10)


def test_kl_loss_without_reference_log_probs_is_a_config_error():
    log_prob, old, _, _, advantages, _, mask = _batch()
    with pytest.raises(ValueError, match="use_kl_loss"):
        actor_loss(log_prob, old, advantages, mask, None, ActorLossConfig(use_kl_loss=True))


def test_invalid_actor_loss_settings_fail_at_construction():
    with pytest.raises(ValueError, match="loss_agg_mode 'mean' unknown"):
        ActorLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="kl_loss_type 'k5' unknown"):
        ActorLossConfig(kl_loss_type="k5")
