"""Reward functions keyed by `data_source`; rows without a data_source use "default" (math answers). A source that
nobody registered is refused: scoring it with another task's rule would give a run of silent zeros.

A reward function is `fn(solution_str, ground_truth, extra_info) -> float` (module-level, so a process pool can
pickle it by reference). `resolve_reward_fn` also accepts "package.module:function" for a user's own function,
verl's `custom_reward_function` in one string.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from mrl.data import chain_reward
from mrl.data.exact_match import exact_match_reward
from mrl.reward.format_check import split_think
from mrl.reward.math_answer import extract_answer, extract_gsm8k, last_boxed, matches_any
from mrl.utils.registry import Registry

RewardFn = Callable[[str, Any, Mapping[str, Any] | None], float]

REWARD_FNS: Registry[RewardFn] = Registry("reward function (data_source)")


class UnknownDataSource(ValueError):
    """A data_source with no registered reward function (and no reward.reward_fn for every row)."""


def _score(correct: bool) -> float:
    return 1.0 if correct else 0.0


@REWARD_FNS.register("default")
def math_answer_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the extracted answer (\\boxed, then ####, then the last number) matches the ground truth, else 0."""
    return _score(matches_any(extract_answer(solution_str), ground_truth))


@REWARD_FNS.register("openai/gsm8k", "gsm8k")
def gsm8k_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the answer after the last `####` matches; strict, like GSM8K's format (no marker, no credit)."""
    return _score(matches_any(extract_gsm8k(solution_str), ground_truth))


@REWARD_FNS.register("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
def boxed_math_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the last \\boxed{} answer matches."""
    return _score(matches_any(last_boxed(solution_str), ground_truth))


# The demo's task (mrl/data/synthetic.py); its reward lives beside it.
REWARD_FNS.register("exact_match", "mrl/reverse_digits")(exact_match_reward)


# The GPU learning task's reward (mrl/data/chain_task.py); its module has no mrl imports so the task travels.
REWARD_FNS.register(chain_reward.DATA_SOURCE)(chain_reward.score)


@REWARD_FNS.register("think_format")
def think_format_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the response is one `<think>…</think>` block followed by an answer, else 0 (ground truth unused)."""
    return _score(split_think(solution_str) is not None)


@REWARD_FNS.register("think_math")
def think_math_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 only if the think format holds and the answer part's extracted answer matches (format gates correctness)."""
    parts = split_think(solution_str)
    return _score(parts is not None and matches_any(extract_answer(parts[1]), ground_truth))


def resolve_reward_fn(spec: str | None) -> RewardFn:
    """ "module:function" imports a user's function; anything else is a data_source looked up in the registry
    (None or empty: "default"); an unknown one raises `UnknownDataSource` naming the known ones."""
    if spec is not None and ":" in spec and not spec.startswith(("http:", "https:")):
        module_name, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"custom reward function '{spec}' cannot be loaded: {err}") from err
    source = spec or "default"
    if source not in REWARD_FNS:
        raise UnknownDataSource(f"data_source {source!r} has no reward function (known: {', '.join(REWARD_FNS)}); "
                                "register one with mrl.reward.registry.REWARD_FNS.register or set reward.reward_fn")
    return REWARD_FNS.get(source)
