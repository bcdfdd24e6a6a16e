"""The demo's task: held-out strings never appear in training, the reward cannot be gamed (only the exact answer
scores), and the tokenizer keeps every digit one token."""

from mrl.data.synthetic import char_tokenizer, exact_match_reward, reverse_rows


def test_train_and_held_out_prompts_are_disjoint_and_answers_reverse_them():
    train, val = reverse_rows(4, n_train=500, n_val=50, seed=3)
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(prompts(train)) == 500 and len(prompts(val)) == 50 and not prompts(train) & prompts(val)
    assert all(r["reward_model"]["ground_truth"] == r["prompt"][0]["content"][::-1] for r in train + val)
    assert reverse_rows(4, 500, 50, seed=3) == (train, val)  # seeded


def test_only_the_exact_answer_scores():
    assert exact_match_reward("4321", "4321") == 1.0 and exact_match_reward(" 4321\n", "4321") == 1.0
    for gamed in ("4321 4321", "43214321", "432", "43210", "4", "", "1234"):
        assert exact_match_reward(gamed, "4321") == 0.0


def test_digits_are_single_tokens():
    tokenizer = char_tokenizer()
    ids = tokenizer.encode("9081726354", add_special_tokens=False)
    assert len(ids) == 10 and tokenizer.decode(ids) == "9081726354"
