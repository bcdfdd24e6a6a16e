"""Start-up rules on the reward: `reward.reward_fn` names a function that loads, and with "auto" every data_source
of the data files has a registered one (an unknown source once fell back to math scoring: a run of silent zeros);
each of `reward.models` is placed in a pool, or colocated (discriminative, no re-render, a bridge and a shape that
fits ref.megatron); a discriminative one is a one-label sequence classifier sharing the policy's tokenizer unless a
re-render is configured; a generative judge has a template, parser and fallback that
mrl/reward/judge.py accepts and a readable folder; an `algorithm.distill` teacher is a causal LM that fits its
layout and shares the student's tokenizer.

Registered with `@rule` like those of validate.py, which imports this module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.startup.layout_rules import role_shape_violations
from mrl.config.startup.validate import Violation, _get, rule


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
    """Each of `reward.models`: a unique name, placement `pool` or `colocated` (`_colocated`), and with the files
    here a one-label `...ForSequenceClassification` folder whose tokenizer is the policy's unless `rerender` is set
    (the policy's ids would be read as other tokens: wrong scores, no error)."""
    names = [str(m.name) for m in cfg.reward.models]
    for k, m in enumerate(cfg.reward.models):
        key = f"reward.models[{k}]"
        if not m.name or m.name == "rule" or names.count(m.name) > 1:
            yield Violation(f"{key}.name", m.name, "a unique, non-empty name other than 'rule' (the rule reward's part "
                                                   "in reward/<name>/mean)")
        if m.placement not in ("pool", "colocated"):
            yield Violation(f"{key}.placement", m.placement, "'pool' (workers of its own) or 'colocated' (a frozen "
                                                            "engine in the actor workers; docs/reward_models.md)")
        elif m.placement == "colocated":
            yield from _colocated(cfg, key, m, check_paths)
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


def _colocated(cfg: DictConfig, key: str, m: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """A colocated model is a frozen Megatron engine in the actor workers, on ref.megatron's layout, scored in the
    step once the trainer holds the devices: a sequence classifier of the policy's ids, no re-render (the engine
    reads the policy's ids from the store), no dynamic sampling (its filter reads rewards before the devices come
    back), an architecture with a bridge and a shape ref.megatron splits."""
    why = "with placement=colocated (a frozen Megatron engine in the actor workers)"
    if m.kind == "generative":
        yield from _colocated_judge(cfg, key, m)
        return
    if m.rerender:
        yield Violation(f"{key}.rerender", True, f"false {why}: it scores the policy's token ids as they are, so its "
                                                 "tokenizer must be the policy's; a re-rendering model needs "
                                                 "placement=pool")
    if _get(cfg, "data.dynamic_sampling"):
        yield Violation("data.dynamic_sampling", True, f"false {why}: its score exists only after sampling, when the "
                                                       f"trainer holds the devices, but dynamic sampling filters "
                                                       f"groups by reward during sampling ({key}; or placement=pool)")
    if not check_paths:
        return
    try:
        with open(os.path.join(str(m.path), "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return  # the folder rule says so
    yield from _frozen_engine_shape(cfg, f"{key}.path", str(m.path), hf, f"the reward model {m.name}",
                                    classifier=True)


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
        same = _same_vocabulary(str(m.path), policy_tokenizer)
    except Exception as err:  # a folder without tokenizer files: scoring it would fail later, so say it now
        yield Violation(f"{key}.path", m.path, f"a tokenizer that loads ({type(err).__name__}: {err}), or "
                                               f"{key}.rerender=true")
        return
    if not same:
        yield Violation(f"{key}.rerender", False, f"true: the reward model's tokenizer differs from the policy's "
                                                  f"({policy_tokenizer}); scores need a re-render (detokenize → "
                                                  "retokenize)")


def _same_vocabulary(path: str, policy_tokenizer: str) -> bool:
    """Whether the tokenizer of the folder `path` maps every token to the policy's id (raises if it cannot load)."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        # transformers 5 builds an empty tokenizer of the model's class from config.json alone: no error, one token
        raise FileNotFoundError("no tokenizer.json or tokenizer_config.json in the folder")
    vocab = AutoTokenizer.from_pretrained(path).get_vocab()
    return vocab == AutoTokenizer.from_pretrained(policy_tokenizer).get_vocab()


@rule
def _distill(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """`algorithm.distill`: a known mode and, when on, a teacher folder: a causal LM with a bridge, whose shape fits
    ref.megatron (its engine's layout), and whose tokenizer is the student's. Unlike a reward model's, no re-render
    can help: the teacher scores the student's own token ids one by one, and under another vocabulary an id names
    another token (a wrong signal, no error)."""
    d = cfg.algorithm.distill
    if d.mode not in ("add", "alone"):
        yield Violation("algorithm.distill.mode", d.mode, "one of add, alone")
    if d.placement not in ("colocated", "pool"):
        yield Violation("algorithm.distill.placement", d.placement, "one of colocated, pool")
    if not d.enable:
        return
    pool = d.placement == "pool"
    if pool:
        yield from _teacher_pool(cfg, d)
    if d.mode == "alone":  # no task advantage is computed: what only it reads would be dropped, or missing
        for setting in ("algorithm.use_kl_in_reward", "critic.enable"):
            if _get(cfg, setting):
                yield Violation(setting, True, "false with algorithm.distill.mode=alone: the teacher's signal is the "
                                               "whole advantage, so the task reward's KL penalty and the critic's "
                                               "returns are never computed (mode add keeps them)")
    key, path = "algorithm.distill.teacher_path", str(d.teacher_path)
    if not path:
        yield Violation(key, path, "the teacher's HF folder: algorithm.distill.enable=true needs one")
        return
    if not check_paths:
        return
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        yield Violation(key, path, "an HF folder with config.json (the teacher, a causal LM)")
        return
    with open(config_file) as f:
        hf = json.load(f)
    if not pool:  # a pool's teacher runs on its own engine, which needs no bridge and no layout of the trainer's
        yield from _frozen_engine_shape(cfg, key, path, hf, "the teacher")
    student = str(cfg.model.tokenizer_path or cfg.model.path)
    try:
        same = _same_vocabulary(path, student)
    except Exception as err:
        yield Violation(key, path, f"a teacher folder whose tokenizer loads ({type(err).__name__}: {err}), to check "
                                   "its vocabulary against the student's")
        return
    if not same:
        yield Violation(key, path, f"the teacher's tokenizer must be the student's ({student}): it differs, so its "
                                   "log-prob of a sampled token id would score another token")


def _colocated_judge(cfg: DictConfig, key: str, m: DictConfig) -> Iterator[Violation]:
    """A judge on the trainer's devices: hybrid rollout (the hand-over that puts it to sleep and wakes it), replicas
    that fit on those devices, and memory shares that fit beside the rollout's while both are awake."""
    if _get(cfg, "rollout.mode") != "hybrid":
        yield Violation(f"{key}.placement", m.placement, "'pool' unless rollout.mode=hybrid: a colocated judge "
                                                         "sleeps and wakes with the hybrid rollout")
    devices = int(_get(cfg, "resources.nnodes")) * int(_get(cfg, "resources.n_gpus_per_node"))
    wanted = int(m.num_replicas) * int(m.tensor_model_parallel_size)
    if wanted > devices:
        yield Violation(f"{key}.num_replicas", m.num_replicas, f"replicas × tensor_model_parallel_size ({wanted}) at "
                                                               f"most the trainer's {devices} devices when colocated")
    rollout, own = float(_get(cfg, "rollout.gpu_memory_utilization")), m.gpu_memory_utilization
    if own is None:
        yield Violation(f"{key}.gpu_memory_utilization", own, "set when colocated: the judge's engine is awake beside "
                                                              "the rollout's, and its default takes most of a device")
    elif rollout + own > 0.95:
        yield Violation(f"{key}.gpu_memory_utilization", own, f"at most {0.95 - rollout:.2f}: with rollout."
                                                              f"gpu_memory_utilization={rollout} the two awake "
                                                              "engines may share 0.95 of a device")


def _teacher_pool(cfg: DictConfig, d: DictConfig) -> Iterator[Violation]:
    """A teacher on replicas of its own: a backend that returns prompt log-probs, and the untempered distribution
    they come from as the student's (the teacher's signal is teacher − student log-prob of each sampled token)."""
    if d.backend not in ("vllm", "sglang", "hf"):
        yield Violation("algorithm.distill.backend", d.backend, "vllm, sglang or hf with placement=pool: the "
                                                                "teacher's replicas must return prompt log-probs")
    temperature = _get(cfg, "rollout.temperature")
    if temperature != 1.0:
        yield Violation("rollout.temperature", temperature, "1.0 with algorithm.distill.placement=pool: the "
                                                            "teacher's replicas give untempered prompt log-probs, so "
                                                            "the student's must be untempered too (colocated "
                                                            "scores at any temperature)")
    for setting in ("num_replicas", "tensor_model_parallel_size"):
        if int(d[setting]) < 1:
            yield Violation(f"algorithm.distill.{setting}", d[setting], ">= 1")


def _frozen_engine_shape(cfg: DictConfig, key: str, path: str, hf: dict, whose: str, classifier: bool = False
                         ) -> Iterator[Violation]:
    """A frozen engine on ref.megatron's layout (the teacher, a colocated reward model): a bridge for its
    architecture (a `classifier`'s is its causal LM's; a teacher must be the causal LM itself) and a shape that
    layout splits."""
    arch = (hf.get("architectures") or [None])[0]
    if cfg.model.bridge_backend == "mrl":
        from bridges.registry import architectures, causal_lm_architecture

        bridged = causal_lm_architecture(arch) if classifier and arch is not None else arch
        if bridged not in architectures():
            what = "a sequence classifier" if classifier else "a causal LM"
            yield Violation(key, path, f"{what} with a bridge; its architecture {arch!r} has none (known: "
                                       f"{', '.join(architectures())})")
            return
    yield from role_shape_violations(cfg, "ref", hf, whose=f"{whose} ({path}): ")
