"""Supervised fine-tuning through the Megatron engine: next-token loss on the response tokens of (prompt, response)
pairs, the engine's own packed micro-batches and optimizer, and greedy held-out accuracy every `eval_every` steps.

Used as a warm-up before RL (`tools/bench/learn_gpu.py`): it can stop as soon as held-out accuracy reaches a
target, so RL starts from a model that solves some but not most prompts. The model is written back as an HF folder
(the bridge's export, loaded into the transformers class of the same config) so any trainer or engine reads it.
Accuracy is measured by transformers' greedy `generate` on the exported weights, scored by the task's reward.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mrl.algo.aggregation import LossNormalizer, agg_loss


def sft_loss(outputs: dict[str, Tensor], mb: dict[str, Tensor], normalizer: LossNormalizer) -> tuple[Tensor, dict]:
    """Mean negative log-likelihood over the step's response tokens (token-mean, exact under any split)."""
    return agg_loss(-outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}


@dataclasses.dataclass
class SFTSettings:
    model_path: str
    out_dir: str
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 20
    params_dtype: str = "float32"
    max_tokens_per_micro_batch: int = 16384
    eval_every: int = 20
    max_new_tokens: int = 256
    reward_fn: str = "exact_match"
    # Stop at the first evaluation whose greedy accuracy reaches this (None: run every step).
    stop_at_accuracy: float | None = None
    # Stop at the first evaluation after this many seconds of training (None: no limit).
    max_seconds: float | None = None
    seed: int = 1


def run_sft(rank: int, world_size: int, settings: SFTSettings, examples: Sequence[tuple[list[int], list[int]]],
            eval_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One SFT run (a `mrl.utils.distributed.launch` target; world size 1); returns the accuracy curve, the loss
    curve and the seconds spent, and writes the model as an HF folder to `settings.out_dir` on rank 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown

    s = settings
    dtype = getattr(torch, s.params_dtype)
    optim = OptimConfig(lr=s.lr, min_lr=s.lr / 10, weight_decay=0.01, clip_grad=1.0, lr_warmup_steps=s.warmup_steps,
                        lr_decay_style="cosine", betas=(0.9, 0.95))
    engine = MegatronEngine(s.model_path, MegatronConfig(params_dtype=s.params_dtype), optim, micro_batch_size=None,
                            max_tokens_per_micro_batch=s.max_tokens_per_micro_batch, total_steps=s.steps, seed=s.seed)
    engine.initialize()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(s.model_path)
    hf = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=dtype).to(device)
    rng = random.Random(s.seed)
    curve: list[dict[str, float]] = []
    start = time.monotonic()
    try:
        for step in range(1, s.steps + 1):
            batch = [rng.choice(examples) for _ in range(s.batch_size)]
            seqs = [{"input_ids": torch.tensor(ids), "response_mask": torch.tensor(mask, dtype=torch.float32)}
                    for ids, mask in batch]
            metrics = engine.forward_backward(JaggedBatch.from_sequences(seqs), sft_loss)
            metrics.update(engine.optimizer_step())
            done = step == s.steps
            if step % s.eval_every == 0 or done:
                load_into(hf, engine)
                accuracy = greedy_accuracy(hf, tokenizer, eval_rows, s.max_new_tokens, s.reward_fn)
                curve.append({"step": step, "loss": metrics["loss"], "lr": metrics["lr"], "val_acc": accuracy,
                              "seconds": round(time.monotonic() - start, 1)})
                print(f"[sft] step {step}: loss {metrics['loss']:.4f}, held-out greedy accuracy {accuracy:.3f} "
                      f"({curve[-1]['seconds']:.0f} s)", flush=True)
                reached = s.stop_at_accuracy is not None and accuracy >= s.stop_at_accuracy
                timed_out = s.max_seconds is not None and time.monotonic() - start >= s.max_seconds
                if reached or timed_out:
                    break
        if rank == 0:
            hf.save_pretrained(s.out_dir)
            tokenizer.save_pretrained(s.out_dir)
    finally:
        teardown()
    return {"curve": curve, "seconds": round(time.monotonic() - start, 1), "steps": curve[-1]["step"] if curve else 0}


def load_into(model: torch.nn.Module, engine: Any) -> None:
    """The engine's current weights, as its bridge exports them under HF names, into the transformers model."""
    with torch.no_grad():
        state = {name: tensor for name, tensor in engine.export_weights()}
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"export does not match the HF model: missing {missing}, unexpected {unexpected}")


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                    reward_fn: str, batch_size: int = 256) -> float:
    """Share of `rows` whose greedy response scores > 0 under `reward_fn` (a data_source or "module:function"),
    generated in batches with left padding."""
    from mrl.reward.registry import resolve_reward_fn

    score = resolve_reward_fn(reward_fn)
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                                  tokenize=False), add_special_tokens=False)
                   for r in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for j, p in enumerate(prompts):
            ids[j, width - len(p):] = torch.tensor(p)
            attention[j, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        for j, r in enumerate(chunk):
            text = tokenizer.decode(out[j, width:], skip_special_tokens=True)
            correct += score(text, r["reward_model"]["ground_truth"], r.get("extra_info")) > 0
    return correct / max(len(rows), 1)
