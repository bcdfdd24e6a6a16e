"""Start-up rules of the algorithm: updates per step, estimator and loss names, KL, optimizers, loggers and
rollout correction. Registered with `@rule`.
"""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from mrl.config.startup.validate import Violation, _at_least, _get, _one_of, rule


@rule
def _updates_per_step(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    # rollout.n multiplies samples, not updates: updates per step = train_batch_size / ppo_mini_batch_size.
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "actor.ppo_mini_batch_size")
    if batch >= 1 and mini >= 1 and batch % mini:
        yield Violation("actor.ppo_mini_batch_size", mini,
                        f"must divide data.train_batch_size={batch} (each step makes train_batch_size / "
                        "ppo_mini_batch_size optimizer updates)")


@rule
def _trainer_roles(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _at_least(cfg, "rollout.agent_loop_workers", 1)
    yield from _at_least(cfg, "data.max_sample_rounds", 1)
    estimator, critic = _get(cfg, "algorithm.adv_estimator"), _get(cfg, "critic.enable")
    if estimator == "gae" and not critic:
        yield Violation("algorithm.adv_estimator", estimator, "GAE needs critic values: set critic.enable=true")
    batch, mini = _get(cfg, "data.train_batch_size"), _get(cfg, "critic.ppo_mini_batch_size")
    if critic and (mini < 1 or batch % mini):
        yield Violation("critic.ppo_mini_batch_size", mini,
                        f"must divide data.train_batch_size={batch} (the critic's updates per step)")


KL_CONTROLLERS = ("fixed", "adaptive")


@rule
def _loggers_and_rewards_kl(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.algo.kl import KL_ESTIMATORS
    from mrl.config.schema import LOGGERS

    for name in _get(cfg, "trainer.logger"):
        if name not in LOGGERS:
            yield Violation("trainer.logger", list(_get(cfg, "trainer.logger")),
                            f"unknown logger {name!r}; each must be one of {', '.join(LOGGERS)}")
    yield from _at_least(cfg, "trainer.total_epochs", 1)
    yield from _at_least(cfg, "data.val_batch_size", 1)
    peak = _get(cfg, "trainer.peak_tflops_per_device")
    if peak is not None and peak <= 0:
        yield Violation("trainer.peak_tflops_per_device", peak, "must be > 0 (or null: by device name)")
    if not _get(cfg, "algorithm.use_kl_in_reward"):
        return
    yield from _one_of(cfg, "algorithm.kl_ctrl_type", KL_CONTROLLERS)
    yield from _one_of(cfg, "algorithm.kl_penalty", KL_ESTIMATORS)
    if _get(cfg, "algorithm.kl_ctrl_type") == "adaptive":
        for path in ("algorithm.kl_target", "algorithm.kl_horizon"):
            if _get(cfg, path) <= 0:
                yield Violation(path, _get(cfg, path), "the adaptive KL controller needs it > 0")


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@rule
def _algorithm_names(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    from mrl.algo.advantages import ADV_ESTIMATORS
    from mrl.algo.aggregation import LOSS_AGG_MODES
    from mrl.algo.kl import KL_ESTIMATORS
    from mrl.algo.policy_loss import POLICY_LOSSES

    estimator = _get(cfg, "algorithm.adv_estimator")
    if estimator not in ADV_ESTIMATORS:
        yield Violation("algorithm.adv_estimator", estimator, f"must be one of {', '.join(ADV_ESTIMATORS.names())}")
    loss = _get(cfg, "actor.policy_loss")
    if loss not in POLICY_LOSSES:
        yield Violation("actor.policy_loss", loss, f"must be one of {', '.join(POLICY_LOSSES.names())}")
    yield from _one_of(cfg, "actor.loss_agg_mode", LOSS_AGG_MODES)
    yield from _one_of(cfg, "critic.loss_agg_mode", LOSS_AGG_MODES)
    yield from _one_of(cfg, "actor.kl_loss_type", KL_ESTIMATORS)


@rule
def _optimizers(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for role in ("actor", "critic"):
        o = f"{role}.optim"
        lr, min_lr = _get(cfg, f"{o}.lr"), _get(cfg, f"{o}.min_lr")
        yield from _at_least(cfg, f"{o}.lr", 0.0)
        if lr >= 0 and (min_lr < 0 or min_lr > lr):  # a negative lr is its own line
            yield Violation(f"{o}.min_lr", min_lr, f"must be in [0, {o}.lr={lr}]")
        yield from _at_least(cfg, f"{o}.weight_decay", 0.0)
        yield from _at_least(cfg, f"{o}.clip_grad", 0.0)
        yield from _at_least(cfg, f"{o}.lr_warmup_steps", 0)
        yield from _one_of(cfg, f"{o}.lr_decay_style", LR_DECAY_STYLES)
        betas = list(_get(cfg, f"{o}.betas"))
        if not all(0.0 <= b < 1.0 for b in betas):
            yield Violation(f"{o}.betas", betas, "Adam's betas must each be in [0, 1)")
    for path in ("actor.clip_ratio_high", "actor.kl_loss_coef", "critic.cliprange_value"):  # clip_ratio_low: RANGES
        yield from _at_least(cfg, path, 0.0)
    scale = _get(cfg, "actor.loss_scale_factor")
    if scale is not None and scale <= 0:
        yield Violation("actor.loss_scale_factor", scale, "the seq-mean-token-sum-norm constant must be > 0")
    c = _get(cfg, "actor.clip_ratio_c")
    if c <= 1.0:
        yield Violation("actor.clip_ratio_c", c, "the dual-clip bound must be > 1")


@rule
def _rollout_correction(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """The correction's own rules (mrl/algo/rollout_correction.py), and it needs a π_old apart from π_rollout."""
    from mrl.algo.rollout_correction import correction_config

    settings = _get(cfg, "algorithm.rollout_correction")
    try:
        correction = correction_config(settings)
    except ValueError as err:
        yield Violation("algorithm.rollout_correction", OmegaConf.to_container(settings), str(err))
        return
    if correction.enabled and not _get(cfg, "rollout.recompute_old_log_prob"):
        yield Violation("rollout.recompute_old_log_prob", False,
                        "algorithm.rollout_correction weighs π_old against π_rollout; in bypass mode π_old is the "
                        "rollout's log-probs, so every weight is 1: set rollout.recompute_old_log_prob=true or turn "
                        "the correction off")


# Estimators whose advantage is a sample's reward against its group's (mean, leave-one-out or batch baseline of
# group-centred rewards): identical samples make every advantage 0 and no gradient moves a weight.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@rule
def _greedy_groups(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    estimator, n = _get(cfg, "algorithm.adv_estimator"), _get(cfg, "rollout.n")
    if estimator not in GROUP_ESTIMATORS or n <= 1:
        return
    for setting, greedy in (("rollout.temperature", 0), ("rollout.top_k", 1)):
        if _get(cfg, setting) == greedy:
            yield Violation(setting, greedy, f"greedy sampling gives a prompt's rollout.n={n} samples one response, "
                                             f"so {estimator}'s group advantages are all 0: sample (temperature > 0, "
                                             "top_k -1 or > 1)")

