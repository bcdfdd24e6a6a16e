"""Reward functions chosen by data_source ("default" for rows without one, unknown ones refused), custom functions
by path, format checks."""

import pytest

from mrl.reward.format_check import has_think_format, split_think
from mrl.reward.registry import (
    REWARD_FNS,
    UnknownDataSource,
    boxed_math_reward,
    gsm8k_reward,
    math_answer_reward,
    resolve_reward_fn,
    think_format_reward,
)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>add them</think> The answer is 4.", True),
        ("\n <think>\nreason\n</think>\n4", True),
        ("<think>reason</think>", False),  # no answer after the block
        ("<think> </think> 4", False),  # empty reasoning
        ("4 <think>late</think> 4", False),  # block not at the start
        ("<think>a</think> 4 <think>b</think> 5", False),  # two blocks
        ("<think>a</think> 4 </think>", False),
        ("<think>unclosed 4", False),
        ("plain 4", False),
    ],
)
def test_think_format(text: str, ok: bool):
    assert has_think_format(text) is ok
    assert think_format_reward(text, None) == (1.0 if ok else 0.0)


def test_split_think_returns_the_parts():
    assert split_think("<think> a b </think>\n answer ") == ("a b", "answer")


def test_registry_picks_by_data_source_and_refuses_unknown_ones():
    assert REWARD_FNS.get("openai/gsm8k") is gsm8k_reward
    assert REWARD_FNS.get("lighteval/MATH") is boxed_math_reward
    assert resolve_reward_fn(None) is resolve_reward_fn("default") is math_answer_reward  # rows without a source
    with pytest.raises(UnknownDataSource, match="'my/unregistered-source' has no reward function"):
        resolve_reward_fn("my/unregistered-source")  # once scored as math: a silent run of zeros
    assert resolve_reward_fn("mrl.reward.registry:think_format_reward") is think_format_reward
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve_reward_fn("mrl.reward.registry:no_such_function")


def test_each_source_uses_its_own_extraction():
    loose = "so the total is 72"
    assert gsm8k_reward(loose, "72") == 0.0  # GSM8K is strict: no #### marker, no credit
    assert gsm8k_reward("work\n#### 72", "72") == 1.0
    assert math_answer_reward(loose, "72") == 1.0
    assert boxed_math_reward(loose, "72") == 0.0
    assert boxed_math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    think_math = REWARD_FNS.get("think_math")
    assert think_math("<think>7·8</think> \\boxed{56}", "56") == 1.0
    assert think_math("\\boxed{56}", "56") == 0.0
    assert think_math("<think>7·8</think> \\boxed{54}", "56") == 0.0
