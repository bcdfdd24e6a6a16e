"""The learning task of `tools/bench/learn_gpu.py`: a chain of additions and subtractions, worked out line by line.

A prompt gives a start value and K labelled operations; the response applies them in order, one line each (the
operation copied from the prompt first, then the sum), and ends with the result:

    prompt:   7 a+5 b-3 c-1
    response: a+5: 7 + 5 = 12        (with max_value 99; single digits keep every value in 0..9)
              b-3: 12 - 3 = 9
              c-1: 9 - 1 = 8
              answer 8

Values stay in 0..max_value and operands are 1..9; each operation is drawn among those that keep the value in range.
Each line is easy alone (find the label in the prompt, copy the running value, one small sum), but an exact answer
needs all K right. With single digits and K from 15 to 19 a response is 233-293 characters (mean 263), one token each
under the character tokenizer (mrl/data/synthetic.char_tokenizer). A random last value scores one answer in
max_value + 1 (10 % with single digits), so accuracy near that level means nothing was learned.

The supervised warm-up imitates a flawed demonstrator (`flaw_rate`): it writes most `- 3` lines one too high, as a
human annotator with a systematic slip would. A model that imitates it well answers right only on chains without a
`- 3` line (about a quarter of them at K 15-19): supervised learning alone plateaus there. The exact-answer reward
tells the two apart, so RL can take the model past its demonstrator (docs/learning.md).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from mrl.data.chain_reward import ANSWER_PREFIX, DATA_SOURCE

LABELS = "abcdefghijklmnopqrstuvwxy"  # one per operation: the longest chain has len(LABELS) steps
# The operation the flawed demonstrator of the warm-up gets wrong (about one line in 13 with single digits).
FLAWED_OPERATION = ("-", 3)


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


def worked_solution(start: int, ops: list[tuple[str, int]], rng: random.Random | None = None,
                    flaw_rate: float = 0.0) -> tuple[str, int]:
    """The response a perfect model writes, and the final value; with `rng` and `flaw_rate` > 0, the response of
    the flawed demonstrator instead: each `- 3` line comes out one too high (`5 - 3 = 3`) with probability
    `flaw_rate`, and the chain goes on from the value written, as a real demonstrator's would."""
    lines, value = [], start
    for i, (sign, operand) in enumerate(ops):
        after = value + operand if sign == "+" else value - operand
        if rng is not None and (sign, operand) == FLAWED_OPERATION and rng.random() < flaw_rate:
            after += 1
        lines.append(f"{LABELS[i]}{sign}{operand}: {value} {sign} {operand} = {after}")
        value = after
    lines.append(f"{ANSWER_PREFIX}{value}")
    return "\n".join(lines), value


def chain_rows(n_train: int, n_val: int, min_steps: int, max_steps: int, seed: int, max_value: int = 99,
               flaw_rate: float = 0.0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out problems in the common RL layout (chat prompt, data_source, ground truth); each
    row's `extra_info` holds the correct worked `solution` and the `demonstration` a supervised warm-up imitates
    (the flawed demonstrator's, see worked_solution; the solution itself when `flaw_rate` is 0)."""
    if not 1 <= min_steps <= max_steps <= len(LABELS):
        raise ValueError(f"steps must satisfy 1 <= min_steps <= max_steps <= {len(LABELS)}")
    rng = random.Random(seed)
    problems: dict[str, tuple[int, list[tuple[str, int]]]] = {}
    while len(problems) < n_train + n_val:
        start, ops = make_problem(rng, rng.randint(min_steps, max_steps), max_value)
        problems.setdefault(prompt_text(start, ops), (start, ops))
    demonstrator = random.Random(seed + 1)

    def row(i: int, prompt: str, start: int, ops: list[tuple[str, int]], split: str) -> dict[str, Any]:
        solution, answer = worked_solution(start, ops)
        demonstration = worked_solution(start, ops, demonstrator, flaw_rate)[0]
        return {
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": f"{split}-{i}", "solution": solution, "demonstration": demonstration},
        }

    items = list(problems.items())
    train = [row(i, p, *problem, "train") for i, (p, problem) in enumerate(items[:n_train])]
    val = [row(i, p, *problem, "val") for i, (p, problem) in enumerate(items[n_train:])]
    return train, val


def sft_example(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a row's prompt and its demonstration (mrl/data/synthetic.sft_example)."""
    from mrl.data.synthetic import sft_example as templated

    return templated(tokenizer, row["prompt"], row["extra_info"]["demonstration"])


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
