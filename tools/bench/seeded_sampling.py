"""What seeding every request costs vLLM's V1 sampler per decode step, against one batched draw, in the same run.

mrl seeds every rollout request (trainer.seed, the step and the sample's index: reproducible groups). vLLM's V1
sampler (`vllm/v1/sample/ops/topk_topp_sampler.py: random_sample`, 0.25 and 0.32) draws the exponential noise of
the Gumbel trick in one call for the unseeded requests, then once more per seeded request, one by one, with that
request's generator. vLLM 0.25 runs dense models on its V2 model runner, whose sampler draws every seeded row in one
kernel; MoE models outside Qwen2-MoE, DeepSeek-V2 and Granite-MoE, and runs that return routed experts (R3), stay on
V1. This times both ways of drawing the noise for `--rows` running requests over a `--vocab` vocabulary, as
random_sample does them (the probabilities' division and argmax after it are the same for both), and prints the
ratio and the host time per decode step that seeding adds.

`--engine SHAPE` times the whole of generation instead: one vLLM engine (tools/bench/e2e_gpu.py's random-weight
model of that shape, its reverse-task prompts) generates the same `--rows` requests of `--response-length` tokens
(EOS ignored) with a seed each and without, alternating `--repeats` times after a warm-up round; the model runner is
the one vLLM picks (`VLLM_USE_V2_MODEL_RUNNER=0` forces V1).

    python tools/bench/seeded_sampling.py                      # CPU: a small vocabulary
    python tools/bench/seeded_sampling.py --vocab 151936 --rows 64 128 256   # on a GPU (Qwen2's vocabulary)
    VLLM_USE_V2_MODEL_RUNNER=0 python tools/bench/seeded_sampling.py --engine 0.5b --rows 256   # on a GPU
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from engine import timed  # same folder: median seconds, the device drained after each call


def noise_draws(rows: int, vocab: int, device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """(batched, seeded): random_sample's two ways of filling the noise of `rows` requests."""
    q = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    generators = {i: torch.Generator(device=device).manual_seed(1_000 + i) for i in range(rows)}

    def batched() -> None:
        q.exponential_()

    def seeded() -> None:
        for i, generator in generators.items():
            q[i].exponential_(generator=generator)

    return batched, seeded


def engine_rounds(shape: str, rows: int, length: int, repeats: int) -> None:
    """Generation seconds of one vLLM engine, `rows` requests with and without a seed each (the module's docstring)."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the engine core after CUDA is initialised
    from e2e_gpu import make_task  # same folder: the GPU benchmark's model and task
    from vllm import LLM, SamplingParams

    from mrl.data.datasets import read_rows

    folder = Path(tempfile.mkdtemp(prefix="seeded_"))
    paths = make_task(folder, shape, seed=1, variants=[])
    llm = LLM(model=paths["model"], dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=length + 128,
              max_num_seqs=rows, seed=0)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
             for row in read_rows(paths["train"])[:rows]]
    prompts = [{"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)} for text in texts]

    def generate(seeded: bool) -> float:
        params = [SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=1_000 + k if seeded
                                 else None) for k in range(len(prompts))]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    generate(True), generate(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for seeded in ((True, False) if repeat % 2 == 0 else (False, True)):
            times[seeded].append(generate(seeded))
    seeded_s, unseeded_s = (sorted(times[k])[len(times[k]) // 2] for k in (True, False))
    tokens = len(prompts) * length
    print(f"engine {shape}, {len(prompts)} requests x {length} tokens, median of {repeats} rounds: seeded "
          f"{seeded_s:.2f} s ({tokens / seeded_s:,.0f} tok/s), unseeded {unseeded_s:.2f} s "
          f"({tokens / unseeded_s:,.0f} tok/s): unseeded/seeded tok/s {seeded_s / unseeded_s:.3f}, "
          f"{(seeded_s - unseeded_s) / length * 1e3:.2f} ms per decode step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="requests running in one step")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", metavar="SHAPE", help="time generation through a vLLM engine of this shape")
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.engine:
        engine_rounds(args.engine, args.rows[0], args.response_length, args.repeats)
        return
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, vocab {args.vocab}, median of {args.iters}")
    print(f"{'rows':>6} {'batched ms':>11} {'seeded ms':>10} {'seeded/batched':>15} {'added ms/step':>14}")
    for rows in args.rows:
        batched, seeded = noise_draws(rows, args.vocab, device)
        base, each = timed(batched, args.iters, warmup=2), timed(seeded, args.iters, warmup=2)
        print(f"{rows:>6} {base * 1e3:>11.3f} {each * 1e3:>10.3f} {each / base:>15.2f} {(each - base) * 1e3:>14.3f}")


if __name__ == "__main__":
    main()
