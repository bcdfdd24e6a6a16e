"""The arithmetic-chain task (mrl/data/chain_task.py): values stay in range, the worked solution is what the reward
accepts, train and held-out prompts are disjoint, SFT examples train only the demonstration's response, the flawed
demonstrator errs on `- 3` lines alone at its stated rate, and the reward scores the last line alone (no format
credit, no partial credit)."""

import pytest

from mrl.data.chain_reward import compute_score, final_answer, score
from mrl.data.chain_task import FLAWED_OPERATION, chain_rows, make_problem, sft_example, worked_solution


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
    assert tokenizer.decode(response) == val[0]["extra_info"]["demonstration"] + tokenizer.eos_token
    assert len(response) >= 200  # one token per character: the GPU shape's responses are 200+ tokens
    assert all(r["extra_info"]["demonstration"] == r["extra_info"]["solution"] for r in train)  # flaw_rate 0


def test_the_flawed_demonstrator_errs_on_minus_three_lines_at_its_rate_and_carries_its_error_on():
    import random

    slips = minus_threes = 0
    rng = random.Random(1)
    for _ in range(400):
        start, ops = make_problem(rng, 17, 9)
        shown, answer = worked_solution(start, ops, rng, flaw_rate=0.7)
        value = start
        for line, (sign, operand) in zip(shown.splitlines(), ops):
            # Every line starts from the value the line before it wrote: an error is carried on, not repaired.
            slip = int(line.rsplit("= ", 1)[1]) - (value + operand if sign == "+" else value - operand)
            assert slip in ((0, 1) if (sign, operand) == FLAWED_OPERATION else (0,)), line
            minus_threes += (sign, operand) == FLAWED_OPERATION
            slips += slip
            value = int(line.rsplit("= ", 1)[1])
        assert answer == value and shown.endswith(f"answer {value}")
    assert 0.6 < slips / minus_threes < 0.8, slips / minus_threes


def test_reward_reads_the_last_line_only():
    good = "a: 3 + 4 = 7\nanswer 7"
    assert score(good, "7") == 1.0 and compute_score("mrl/arith_chain", good, 7) == 1.0
    assert score(good, "8") == 0.0
    assert score("a: 3 + 4 = 7\nanswer 7\nb: 7 + 1 = 8", "7") == 0.0  # the answer must come last
    assert score("answer seven", "7") == 0.0 and final_answer("") is None
