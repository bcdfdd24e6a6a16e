"""Discriminative reward models (`reward.models`): an HF `...ForSequenceClassification` checkpoint with one label
scores each sample's token ids (prompt + response); the sample's reward is `reward.rule_weight` × the rule reward
plus each model's weight × its score.

Score = the classifier's logit at the last real token, the position HF's own pooling takes (the last non-pad
token), computed with a plain HF forward of the base model in right-padded, length-balanced micro-batches: padding
and batching change no score beyond float rounding. Placement `pool`: each model in one CPU Ray actor of its own;
`colocated`: a frozen Megatron engine in each actor worker (`MegatronRewardModel`, mrl/engine/megatron/critic.py),
scored in the step once the trainer holds its devices (mrl/trainer/ppo_trainer.py `score_colocated`).
A model whose tokenizer differs from the policy's scores a re-render (the policy's ids decoded, then encoded with
its tokenizer); the start-up rule refuses that case unless `rerender` is set (mrl/config/startup/reward_rules.py).
Generative judges (`kind: generative`, mrl/reward/judge.py) score the same samples as text; `RewardModels` runs both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mrl.reward.judge import GenerativeJudge, JudgeInput, judge_all


def length_balanced(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches of indices of similar lengths: longest first, each cut so rows × its longest ≤ max_tokens
    (a sequence longer than the budget goes alone: a reward forward never splits a sequence)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class SequenceClassifierScorer:
    """One reward model in fp32 on CPU; `score(sequences)` → one float per sequence of token ids."""

    def __init__(self, path: str, max_tokens: int = 8192, policy_tokenizer: str | None = None) -> None:
        """`policy_tokenizer`: the policy's tokenizer folder when sequences must be re-rendered; None scores the
        policy's ids as they are (same tokenizer)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: num_labels={model.config.num_labels}; a reward model has one")
        if not hasattr(model, "score"):
            raise ValueError(f"reward model {path}: {type(model).__name__} has no `score` head")
        self.model, self.max_tokens = model, max_tokens
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.tokenizers = None
        if policy_tokenizer is not None:
            self.tokenizers = (AutoTokenizer.from_pretrained(policy_tokenizer), AutoTokenizer.from_pretrained(path))

    def rerender(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        if self.tokenizers is None:
            return [list(s) for s in sequences]
        policy, own = self.tokenizers
        return [own.encode(policy.decode(list(s)), add_special_tokens=False) for s in sequences]

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        sequences = self.rerender(sequences)
        if any(len(s) == 0 for s in sequences):
            raise ValueError("reward model: an empty sequence has no last token to score")
        lengths = [len(s) for s in sequences]
        base = getattr(self.model, self.model.base_model_prefix)
        scores = [0.0] * len(sequences)
        for rows in length_balanced(lengths, self.max_tokens):
            ids = torch.full((len(rows), lengths[rows[0]]), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : lengths[i]] = torch.tensor(sequences[i])
                mask[r, : lengths[i]] = 1
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            last = torch.tensor([lengths[i] - 1 for i in rows])
            logits = self.model.score(hidden[torch.arange(len(rows)), last]).squeeze(-1)
            for i, value in zip(rows, logits.tolist()):
                scores[i] = float(value)
        return scores


def reward_score_field(name: str) -> str:
    """The sample-store field of a colocated model's score: one value per sample, written by the actor workers."""
    return f"reward_score/{name}"


def combine(rule_scores: Sequence[float], model_scores: Mapping[str, Sequence[float]], rule_weight: float,
            weights: Mapping[str, float]) -> list[float]:
    """Per sample: rule_weight × rule score + Σ weight[name] × model score."""
    return [rule_weight * r + sum(weights[name] * s[k] for name, s in model_scores.items())
            for k, r in enumerate(rule_scores)]


class RewardModels:
    """Every configured reward model: discriminative ones each in a CPU Ray actor of its own (placement `pool`),
    generative judges each on rollout replicas (mrl/reward/judge.py; of their own, or on the trainer's devices when
    colocated); the models of one step score concurrently. Colocated discriminative ones only have their weight and
    name here (`colocated`): the actor workers score them."""

    def __init__(self, configs: Sequence[Any], policy_tokenizer: str,
                 judge_replicas: Mapping[str, Any] | None = None) -> None:
        """`judge_replicas`: {name: LLMServerManager} of each generative model (mrl/trainer/build.py `start_judge`);
        closing this object shuts them down."""
        import ray

        self.weights = {c.name: float(c.weight) for c in configs}
        self.colocated = [c.name for c in configs if c.placement == "colocated" and c.kind == "discriminative"]
        configs = [c for c in configs if c.name not in self.colocated]
        self.order = [c.name for c in configs]
        replicas = judge_replicas or {}  # judges first: their set-up may fail, and would leave the actors behind
        self.judges = {c.name: GenerativeJudge(c, replicas[c.name]) for c in configs if c.kind == "generative"}
        # Judges on the trainer's devices: the trainer's hand-over puts them to sleep and wakes them.
        self.judges_beside_trainer = [replicas[c.name] for c in configs
                                      if c.kind == "generative" and c.placement == "colocated"]
        self.actors = {
            c.name: ray.remote(num_cpus=c.num_cpus)(SequenceClassifierScorer).remote(
                c.path, c.max_tokens_per_micro_batch, policy_tokenizer if c.rerender else None)
            for c in configs if c.kind == "discriminative"
        }

    @property
    def needs_token_ids(self) -> bool:
        """Whether `score` reads the samples' token ids (discriminative models score ids; judges read text)."""
        return bool(self.actors)

    def wait_started(self) -> None:
        for judge in self.judges.values():
            judge.wait_started()

    def score(self, sequences: Sequence[Sequence[int]], texts: Sequence[JudgeInput] = ()) -> dict[str, list[float]]:
        """{name: one score per sample}: discriminative models score `sequences` (prompt + response ids), judges
        `texts` (the same samples as text)."""
        import ray

        refs = {name: actor.score.remote(list(sequences)) for name, actor in self.actors.items()}
        scores = asyncio.run(judge_all(self.judges, texts)) if self.judges else {}
        scores.update({name: ray.get(ref) for name, ref in refs.items()})
        return {name: scores[name] for name in self.order}

    def take_metrics(self) -> dict[str, float]:
        """Each judge's `reward/<name>/parse_failures` and `parse_failure_rate` since the last call."""
        return {k: v for judge in self.judges.values() for k, v in judge.counts.take().items()}

    def close(self) -> None:
        import ray

        for actor in self.actors.values():
            ray.kill(actor)
        for judge in self.judges.values():
            judge.close()
