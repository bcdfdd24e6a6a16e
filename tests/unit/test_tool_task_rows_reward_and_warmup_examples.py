"""The tool demo's task: disjoint addition prompts, a reward on the answer after the last tool call, and warm-up
examples rendered as the tool loop renders a trajectory (observations untrained)."""

from mrl.rollout.agent_loop import tool_task


def test_rows_are_disjoint_sums_of_length_digit_numbers():
    train, val = tool_task.addition_rows(4, n_train=300, n_val=50, seed=0)
    prompts = [r["prompt"][0]["content"] for r in train + val]
    assert len(set(prompts)) == 350
    for row in train + val:
        a, b = row["prompt"][0]["content"].split("+")
        assert len(a) == len(b) == 4 and row["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_reward_reads_the_answer_after_the_last_tool_call():
    call = tool_task.CALL.format(expr="1234+4321")
    assert tool_task.tool_answer_reward(f"{call}5555", "5555") == 1.0
    assert tool_task.tool_answer_reward(f"{call} 5555\n", "5555") == 1.0
    assert tool_task.tool_answer_reward("5555", "5555") == 1.0  # a direct answer counts when it is right
    assert tool_task.tool_answer_reward(f"{call}5556", "5555") == 0.0
    assert tool_task.tool_answer_reward(call, "5555") == 0.0  # a call and no answer
    assert tool_task.tool_answer_reward(f"5555{call}", "5555") == 0.0


def test_warmup_examples_call_the_tool_or_answer_and_train_only_model_tokens():
    tokenizer = tool_task.tool_tokenizer()
    train, _ = tool_task.addition_rows(4, n_train=40, n_val=1, seed=0)
    examples = tool_task.sft_examples(tokenizer, train, tool_share=0.5, seed=0)
    calls = 0
    for row, (ids, mask) in zip(train, examples):
        expr, answer = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
        trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        text = tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\ntools: python<|im_end|>\n")
        if "<tool_call>" in text:
            calls += 1
            assert trained == tool_task.CALL.format(expr=expr) + "<|im_end|>" + answer + "<|im_end|>"
            assert text.endswith(f"<|im_end|>\n<|im_start|>tool\n{answer}\n<|im_end|>\n<|im_start|>assistant\n"
                                 f"{answer}<|im_end|>")
        else:
            assert trained == answer + "<|im_end|>"
    assert 10 < calls < 30
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<tool_call>x</tool_call>"))[0] == "<tool_call>"
