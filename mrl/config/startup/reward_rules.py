"""Start-up rules on the reward: `reward.reward_fn` names a function that loads, and with "auto" every data_source
of the data files has a registered one (an unknown source once fell back to math scoring: a run of silent zeros);
each of `reward.models` is placed in a pool; a discriminative one is a one-label sequence classifier sharing the
policy's tokenizer unless a re-render is configured; a generative judge has a template, parser and fallback that
mrl/reward/judge.py accepts and a readable folder.

Registered with `@rule` like those of validate.py, which imports this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.startup.validate import Violation, rule


@rule
def _reward_sources(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    from mrl.config.startup.field_rules import DATA_SUFFIXES
    from mrl.data.datasets import data_sources
    from mrl.reward.registry import REWARD_FNS, resolve_reward_fn

    spec = str(cfg.reward.reward_fn)
    if spec != "auto":  # one function for every row: the rows' data_source is not read
        try:
            resolve_reward_fn(spec)
        except ValueError as err:
            yield Violation("reward.reward_fn", spec, f"'auto', a registered data_source or a loadable "
                                                      f"'package.module:function': {err}")
        return
    if not check_paths:
        return
    for key in ("train_files", "val_files"):
        for path in map(str, cfg.data[key]):
            if not (path.endswith(DATA_SUFFIXES) and os.path.isfile(path)):
                continue  # reported by the data-file rule
            unknown = sorted(data_sources(path) - set(REWARD_FNS))
            if unknown:
                yield Violation(f"data.{key}", path,
                                f"data_source {', '.join(map(repr, unknown))} has no reward function (known: "
                                f"{', '.join(REWARD_FNS)}); with reward.reward_fn=auto each row is scored by its "
                                "data_source's: register one (mrl.reward.registry.REWARD_FNS) or set "
                                "reward.reward_fn")


@rule
def _reward_models(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """Each of `reward.models`: a unique name, placement `pool` (colocated is not built yet), and with the files
    here a one-label `...ForSequenceClassification` folder whose tokenizer is the policy's unless `rerender` is set
    (the policy's ids would be read as other tokens: wrong scores, no error)."""
    names = [str(m.name) for m in cfg.reward.models]
    for k, m in enumerate(cfg.reward.models):
        key = f"reward.models[{k}]"
        if not m.name or m.name == "rule" or names.count(m.name) > 1:
            yield Violation(f"{key}.name", m.name, "a unique, non-empty name other than 'rule' (the rule reward's part "
                                                   "in reward/<name>/mean)")
        if m.placement != "pool":
            yield Violation(f"{key}.placement", m.placement, "'pool' (CPU workers of its own); 'colocated' on "
                                                            "the trainer's devices is not built yet "
                                                            "(docs/reward_models.md)")
        if m.num_cpus < 1 or m.max_tokens_per_micro_batch < 1:
            yield Violation(key, f"num_cpus={m.num_cpus}, max_tokens_per_micro_batch={m.max_tokens_per_micro_batch}",
                            "both at least 1")
        if m.kind == "generative":
            yield from _judge_settings(key, m)
            if check_paths:
                yield from _judge_folder(key, m)
        elif m.kind != "discriminative":
            yield Violation(f"{key}.kind", m.kind, "one of discriminative (a sequence classifier), generative (an "
                                                   "LLM judge)")
        elif check_paths:
            yield from _reward_model_folder(key, m, str(cfg.model.tokenizer_path or cfg.model.path))


def _judge_settings(key: str, m: DictConfig) -> Iterator[Violation]:
    """A generative judge's template, parser, fallback and sampling: each refused here rather than as a run of
    fallback scores (mrl/reward/judge.py reads them the same way)."""
    from mrl.reward.judge import make_parser, template_fields
    from rollout_adapters.base import ADAPTERS

    try:
        template_fields(str(m.template))
    except ValueError as err:
        yield Violation(f"{key}.template", m.template, f"a format string over {{prompt}}, {{response}}, "
                                                       f"{{ground_truth}}: {err}")
    try:
        make_parser(str(m.parser))
    except ValueError as err:
        yield Violation(f"{key}.parser", m.parser, f"a regex whose first group is the score, or "
                                                   f"'package.module:function': {err}")
    fallback = m.fallback_score
    if isinstance(fallback, bool) or not isinstance(fallback, int | float) or not math.isfinite(fallback):
        yield Violation(f"{key}.fallback_score", fallback, "a finite number (the score of an answer that does not "
                                                           "parse)")
    if m.backend not in ADAPTERS:
        yield Violation(f"{key}.backend", m.backend, f"one of {', '.join(ADAPTERS)} (a rollout backend)")
    for name in ("num_replicas", "tensor_model_parallel_size", "max_new_tokens", "max_model_len"):
        if m[name] < 1:
            yield Violation(f"{key}.{name}", m[name], "must be >= 1")
    if m.temperature < 0:
        yield Violation(f"{key}.temperature", m.temperature, "must be >= 0 (0: greedy)")
    if not 0 < m.top_p <= 1:
        yield Violation(f"{key}.top_p", m.top_p, "must be in (0, 1]")


def _judge_folder(key: str, m: DictConfig) -> Iterator[Violation]:
    """The judge's folder: readable, a config.json that parses and is no classifier, a tokenizer that loads (the
    driver renders and decodes with it)."""
    import json

    config_file = os.path.join(str(m.path), "config.json")
    try:
        with open(config_file) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError) as err:
        yield Violation(f"{key}.path", m.path, f"a readable HF folder of a causal LM with config.json "
                                               f"({type(err).__name__}: {err})")
        return
    if any(a.endswith("ForSequenceClassification") for a in archs):
        yield Violation(f"{key}.path", m.path, f"a causal LM for kind=generative; found {archs} (a classifier is "
                                               "kind=discriminative)")
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(m.path))
    except Exception as err:
        yield Violation(f"{key}.path", m.path, f"a judge folder whose tokenizer loads ({type(err).__name__}: {err})")


def _reward_model_folder(key: str, m: DictConfig, policy_tokenizer: str) -> Iterator[Violation]:
    import json

    config_file = os.path.join(str(m.path), "config.json")
    if not os.path.isfile(config_file):
        yield Violation(f"{key}.path", m.path, "an HF folder with config.json (a ...ForSequenceClassification model)")
        return
    with open(config_file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if not any(a.endswith("ForSequenceClassification") for a in archs) or labels != 1:
        yield Violation(f"{key}.path", m.path, f"a ...ForSequenceClassification model with one label (a reward "
                                               f"model); found architectures={archs}, num_labels={labels}")
    if m.rerender:
        return
    try:
        from transformers import AutoTokenizer

        same = AutoTokenizer.from_pretrained(str(m.path)).get_vocab() == \
            AutoTokenizer.from_pretrained(policy_tokenizer).get_vocab()
    except Exception as err:  # a folder without tokenizer files: scoring it would fail later, so say it now
        yield Violation(f"{key}.path", m.path, f"a tokenizer that loads ({type(err).__name__}: {err}), or "
                                               f"{key}.rerender=true")
        return
    if not same:
        yield Violation(f"{key}.rerender", False, f"true: the reward model's tokenizer differs from the policy's "
                                                  f"({policy_tokenizer}); scores need a re-render (detokenize → "
                                                  "retokenize)")
