"""Typed configuration of the reward (rule and model rewards) and of on-policy distillation: sections of
`MrlConfig` (mrl/config/schema.py), kept apart so the schema file stays readable."""

from dataclasses import dataclass, field


@dataclass
class RewardModelConfig:
    # Name of this part of the reward: metrics reward/<name>/mean.
    name: str = "rm"
    # discriminative: a sequence classifier scores the sample's token ids. generative (LLM-as-judge): a causal LM
    # on rollout replicas of its own answers `template` and `parser` reads the score from the answer
    # (mrl/reward/judge.py, docs/reward_models.md).
    kind: str = "discriminative"
    # HF folder of the model. discriminative: a `...ForSequenceClassification` checkpoint with one label; its
    # score of a sample is the logit at the last token of prompt + response (mrl/reward/models.py). generative: a
    # `...ForCausalLM` checkpoint with its tokenizer (the judge).
    path: str = ""
    # Weight of this model's score in the sample's reward (added to reward.rule_weight × the rule reward).
    weight: float = 1.0
    # pool: devices or CPU workers of its own (discriminative: one Ray actor per model, an HF forward; generative:
    # `num_replicas` rollout replicas in a standalone pool). colocated, discriminative (no rerender): a frozen
    # Megatron engine in each actor worker on ref.megatron's layout, offloaded with the reference around generation,
    # scored in the step once the trainer holds the devices (not in validation; no data.dynamic_sampling).
    # colocated, generative (rollout.mode hybrid): its replicas in replica mode colocated on the trainer's devices,
    # asleep (level 1, weights kept in host memory) while the trainer holds them and awake with the rollout's.
    placement: str = "pool"
    # CPUs of a discriminative model's pool worker (its torch threads).
    num_cpus: int = 1
    # Token budget of one pool forward: samples sorted by length, each micro-batch's rows × longest row ≤ this (a
    # colocated model's micro-batches are the reference's: ref.log_prob_micro_batch_size_per_gpu).
    max_tokens_per_micro_batch: int = 8192
    # Detokenize the policy's tokens and retokenize them with the reward model's tokenizer. Required when the two
    # tokenizers differ (start-up refuses the run otherwise); with equal tokenizers the policy's ids are scored as is.
    rerender: bool = False
    # generative: the judge's prompt, a Python format string naming {response} and optionally {prompt} (the
    # prompt's last user message) and {ground_truth}; literal braces doubled ({{ }}).
    template: str = ""
    # generative: a regex whose first group is the score (first match in the answer), or
    # "package.module:function" mapping the answer text to a float, or None when the answer gives none.
    parser: str = r"(-?\d+(?:\.\d+)?)"
    # generative: the score of an answer that does not parse; each is counted (reward/<name>/parse_failures and
    # reward/<name>/parse_failure_rate per step), never a silent 0.
    fallback_score: float = 0.0
    # generative: wrap the rendered template as one user message in the judge tokenizer's chat template (with the
    # generation prompt); false: its tokens are the rendered text's.
    chat_template: bool = True
    # generative: the judge's rollout backend (a rollout.name value: vllm, sglang, trtllm, hf).
    backend: str = "vllm"
    # generative: replicas of the judge; the engine batches each replica's share of a step's requests.
    num_replicas: int = 1
    # generative: devices (tensor-parallel ranks) of one judge replica.
    tensor_model_parallel_size: int = 1
    # generative: context length of the judge's engine (rendered prompt + answer); a longer prompt gets no answer
    # (a counted parse failure).
    max_model_len: int = 4096
    # generative: the judge's engine dtype; None: the policy rollout's (rollout.dtype, else actor params_dtype).
    dtype: str | None = None
    # generative: share of each device's memory the judge's engine may take (vLLM's gpu_memory_utilization); None:
    # the engine's default. Colocated, the judge and the rollout are awake together: their shares must fit beside
    # each other (start-up checks the sum).
    gpu_memory_utilization: float | None = None
    # generative: sampling temperature of the judge's answer; 0 is greedy.
    temperature: float = 0.0
    # generative: nucleus sampling of the judge's answer (1.0: off).
    top_p: float = 1.0
    # generative: the longest answer in tokens (generation stops at the judge's EOS or here).
    max_new_tokens: int = 32


@dataclass
class RewardConfig:
    # Registered rule-reward name or "module.path:function"; chosen per sample by data_source when "auto".
    reward_fn: str = "auto"
    # Concurrent reward evaluations.
    num_workers: int = 4
    # Per-item reward timeout; a timed-out item scores 0 and counts as an error.
    timeout_s: float = 10.0
    # Share of one step's reward calls of a data source that may fail (an exception, a timeout, a non-finite
    # score: each scores 0) before the run stops with the first error's text; metrics reward/<data_source>/
    # error_rate (calls since the previous step, validation's included). 1.0: never stop; 0.0: stop at any error.
    max_error_rate: float = 0.1
    # Weight of the rule reward (reward_fn) in the sample's reward; 0 with reward.models: model scores only.
    rule_weight: float = 1.0
    # Reward models scored beside the rule reward (each: name, path, weight, placement); docs/reward_models.md.
    models: list[RewardModelConfig] = field(default_factory=list)


@dataclass
class DistillConfig:
    # On-policy distillation (docs/reward_models.md): a frozen teacher scores the student's own sampled tokens, and
    # each model token's advantage gains coef × (teacher − student log-prob of that token). The student's is π_old
    # (at rollout.temperature, like the teacher's), so distillation turns off actor.on_policy_first_update.
    enable: bool = False
    # HF folder of the teacher: a causal LM whose tokenizer has the student's vocabulary (start-up refuses another: a
    # token id would name another token).
    teacher_path: str = ""
    # colocated: in the actor's processes like the reference (ref.megatron's layout, a forward-only engine offloaded
    # with it; the teacher needs a bridge and routes its own experts under R3), scored at rollout.temperature.
    # pool: `num_replicas` rollout replicas of its own (devices or CPU workers apart from the trainer's), scored by
    # their prompt log-probs, which are untempered: rollout.temperature must be 1 (mrl/reward/teacher_replicas.py).
    placement: str = "colocated"
    # pool: the teacher's rollout backend (vllm, sglang or hf: those return prompt log-probs).
    backend: str = "vllm"
    # pool: replicas of the teacher; each engine batches its share of a step's samples.
    num_replicas: int = 1
    # pool: devices (tensor-parallel ranks) of one teacher replica.
    tensor_model_parallel_size: int = 1
    # pool: the teacher engine's dtype; None: the policy rollout's (rollout.dtype, else actor params_dtype).
    dtype: str | None = None
    # Weight of the distillation advantage.
    coef: float = 1.0
    # add: added to the task reward's advantage; alone: the distillation advantage only (the reward is still
    # scored and logged, and validation still measures it).
    mode: str = "add"
