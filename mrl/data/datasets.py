"""Prompt datasets: rows of raw chat messages plus what the reward needs; templating happens in the agent loop.

Row layout (the common RL parquet layout, also read from JSONL): `prompt` (a list of {role, content} messages, or
a plain string taken as one user message), `data_source`, `reward_model.ground_truth`, `extra_info`. Rows come
out as dicts {messages, data_source, ground_truth, extra_info, uid}.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def normalize_row(row: dict[str, Any], index: int, prompt_key: str = "prompt") -> dict[str, Any]:
    prompt = row[prompt_key]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    reward_model = row.get("reward_model") or {}
    extra = dict(row.get("extra_info") or {})
    return {
        "messages": messages,
        "data_source": row.get("data_source", "default"),
        "ground_truth": reward_model.get("ground_truth", row.get("ground_truth")),
        "extra_info": extra,
        "uid": str(extra.get("uid", extra.get("index", index))),
    }


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl or .json file as plain Python objects."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json":
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"{path}: unsupported dataset format (use .parquet, .jsonl or .json)")


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows in the common layout (parquet or JSONL by suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class RLDataset:
    def __init__(self, rows: Sequence[dict[str, Any]], prompt_key: str = "prompt") -> None:
        self.rows = [normalize_row(r, i, prompt_key) for i, r in enumerate(rows)]

    @classmethod
    def from_files(cls, paths: Sequence[str], prompt_key: str = "prompt") -> RLDataset:
        return cls([row for p in paths for row in read_rows(p)], prompt_key)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def batches(self, batch_size: int, *, shuffle: bool = True, seed: int = 1) -> Iterator[list[dict[str, Any]]]:
        """Endless full batches, reshuffled each epoch (a remainder smaller than a batch waits for the next)."""
        if batch_size > len(self.rows):
            raise ValueError(f"data.train_batch_size={batch_size} exceeds the dataset's {len(self.rows)} prompts")
        rng = random.Random(seed)
        pending: list[dict[str, Any]] = []
        while True:
            order = list(range(len(self.rows)))
            if shuffle:
                rng.shuffle(order)
            pending += [self.rows[i] for i in order]
            while len(pending) >= batch_size:
                yield pending[:batch_size]
                pending = pending[batch_size:]
