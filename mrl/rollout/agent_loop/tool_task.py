"""`mrl demo --task tool`: a task where calling a tool pays. Add two `length`-digit numbers ("4817+2906"): far
beyond a 2-layer model learning from scratch (the reverse task's note: two-digit addition stayed under 10 % after
600 supervised steps), trivial for the sandboxed Python tool.

The ideal trajectory has two model turns around one observation:
  `<tool_call>{"name":"python","arguments":{"code":"print(4817+2906)"}}</tool_call>`  → tool: `7723` → `7723`.
The reward is an exact match of the text after the last tool call (the whole response when there is none) with
the sum. The warm-up shows both behaviours: a minority of its examples call the tool, the rest answer directly, so
sampling finds the tool sometimes, greedy decoding prefers answering directly, and the run must learn which pays.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DATA_SOURCE = "mrl/tool_addition"
TOOL = "mrl.rollout.agent_loop.python_tool:PythonTool"
REWARD_FN = "mrl.rollout.agent_loop.tool_task:tool_answer_reward"
CALL = '<tool_call>{{"name":"python","arguments":{{"code":"print({expr})"}}}}</tool_call>'
CLOSE = "</tool_call>"
# Warm-up learning rate: at the reverse task's 3e-3 the model learned the call's format but not to copy the numbers
# into it or the tool's answer out of it (300 and 600 steps, 3-digit numbers); at 1e-3, 500 steps copy both.
WARMUP_LR = 1e-3
# GRPO learning rate: one step at the reverse task's 1e-3 (Adam's first steps move every weight by about the
# learning rate) broke the exact call format of a model at 61 % held-out accuracy; the next step scored 0.
GRPO_LR = 1e-4
DEMO_DEFAULTS = {"lr": GRPO_LR, "warmup_steps": 500, "length": 3}


def addition_rows(length: int, n_train: int, n_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out prompts "a+b" with `length`-digit operands, in the common RL layout."""
    rng = random.Random(seed)
    low, high = 10 ** (length - 1), 10**length - 1
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < n_train + n_val:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None

    def row(i: int, a: int, b: int, split: str) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "data_source": DATA_SOURCE,
                "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"index": f"{split}-{i}"}}

    ordered = list(pairs)
    return ([row(i, a, b, "train") for i, (a, b) in enumerate(ordered[:n_train])],
            [row(i, a, b, "val") for i, (a, b) in enumerate(ordered[n_train:])])


def tool_answer_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the final answer (the text after the last tool call) is the sum, else 0.0."""
    answer = solution_str.rsplit(CLOSE, 1)[-1]
    return 1.0 if answer.strip() == str(ground_truth).strip() else 0.0


def tool_tokenizer() -> Any:
    """The demo's character tokenizer plus `<tool_call>` and `</tool_call>` as one (non-special) token each, as
    Qwen's tokenizer has them: decoding keeps them, and a call is 20 tokens shorter."""
    from mrl.data.synthetic import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(["<tool_call>", CLOSE])
    return tokenizer


def sft_examples(tokenizer: Any, rows: list[dict], tool_share: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per row, rendered exactly as the tool loop renders a trajectory (tool schemas in the
    prompt, the observation after the call as the loop tokenises it, untrained): a `tool_share` of the rows call
    the tool, the others answer directly."""
    from mrl.data.datasets import templated_prompt_ids
    from mrl.rollout.agent_loop import ToolAgentLoop
    from mrl.rollout.agent_loop.python_tool import PythonTool

    loop = ToolAgentLoop(tokenizer, client=None, max_response_length=0)  # only its observation rendering
    schemas = [PythonTool().schema]
    rng = random.Random(seed)
    eos = tokenizer.eos_token

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    examples = []
    for row in rows:
        prompt = templated_prompt_ids(tokenizer, row["prompt"], schemas)
        answer = encode(row["reward_model"]["ground_truth"] + eos)
        if rng.random() < tool_share:
            call = encode(CALL.format(expr=row["prompt"][0]["content"]) + eos)
            obs = loop.observation_ids([row["reward_model"]["ground_truth"] + "\n"])  # what print() writes
            ids, mask = prompt + call + obs + answer, [0] * len(prompt) + [1] * len(call) + [0] * len(obs)
            mask += [1] * len(answer)
        else:
            ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        examples.append((ids, mask))
    return examples


def prepare(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Task files, the character tokenizer and the warmed-up model folder, plus the task's trainer overrides."""
    import torch

    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import supervised_warmup
    from mrl.models.tiny import build_tiny_hf_model

    torch.manual_seed(args.seed)
    train, val = addition_rows(args.length, n_train=2000, n_val=64, seed=args.seed)
    files = {"train": write_rows(train, out / "data/train.parquet"), "val": write_rows(val, out / "data/val.parquet")}
    tokenizer = tool_tokenizer()
    model = build_tiny_hf_model("qwen2", seed=args.seed, vocab_size=512, tokenizer=tokenizer, init_std=0.02)
    examples = sft_examples(tokenizer, train, args.tool_share, args.seed)
    report = supervised_warmup(model, tokenizer, train, args.warmup_steps, lr=WARMUP_LR, seed=args.seed,
                               examples=examples)
    report["tool_share"] = args.tool_share
    model_dir = out / "model"
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    prompts = [mask.index(1) for _, mask in examples]
    longest_response = max(len(ids) - p for (ids, _), p in zip(examples, prompts))
    overrides = [  # room for the ideal trajectory plus a few tokens
        "rollout.agent_loop=tool", f"rollout.tools=[{TOOL}]", "rollout.max_turns=3", "data.train_batch_size=8",
        f"data.max_prompt_length={max(prompts) + 8}", f"data.max_response_length={longest_response + 16}",
        f"reward.reward_fn='{REWARD_FN}'",
    ]
    return {"model": str(model_dir), "train": str(files["train"]), "val": str(files["val"]), "warmup": report,
            "overrides": overrides}
