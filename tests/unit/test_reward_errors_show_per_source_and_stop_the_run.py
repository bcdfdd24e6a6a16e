"""A broken reward function is seen, not trained on: failures (exceptions, timeouts, non-finite scores) are counted
per data source as `reward/<source>/error_rate`, the first error's text is printed once, a step past
`reward.max_error_rate` stops the run before any training stage, and a data_source with no reward function is
refused (at start-up from the data files, and at scoring) instead of being scored as math."""

import math
import time
from collections.abc import Mapping
from typing import Any

import pytest
from omegaconf import OmegaConf

from mrl.config.startup.loader import load_config
from mrl.config.startup.reward_rules import _reward_sources
from mrl.data.datasets import RLDataset, write_rows
from mrl.reward.errors import RewardErrorRateExceeded, RewardErrors
from mrl.reward.evaluator import RewardEvaluator, RewardItem
from mrl.reward.registry import UnknownDataSource
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts


def flaky_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    fail = (extra_info or {}).get("fail")
    if fail == "raise":
        raise RuntimeError("judge unreachable")
    if fail == "nan":
        return math.nan
    if fail == "hang":
        time.sleep(1.0)
    return 1.0


def test_each_kind_of_failure_counts_per_source_and_the_first_error_prints_once(capsys):
    items = [RewardItem("x", "x", "good") for _ in range(4)] + [
        RewardItem("x", "x", "bad", {"fail": kind}) for kind in ("raise", "nan", "hang", None)]
    errors = RewardErrors(max_error_rate=1.0)
    with RewardEvaluator(flaky_reward, max_workers=8, timeout_s=0.3) as evaluator:
        errors.record(items, evaluator.evaluate_sync(items))
        errors.record(items[4:5], evaluator.evaluate_sync(items[4:5]))
    assert errors.take() == {"reward/good/error_rate": 0.0, "reward/bad/error_rate": 0.8}
    printed = [ln for ln in capsys.readouterr().out.splitlines() if "first error" in ln]
    assert printed == ["[mrl] reward: first error for data_source 'bad': RuntimeError: judge unreachable"]
    assert errors.take() == {}  # each step reports the calls since the previous one


def test_a_step_past_max_error_rate_stops_the_run_before_training():
    cfg = load_config("tiny/grpo", ["model.path=unused", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                    "rollout.n=2", "reward.max_error_rate=0.1"], check_paths=False)
    rows = [{"prompt": f"q{i}", "data_source": "my/judge", "reward_model": {"ground_truth": "a"},
             "extra_info": {"index": i, "fail": "raise" if i == 0 else None}} for i in range(2)]

    class AgentLoops:
        def generate(self, prompts: list[dict], n: int, sampling: dict) -> list[dict]:
            return [{"key": f"{p['uid']}/{j}", "response_text": "a", "min_version": 0, "max_version": 0}
                    for p in prompts for j in range(n)]

    with RewardEvaluator(flaky_reward) as reward:
        # No worker groups: a training stage reached after the reward would fail on them, not with this error.
        parts = TrainerParts(actor_rollout=None, rollout=None, agent_loops=AgentLoops(), tokenizer=None,
                             train_data=RLDataset(rows), val_data=None, reward=reward)
        trainer = PPOTrainer(OmegaConf.to_object(cfg), parts)
        with pytest.raises(RewardErrorRateExceeded, match=r"reward.max_error_rate=0.1: 2 of 4 reward calls for "
                                                          r"data_source 'my/judge' failed \(50%\); first error: "
                                                          r"RuntimeError: judge unreachable"):
            trainer.step()


def test_an_unknown_data_source_is_refused_at_scoring_naming_the_known_ones():
    with RewardEvaluator() as evaluator, pytest.raises(UnknownDataSource, match=r"'my/task'.*known: .*openai/gsm8k"):
        evaluator.evaluate_sync([RewardItem("#### 1", "1", "openai/gsm8k"), RewardItem("1", "1", "my/task")])
    with RewardEvaluator() as evaluator:  # rows without a data_source are scored by "default" (math answers)
        assert [r.score for r in evaluator.evaluate_sync([RewardItem("#### 1", "1")])] == [1.0]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_unknown_data_source_in_the_data_files_is_refused_at_start_up(tmp_path, suffix):
    rows = [{"prompt": "q", "data_source": source, "reward_model": {"ground_truth": "1"}}
            for source in ("openai/gsm8k", "my/task", "my/task")]
    train = write_rows(rows, tmp_path / f"train{suffix}")
    cfg = load_config("tiny/grpo", ["model.path=unused", f"data.train_files=[{train}]"], check_paths=False)
    (violation,) = _reward_sources(cfg, True)
    assert violation.setting == "data.train_files" and "data_source 'my/task' has no reward function" in violation.rule
    fixed = load_config("tiny/grpo", ["model.path=unused", f"data.train_files=[{train}]",
                                      "reward.reward_fn=exact_match"], check_paths=False)
    assert list(_reward_sources(fixed, True)) == []  # one function for every row: the sources are not read
