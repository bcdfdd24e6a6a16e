"""seq-mean-token-sum-norm (Dr. GRPO) divides each sequence's token sum by one constant of the run, C =
actor.loss_scale_factor or else data.max_response_length (verl's default), in the actor's loss and the critic's:
never by a micro-batch's padded width, which in the full-sequence layout includes the prompt and differs between
micro-batches. The engine's way of summing micro-batch shares then gives Σ_s Σ_t ℓ / (N_seq · C)."""

import pytest
import torch
from omegaconf import OmegaConf

from mrl.algo.aggregation import LossNormalizer, loss_counts
from mrl.config.startup import ConfigError, load_config
from mrl.workers.actor_rollout_ref import actor_loss_config, make_actor_loss_fn
from mrl.workers.critic import make_value_loss_fn
from mrl.workers.training_worker import loss_scale_factor

# Two micro-batches of different padded widths (prompt + response): 2 rows of width 5, 1 row of width 8.
MASKS = [torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float32),
         torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0]], dtype=torch.float32)]
ADVANTAGES = [torch.tensor([[0, 0, 1.0, 2.0, 3.0], [0, 0, 4.0, 0, 0]]),
              torch.tensor([[0, 0, 0, 5.0, 6.0, 7.0, 8.0, 0]])]
TOKEN_SUM = 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8  # Σ_s Σ_t of the per-token loss (−A at ratio 1)


def config(*overrides: str):
    return OmegaConf.to_object(load_config("tiny/grpo", [
        "model.path=unused", "actor.loss_agg_mode=seq-mean-token-sum-norm", "data.max_response_length=6",
        *overrides], check_paths=False))


def step_loss(loss_fn, outputs_of, fields_of) -> float:
    """Σ over micro-batches of their shares under the step-global counts, as the engine computes it."""
    normalizer = LossNormalizer.from_counts(sum(loss_counts(m) for m in MASKS))
    return sum(float(loss_fn(outputs_of(i), fields_of(i), normalizer)[0]) for i in range(len(MASKS)))


@pytest.mark.parametrize(("overrides", "constant"), [((), 6.0), (("actor.loss_scale_factor=10",), 10.0)])
def test_actor_loss_divides_by_the_configured_constant(overrides, constant):
    cfg = config(*overrides)
    assert loss_scale_factor(cfg) == constant
    loss_fn = make_actor_loss_fn(actor_loss_config(cfg))
    loss = step_loss(loss_fn, lambda i: {"log_probs": torch.zeros_like(MASKS[i])},
                     lambda i: {"old_log_probs": torch.zeros_like(MASKS[i]), "advantages": ADVANTAGES[i],
                                "response_mask": MASKS[i]})
    assert loss == pytest.approx(-TOKEN_SUM / (3 * constant))


def test_critic_loss_divides_by_the_same_constant():
    cfg = config("actor.loss_scale_factor=10", "critic.loss_agg_mode=seq-mean-token-sum-norm")
    loss_fn = make_value_loss_fn(cfg.critic, loss_scale_factor(cfg))
    # values = old values, returns = values + 2: every token's clipped loss is ½·2² = 2
    loss = step_loss(loss_fn, lambda i: {"values": torch.zeros_like(MASKS[i])},
                     lambda i: {"values": torch.zeros_like(MASKS[i]), "returns": torch.full_like(MASKS[i], 2.0),
                                "response_mask": MASKS[i]})
    assert loss == pytest.approx(2.0 * 8 / (3 * 10.0))


def test_a_non_positive_constant_is_refused():
    with pytest.raises(ConfigError, match=r"actor\.loss_scale_factor"):
        config("actor.loss_scale_factor=0")
