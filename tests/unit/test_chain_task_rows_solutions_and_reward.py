"""The arithmetic-chain task (mrl/data/chain_task.py): values stay in range, the worked solution is what the reward
accepts, train and held-out prompts are disjoint, SFT examples train only the response, and the reward scores the
last line alone (no format credit, no partial credit)."""

import pytest

from mrl.data.chain_reward import compute_score, final_answer, score
from mrl.data.chain_task import chain_rows, make_problem, sft_example, worked_solution


@pytest.mark.parametrize("max_value", [9, 99])
def test_every_value_stays_in_range_and_the_solution_scores_one(max_value):
    import random

    rng = random.Random(0)
    for _ in range(200):
        start, ops = make_problem(rng, 19, max_value)
        value = start
        for sign, operand in ops:
            value = value + operand if sign == "+" else value - operand
            assert 0 <= value <= max_value and 1 <= operand <= 9
        text, result = worked_solution(start, ops)
        assert result == value and score(text, str(value)) == 1.0


def test_rows_are_disjoint_and_sft_trains_the_response_only():
    from mrl.data.synthetic import char_tokenizer

    train, val = chain_rows(300, 50, 15, 19, seed=3, max_value=9)
    prompts = {r["prompt"][0]["content"] for r in train}
    assert len(prompts) == 300 and not prompts & {r["prompt"][0]["content"] for r in val}
    tokenizer = char_tokenizer()
    ids, mask = sft_example(tokenizer, val[0])
    response = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(response) == val[0]["extra_info"]["solution"] + tokenizer.eos_token
    assert len(response) >= 200  # one token per character: the GPU shape's responses are 200+ tokens


def test_reward_reads_the_last_line_only():
    good = "a: 3 + 4 = 7\nanswer 7"
    assert score(good, "7") == 1.0 and compute_score("mrl/arith_chain", good, 7) == 1.0
    assert score(good, "8") == 0.0
    assert score("a: 3 + 4 = 7\nanswer 7\nb: 7 + 1 = 8", "7") == 0.0  # the answer must come last
    assert score("answer seven", "7") == 0.0 and final_answer("") is None
