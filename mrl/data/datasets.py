"""Prompt datasets: rows of raw chat messages plus what the reward needs; templating happens in the agent loop.

Row layout (the common RL parquet layout, also read from JSONL): `prompt` (a list of {role, content} messages, or
a plain string taken as one user message), `data_source`, `reward_model.ground_truth`, `extra_info`. Rows come
out as dicts {messages, data_source, ground_truth, extra_info, uid}.

Malformed rows (no prompt, a prompt that is not text or a list of {role, content} text messages, non-dict
`reward_model`/`extra_info`, a JSONL line that is not JSON) are counted, logged once with their reasons and
skipped when the dataset is read, so they can never reach (and crash) a training step; so are prompts longer than
data.max_prompt_length tokens after the chat template (`drop_long_prompts`, once the tokenizer is known).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MalformedRow(ValueError):
    """A dataset row that cannot become a prompt; the message says which field breaks which rule."""


def _check_row(row: Any, prompt_key: str) -> None:
    if not isinstance(row, dict):
        raise MalformedRow(f"a row must be an object, got {type(row).__name__}")
    prompt = row.get(prompt_key)
    if prompt is None:
        raise MalformedRow(f"no {prompt_key!r} field")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MalformedRow(f"{prompt_key!r} is empty")
    elif not isinstance(prompt, list) or not prompt:
        raise MalformedRow(f"{prompt_key!r} must be a string or a non-empty list of messages, got {prompt!r:.60}")
    elif not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                 for m in prompt):
        raise MalformedRow(f"every message of {prompt_key!r} needs a text 'role' and 'content'")
    for key in ("reward_model", "extra_info"):
        if row.get(key) is not None and not isinstance(row[key], dict):
            raise MalformedRow(f"{key!r} must be an object, got {type(row[key]).__name__}")


def templated_prompt_ids(tokenizer: Any, messages: list[dict[str, str]],
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids as the rollout sees them: chat template with the generation prompt (and the tools'
    function schemas, which the template renders, when given)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def normalize_row(row: dict[str, Any], index: int, prompt_key: str = "prompt") -> dict[str, Any]:
    """One row in the trainer's layout; raises MalformedRow for a row that cannot be a prompt."""
    _check_row(row, prompt_key)
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
        return [_json_line(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"{path}: unsupported dataset format (use .parquet, .jsonl or .json)")


def data_sources(path: str | Path) -> set[str]:
    """The data_source values of a dataset file as the trainer reads them (a row without one: "default"); a
    parquet file's column alone is read. Malformed rows are skipped here as RLDataset skips them."""
    if Path(path).suffix == ".parquet":
        import pyarrow.parquet as pq

        if "data_source" not in pq.read_schema(path).names:
            return {"default"}
        return {s or "default" for s in pq.read_table(path, columns=["data_source"]).column(0).to_pylist()}
    return {row.get("data_source") or "default" for row in read_rows(path) if isinstance(row, dict)}


def _json_line(line: str) -> Any:
    """A JSONL line; one that is not JSON becomes a marker row that RLDataset counts and skips."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return MalformedRow(f"not JSON ({err.msg}): {line[:60]!r}")


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
    def __init__(self, rows: Sequence[Any], prompt_key: str = "prompt") -> None:
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[tuple[Any, str]] = []  # (row index, or uid once read; reason) of every skipped row
        for i, row in enumerate(rows):
            try:
                if isinstance(row, MalformedRow):
                    raise row
                self.rows.append(normalize_row(row, i, prompt_key))
            except MalformedRow as err:
                self.skipped.append((i, str(err)))
        self._report(self.skipped, len(rows), "malformed")

    @staticmethod
    def _report(skipped: list[tuple[Any, str]], total: int, kind: str) -> None:
        if skipped:
            shown = "; ".join(f"row {i}: {why}" for i, why in skipped[:5])
            logger.warning("skipped %d %s dataset rows of %d (%s%s)", len(skipped), kind, total, shown,
                           ", ..." if len(skipped) > 5 else "")

    def drop_long_prompts(self, tokenizer: Any, max_tokens: int, tools: list[dict[str, Any]] | None = None) -> int:
        """Skip (count, log) rows whose templated prompt (with the tool schemas a tool loop renders into it)
        exceeds `max_tokens` (data.max_prompt_length) or that the chat template refuses: the rollout's context is
        sized for max_prompt_length + max_response_length, so such a prompt would fail its request mid-step.
        Returns how many were dropped."""
        kept, dropped = [], []
        for row in self.rows:
            try:
                n = len(templated_prompt_ids(tokenizer, row["messages"], tools))
                reason = f"{n} prompt tokens > data.max_prompt_length={max_tokens}" if n > max_tokens else ""
            except Exception as err:  # a template error on one row must not stop the run
                reason = f"chat template failed ({type(err).__name__}: {err})"
            if reason:
                dropped.append((row["uid"], reason))
            else:
                kept.append(row)
        self._report(dropped, len(self.rows), "too long or untemplatable")
        self.rows = kept
        self.skipped += dropped
        return len(dropped)

    @classmethod
    def from_files(cls, paths: Sequence[str], prompt_key: str = "prompt") -> RLDataset:
        return cls([row for p in paths for row in read_rows(p)], prompt_key)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def batches(self, batch_size: int, *, shuffle: bool = True, seed: int = 1) -> PromptBatches:
        """Endless full batches, reshuffled each epoch (a remainder smaller than a batch waits for the next)."""
        return PromptBatches(self.rows, batch_size, shuffle=shuffle, seed=seed)


class PromptBatches:
    """The trainer's dataloader: an endless iterator of full batches whose position (shuffle RNG, the rest of the
    current epoch, batches drawn) is a small state dict, so a resumed run draws exactly the batches the
    interrupted one would have."""

    def __init__(self, rows: Sequence[dict[str, Any]], batch_size: int, *, shuffle: bool = True, seed: int = 1):
        if batch_size > len(rows):
            raise ValueError(f"data.train_batch_size={batch_size} exceeds the dataset's {len(rows)} prompts")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.pending: list[int] = []  # row indices not yet served, in order
        self.drawn = 0

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        while len(self.pending) < self.batch_size:
            order = list(range(len(self.rows)))
            if self.shuffle:
                self.rng.shuffle(order)
            self.pending += order
        batch, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        self.drawn += 1
        return [self.rows[i] for i in batch]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "pending": list(self.pending), "drawn": self.drawn,
                "num_rows": len(self.rows), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self.rows):
            raise ValueError(f"the checkpoint's dataloader position is for {state['num_rows']} prompts, but "
                             f"data.train_files now hold {len(self.rows)}: resume with the same training data")
        self.rng.setstate(state["rng"])
        self.pending, self.drawn = list(state["pending"]), state["drawn"]
