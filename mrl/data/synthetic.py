"""The demo's verifiable task, generated on the fly: reverse a string of digits ("3817" → "7183").

The reward is an exact match of the whole response (up to the end-of-turn token) with the reversed string, so it
cannot be gamed by emitting many matching tokens: anything but the one right answer scores 0. Train and
held-out prompts are disjoint strings. A character-level tokenizer (no BPE merges) keeps digits one token each.
(Two-digit addition was tried first: a 2-layer model from scratch stayed under 10 % after 600 supervised steps.)
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from mrl.data.exact_match import exact_match_reward  # the task's reward (mrl/reward/registry.py: by its DATA_SOURCE)

DATA_SOURCE = "mrl/reverse_digits"
# 4 special tokens + 256 byte-level symbols: a BPE trained to this size learns no merges.
CHAR_VOCAB = 260


def reverse_rows(length: int, n_train: int, n_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out prompts in the common RL layout (prompt messages, data_source, ground truth)."""
    if n_train + n_val > 10**length // 2:
        raise ValueError(f"ask for at most half of the {10**length} strings of length {length}")
    rng = random.Random(seed)
    strings: dict[str, None] = {}
    while len(strings) < n_train + n_val:
        strings["".join(rng.choice("0123456789") for _ in range(length))] = None

    def row(i: int, s: str, split: str) -> dict[str, Any]:
        return {
            "prompt": [{"role": "user", "content": s}],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": s[::-1]},
            "extra_info": {"index": f"{split}-{i}"},
        }

    ordered = list(strings)
    train = [row(i, s, "train") for i, s in enumerate(ordered[:n_train])]
    val = [row(i, s, "val") for i, s in enumerate(ordered[n_train:])]
    return train, val


def char_tokenizer(out_dir: str | Path | None = None) -> Any:
    from mrl.models.tiny import train_tiny_tokenizer

    return train_tiny_tokenizer(out_dir, vocab_size=CHAR_VOCAB, corpus=["0123456789+="])


def sft_example(tokenizer: Any, messages: list[dict[str, str]], answer: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask): the templated prompt (not trained), then `answer` and the end-of-turn token."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer + tokenizer.eos_token, add_special_tokens=False)
    return prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)


def supervised_warmup(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict], steps: int, *, batch_size: int = 32,
    lr: float = 3e-3, seed: int = 0, examples: list[tuple[list[int], list[int]]] | None = None,
) -> dict[str, float]:
    """Teach the answer format (and some arithmetic) with `steps` AdamW steps of next-token loss on the answer
    tokens; returns the final loss and the wall time. `examples`: ready (ids, loss mask) pairs instead of `rows`
    (e.g. multi-turn ones whose tool observations are not trained)."""
    start = time.monotonic()
    rng = random.Random(seed)
    if examples is None:
        examples = [sft_example(tokenizer, r["prompt"], r["reward_model"]["ground_truth"]) for r in rows]
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (seq, mask) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(seq), -100)
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    return {"sft_loss": float(loss.detach()), "sft_seconds": time.monotonic() - start, "sft_steps": steps}


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, rows: list[dict], max_new_tokens: int = 6) -> float:
    """Held-out greedy accuracy under the task's reward, with plain HF generation (reference for the engines)."""
    model.eval()
    correct = 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt = torch.tensor([tokenizer.encode(ids, add_special_tokens=False)])
        out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
        correct += exact_match_reward(text, row["reward_model"]["ground_truth"]) > 0
    return correct / max(len(rows), 1)
