"""Datasets: the common RL layout (prompt messages, data_source, reward_model.ground_truth, extra_info) reads the
same from parquet and JSONL, yields raw chat messages, and serves full reshuffled batches across epochs."""

from mrl.data.datasets import RLDataset, read_rows, write_rows

ROWS = [
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
     "data_source": "openai/gsm8k", "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i}}
    for i in range(5)
]


def test_parquet_and_jsonl_give_the_same_rows(tmp_path):
    parquet = RLDataset.from_files([str(write_rows(ROWS, tmp_path / "d.parquet"))])
    jsonl = RLDataset.from_files([str(write_rows(ROWS, tmp_path / "d.jsonl"))])
    assert parquet.rows == jsonl.rows
    row = parquet[3]
    assert row["messages"] == ROWS[3]["prompt"]  # raw messages: templating belongs to the agent loop
    assert row["ground_truth"] == "3" and row["data_source"] == "openai/gsm8k" and row["uid"] == "3"


def test_a_plain_string_prompt_becomes_one_user_message(tmp_path):
    path = write_rows([{"question": "2+2?", "reward_model": {"ground_truth": "4"}}], tmp_path / "q.jsonl")
    (row,) = RLDataset(read_rows(path), prompt_key="question").rows
    assert row["messages"] == [{"role": "user", "content": "2+2?"}] and row["data_source"] == "default"


def test_batches_are_full_and_cover_every_prompt_each_epoch():
    data = RLDataset(ROWS)
    batches = data.batches(2, seed=3)
    seen = [r["uid"] for _ in range(5) for r in next(batches)]  # 10 = two epochs of 5
    assert sorted(seen) == sorted([str(i) for i in range(5)] * 2)
    again = data.batches(2, seed=3)
    assert [r["uid"] for _ in range(5) for r in next(again)] == seen  # seeded
