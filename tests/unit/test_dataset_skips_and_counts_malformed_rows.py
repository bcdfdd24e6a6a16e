"""Malformed dataset rows (no prompt, wrong types, an empty prompt, a JSONL line that is not JSON) are counted,
reported with their reasons and skipped when a dataset is read; the good rows keep their positions as uids."""

import logging

from mrl.data.datasets import RLDataset, read_rows

GOOD = {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}
BAD = [
    ({"question": "no prompt key"}, "no 'prompt'"),
    ({"prompt": None}, "no 'prompt'"),
    ({"prompt": "   "}, "empty"),
    ({"prompt": 42}, "must be a string or a non-empty list"),
    ({"prompt": []}, "must be a string or a non-empty list"),
    ({"prompt": [{"role": "user"}]}, "text 'role' and 'content'"),
    ({"prompt": [{"role": "user", "content": 3}]}, "text 'role' and 'content'"),
    ({"prompt": "ok", "reward_model": "4"}, "'reward_model' must be an object"),
    ({"prompt": "ok", "extra_info": [1]}, "'extra_info' must be an object"),
    (["not", "a", "row"], "must be an object"),
]


def test_malformed_rows_are_counted_logged_and_skipped(caplog):
    rows = [GOOD] + [row for row, _ in BAD] + [GOOD]
    with caplog.at_level(logging.WARNING, logger="mrl.data.datasets"):
        data = RLDataset(rows)
    assert len(data) == 2 and [r["uid"] for r in data.rows] == ["0", str(len(rows) - 1)]
    assert [i for i, _ in data.skipped] == list(range(1, len(BAD) + 1))
    for (_, why), (_, expected) in zip(data.skipped, BAD):
        assert expected in why, (why, expected)
    assert f"skipped {len(BAD)} malformed dataset rows of {len(rows)}" in caplog.text


def test_a_broken_jsonl_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", \n{"prompt": "c"}\n')
    data = RLDataset(read_rows(path))
    assert [r["messages"][0]["content"] for r in data.rows] == ["a", "c"]
    assert data.skipped[0][0] == 1 and "not JSON" in data.skipped[0][1]


def test_prompts_longer_than_max_prompt_length_are_dropped_after_templating(caplog):
    from mrl.data.datasets import templated_prompt_ids
    from mrl.models.tiny import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer()
    data = RLDataset([{"prompt": "hi"}, {"prompt": "a long question " * 20}, {"prompt": "ok"},
                      {"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}])
    lengths = [len(templated_prompt_ids(tokenizer, r["messages"])) for r in data.rows]
    limit = max(lengths[0], lengths[2], lengths[3])
    assert lengths[1] > limit
    with caplog.at_level(logging.WARNING, logger="mrl.data.datasets"):
        assert data.drop_long_prompts(tokenizer, limit) == 1
    assert [r["uid"] for r in data.rows] == ["0", "2", "3"]
    assert data.skipped == [("1", f"{lengths[1]} prompt tokens > data.max_prompt_length={limit}")]
    assert "skipped 1 too long or untemplatable dataset rows of 4" in caplog.text
