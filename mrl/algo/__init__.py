"""RL algorithms as pure functions on padded [batch, response_len] tensors (no Megatron, no Ray).

advantages (GAE, GRPO, RLOO, REINFORCE++), policy_loss (PPO-clip, GSPO, CISPO), aggregation (loss modes exact under
micro-batching and DP), kl (estimators, controllers, penalty, entropy), rollout_correction (IS / rejection between
rollout and trainer log-probs, decoupled PPO), value_loss (clipped critic loss), actor_loss (the composed actor
objective a trainer's loss_fn calls).
"""
