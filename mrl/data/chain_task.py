"""The learning task of `tools/bench/learn_gpu.py`: a chain of additions and subtractions, worked out line by line.

A prompt gives a start value and K labelled operations; the response applies them in order, one line each, and ends
with the result:

    prompt:   47 a+5 b-3 c+8
    response: a: 47 + 5 = 52
              b: 52 - 3 = 49
              c: 49 + 8 = 57
              answer 57

Values stay in 0..max_value (99, or 9 for single digits) and operands are 1..9; each operation is drawn among those
that keep the value in range. Each line is easy alone (find the label in the prompt, copy the running value, one
small sum), but an exact answer needs all K right, so the accuracy of a model that errs on a small share of lines
falls geometrically with K: the headroom RL uses. With values below 100 and K from 13 to 17 a response is 185-265
characters, with single digits and K from 15 to 19 it is 203-255, one token each under the character tokenizer
(mrl/data/synthetic.char_tokenizer). A random last value scores one answer in max_value + 1 (10 % with single
digits), so accuracy near that level means nothing was learned (docs/learning.md).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from mrl.data.chain_reward import ANSWER_PREFIX, DATA_SOURCE

LABELS = "abcdefghijklmnopqrstuvwxy"  # one per operation: the longest chain has len(LABELS) steps


def make_problem(rng: random.Random, steps: int, max_value: int = 99) -> tuple[int, list[tuple[str, int]]]:
    """A start value and `steps` (sign, operand) pairs, each drawn among those that keep the running value in
    0..max_value."""
    value = rng.randint(0, max_value)
    start, ops = value, []
    for _ in range(steps):
        sign, operand = rng.choice([(sign, d) for d in range(1, 10) for sign in "+-"
                                    if 0 <= (value + d if sign == "+" else value - d) <= max_value])
        value = value + operand if sign == "+" else value - operand
        ops.append((sign, operand))
    return start, ops


def prompt_text(start: int, ops: list[tuple[str, int]]) -> str:
    return " ".join([str(start)] + [f"{LABELS[i]}{sign}{operand}" for i, (sign, operand) in enumerate(ops)])


def worked_solution(start: int, ops: list[tuple[str, int]]) -> tuple[str, int]:
    """The response a perfect model writes, and the final value."""
    lines, value = [], start
    for i, (sign, operand) in enumerate(ops):
        after = value + operand if sign == "+" else value - operand
        lines.append(f"{LABELS[i]}: {value} {sign} {operand} = {after}")
        value = after
    lines.append(f"{ANSWER_PREFIX}{value}")
    return "\n".join(lines), value


def chain_rows(n_train: int, n_val: int, min_steps: int, max_steps: int, seed: int,
               max_value: int = 99) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out problems in the common RL layout (chat prompt, data_source, ground truth); each
    row's `extra_info.solution` holds the worked solution for supervised warm-up."""
    if not 1 <= min_steps <= max_steps <= len(LABELS):
        raise ValueError(f"steps must satisfy 1 <= min_steps <= max_steps <= {len(LABELS)}")
    rng = random.Random(seed)
    problems: dict[str, str] = {}
    while len(problems) < n_train + n_val:
        start, ops = make_problem(rng, rng.randint(min_steps, max_steps), max_value)
        problems.setdefault(prompt_text(start, ops), worked_solution(start, ops)[0])

    def row(i: int, prompt: str, solution: str, split: str) -> dict[str, Any]:
        answer = solution.rsplit(ANSWER_PREFIX, 1)[1]
        return {
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": f"{split}-{i}", "solution": solution},
        }

    items = list(problems.items())
    train = [row(i, p, s, "train") for i, (p, s) in enumerate(items[:n_train])]
    val = [row(i, p, s, "val") for i, (p, s) in enumerate(items[n_train:])]
    return train, val


def sft_example(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a row's prompt and its worked solution (mrl/data/synthetic.sft_example)."""
    from mrl.data.synthetic import sft_example as templated

    return templated(tokenizer, row["prompt"], row["extra_info"]["solution"])


def write_task(out: Path, model_dir: str | Path, train: list[dict], val: list[dict]) -> dict[str, str]:
    """The task as any framework reads it: the HF model folder, train/val parquet files in verl's layout and the
    reward module (standard library only, verl's `compute_score` and mrl's `score`)."""
    from mrl.data import chain_reward
    from mrl.data.datasets import write_rows

    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if Path(model_dir).resolve() != model.resolve():
        shutil.copytree(model_dir, model, dirs_exist_ok=True)
    reward = out / "chain_reward.py"
    shutil.copyfile(chain_reward.__file__, reward)
    return {
        "model": str(model),
        "train": str(write_rows(train, out / "train.parquet")),
        "val": str(write_rows(val, out / "val.parquet")),
        "reward": str(reward),
    }
