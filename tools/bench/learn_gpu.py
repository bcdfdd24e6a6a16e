"""Learning at model scale: supervised warm-up, then hybrid GRPO beside an lr-0 control, on the arithmetic chain.

The task (mrl/data/chain_task.py): a start digit and 15-19 labelled +/- operations that keep it a digit; the response
works them out one line each (about 260 tokens) and ends with `answer N`; reward 1 for the exact answer
(mrl/data/chain_reward.py). The warm-up imitates a flawed demonstrator (most `- 3` lines one too high), so imitation
plateaus near the share of chains without such a line (about a quarter); the reward sees the difference. Stages
(`--stages`, in this order):

1. `warmup`: a Qwen2-family model from random weights (`--shape 0.1b`: 135.8M parameters, the project's character
   tokenizer) trained with the SFT loss through the Megatron engine (mrl/trainer/sft.py) for the shape's steps, on
   the training chains and shorter ones of the same task; greedy held-out accuracy every `eval_every` steps
   (`--stop-at` ends it early, `--warmup-seconds` caps it, `--init` goes on from an earlier warm-up). Then the task
   is written to OUT/task as any framework reads it: the HF folder, train/val parquet files (chat prompts,
   `reward_model.ground_truth`, `data_source`) and the reward module with verl's `compute_score` and mrl's `score`
   (standard library only). `--write-task DIR` runs this stage alone into DIR.
2. `grpo`: hybrid GRPO from that checkpoint (Megatron actor and vLLM on one device, bf16, B × n samples, responses
   up to 1,024 tokens, B / mini-batch updates per step), greedy held-out accuracy every `--test-freq` steps, for
   `--grpo-seconds` of training (trainer.time_limit_s). `--grpo-runs SEED:T[:LR] ...` makes several runs (seeds,
   rollout temperatures, learning rates) from the same checkpoint.
3. `control`: the same run with learning rate 0, for `--control-seconds`.

`--side-by-side` runs the RL runs at once, each in its own process on the same device. A run whose folder holds a
checkpoint (the step that crossed its time limit saved it) goes on from it, so a run can span device calls.
Writes OUT/summary.json (warm-up curve, each run's accuracy curve, steps per hour, tokens per second) and
OUT/learn.png (`mrl report` of the runs side by side); each run's metrics.jsonl lies in OUT/<run>/.

    python tools/bench/learn_gpu.py --shape 0.1b --out /tmp/learn --stages warmup       # one device call
    python tools/bench/learn_gpu.py --shape 0.1b --out /tmp/learn --stages grpo control --side-by-side \
        --grpo-runs 1:1:5e-6 1:1:1.5e-5 1:1:4e-5 --grpo-seconds 390 --control-seconds 330  # the lr sweep
    python tools/bench/learn_gpu.py --shape 0.1b --out /tmp/learn --stages grpo --side-by-side \
        --grpo-runs 2:1 1:0.7 --grpo-seconds 390                                           # seed 2, T 0.7
    python tools/bench/learn_gpu.py --shape cpu --out runs/learn_cpu --side-by-side    # the CPU rehearsal
    python tools/bench/learn_gpu.py --shape smoke --out /tmp/smoke                      # the CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REWARD_FN = "mrl.data.chain_reward:score"
SFT_EVAL_ROWS = 128
STAGGER_S = 15.0  # between the starts of side-by-side runs on a GPU
# Per shape: the model, the task's chain lengths and sizes, the warm-up and the GRPO batch.
SHAPES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        model=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2),
        dtype="float32", chain=(2, 3), max_value=99, n_train=512, n_val=16, flaw_rate=0.7, short=None,
        sft=dict(steps=20, batch_size=16, lr=3e-3, warmup_steps=4, eval_every=10, max_new_tokens=48),
        grpo=dict(batch=4, n=4, mini=2, lr=1e-4, response=64, micro_tokens=4096, memory=None),
    ),
    # A CPU-sized rehearsal of the same path (minutes on 2 cores): short single-digit chains, a 4-layer model.
    "cpu": dict(
        model=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2),
        dtype="float32", chain=(6, 8), max_value=9, n_train=8000, n_val=64, flaw_rate=0.7, short=((3, 5), 4000),
        sft=dict(steps=1000, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=50, max_new_tokens=160),
        grpo=dict(batch=16, n=8, mini=8, lr=1e-4, response=200, micro_tokens=8192, memory=None),
    ),
    "0.1b": dict(
        model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4),
        dtype="bfloat16", chain=(15, 19), max_value=9, n_train=50_000, n_val=256, flaw_rate=0.7,
        short=((3, 14), 30_000),
        sft=dict(steps=750, batch_size=128, lr=1e-3, eval_every=50, max_new_tokens=320),
        # The lr sweep on an H100 (2026-12-06, docs/learning.md): 5e-6 took held-out accuracy 0.21 -> 0.94-0.96
        # in 400 s for two seeds and T 0.7; 1.5e-5 rose faster and wobbled (0.90-0.95), 4e-5 peaked at 0.87 and
        # fell to 0.71, 2e-4 unlearned (0.21 -> 0.09, entropy 0.006 -> 0.13). A fixed KV cache (kv_gib) skips
        # vLLM's start-up memory profiling, which fails when a side-by-side run's engine sleeps or wakes meanwhile.
        grpo=dict(batch=64, n=8, mini=16, lr=5e-6, response=1024, micro_tokens=16384, memory=0.15, kv_gib=6),
    ),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One RL run from the warm-up checkpoint: GRPO, or the lr-0 control."""
    label: str
    lr: float
    seconds: float
    seed: int
    temperature: float
    fp8: bool = False  # FP8 rollout (rollout.quantization=fp8, CUTLASS GEMM) with token TIS (docs/fp8.md)


def planned_runs(args: argparse.Namespace, shape: dict[str, Any]) -> list[Run]:
    """The GRPO runs (`--grpo-runs SEED:TEMPERATURE[:LR[:fp8]] ...`, default the --seed and --temperature) and the
    control, as --stages asks."""
    runs = []
    if "grpo" in args.stages:
        for spec in args.grpo_runs or [f"{args.seed}:{args.temperature:g}"]:
            seed, temperature, *rest = spec.split(":")
            if rest[1:] not in ([], ["fp8"]):
                raise SystemExit(f"--grpo-runs {spec}: expected SEED:T[:LR[:fp8]]")
            lr, fp8 = (rest[0] if rest and rest[0] else None), rest[1:] == ["fp8"]
            label = (f"grpo_seed{seed}_t{float(temperature):g}" + (f"_lr{float(lr):g}" if lr else "")
                     + ("_fp8" if fp8 else ""))
            runs.append(Run(label, float(lr) if lr else args.lr or shape["grpo"]["lr"], args.grpo_seconds,
                            int(seed), float(temperature), fp8))
    if "control" in args.stages:
        runs.append(Run(f"control_lr0_seed{args.seed}", 0.0, args.control_seconds, args.seed, args.temperature))
    return [r for r in runs if args.only in (None, r.label)]


def side_by_side(runs: list[Run], out: Path, task_folder: Path, stagger_s: float) -> None:
    """Each run in a process (and Ray cluster) of its own, all at once on the same device: a 0.1B model's step is
    mostly latency, so runs that share the GPU each go almost as fast as one alone, and one lease holds them all."""
    argv = [a for a in sys.argv[1:] if a not in ("--side-by-side",)]
    children = []
    for i, run in enumerate(runs):
        if i:  # engines that profile their memory at the same instant would count each other's allocations
            time.sleep(stagger_s)
        children.append(subprocess.Popen(
            [sys.executable, __file__, *argv, "--task", str(task_folder), "--only", run.label, "--stages", "grpo",
             "control"], stdout=open(out / f"{run.label}.log", "w"), stderr=subprocess.STDOUT))  # noqa: SIM115
    for run, child in zip(runs, children):
        print(f"[learn] {run.label}: pid {child.pid}, log {out / f'{run.label}.log'}", flush=True)
    codes = [child.wait() for child in children]
    if any(codes):
        print(f"[learn] side-by-side exit codes {dict(zip((r.label for r in runs), codes))}", flush=True)
    for run, code in zip(runs, codes):
        if code:
            tail = (out / f"{run.label}.log").read_text(errors="replace").splitlines()[-12:]
            print(f"[learn] {run.label} failed; its log ends:\n" + "\n".join(tail), flush=True)


def warmup(args: argparse.Namespace, shape: dict[str, Any], out: Path) -> dict[str, Any]:
    """Build the model, warm it up through the engine, write the task; return the task's paths and the report."""
    import torch
    from safetensors import safe_open

    from mrl.data.chain_task import chain_rows, sft_example, write_task
    from mrl.data.synthetic import char_tokenizer
    from mrl.models.tiny import make_tiny_hf_model
    from mrl.trainer.sft import SFTSettings, run_sft
    from mrl.utils.distributed import launch

    train, val = chain_rows(shape["n_train"], shape["n_val"], *shape["chain"], seed=args.seed,
                            max_value=shape["max_value"], flaw_rate=shape["flaw_rate"])
    # Shorter chains of the same task in the warm-up only: the step a model must learn first (find the line's
    # operation in the prompt) is the same at every length, and short chains reach it in fewer steps.
    short = []
    if shape["short"]:
        (low, high), count = shape["short"]
        short = chain_rows(count, 0, low, high, seed=args.seed + 1000, max_value=shape["max_value"],
                           flaw_rate=shape["flaw_rate"])[0]
    tokenizer = char_tokenizer()
    # --init: go on from an earlier warm-up's model (a device call caps one warm-up's minutes).
    init = Path(args.init) if args.init else make_tiny_hf_model(
        "qwen2", out / "init", seed=args.seed, tokenizer=tokenizer, init_std=0.02, dtype=getattr(torch, shape["dtype"]),
        max_position_embeddings=2048, tie_word_embeddings=True, **shape["model"])
    # A random last value scores one answer in max_value + 1: a warm-up at that level has not learned the chain.
    chance = 1 / (shape["max_value"] + 1)
    # A flawed demonstrator caps what imitation reaches: the warm-up runs its steps and ends on that plateau.
    stop_at = args.stop_at if args.stop_at is not None or shape["flaw_rate"] else max(0.15, chance + 0.10)
    sft = {**shape["sft"], "eval_every": args.eval_every or shape["sft"]["eval_every"]}
    settings = SFTSettings(model_path=str(init), out_dir=str(out / "warm"), params_dtype=shape["dtype"],
                           reward_fn=REWARD_FN, stop_at_accuracy=stop_at, max_seconds=args.warmup_seconds,
                           seed=args.seed, **sft)
    examples = [sft_example(tokenizer, r) for r in train + short]
    # The warm-up's accuracy on the first SFT_EVAL_ROWS held-out prompts (each evaluation generates them all).
    report = launch(run_sft, 1, settings, examples, val[:SFT_EVAL_ROWS], timeout_s=3600)[0]
    paths = write_task(out, settings.out_dir, train, val)
    with safe_open(Path(paths["model"]) / "model.safetensors", "pt") as f:
        n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (a safe_open handle, not a dict)
    report.update(params=n_params, mean_response_chars=statistics.mean(len(r["extra_info"]["solution"]) for r in val))
    print(f"[learn] warm-up: {report['steps']} steps in {report['seconds']:.0f} s, held-out greedy accuracy "
          f"{report['curve'][-1]['val_acc']:.3f}; task written to {out}", flush=True)
    return {**paths, "warmup": report}


def plot_warmups(curves: dict[str, list[dict[str, float]]], out: Path, title: str) -> None:
    """Held-out greedy accuracy and training loss per warm-up step, a line per warm-up."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=120, layout="constrained")
    accuracy, loss = fig.subplots(1, 2)
    for name, curve in curves.items():
        steps = [point["step"] for point in curve]
        accuracy.plot(steps, [point["val_acc"] for point in curve], marker=".", label=name)
        loss.plot(steps, [point["loss"] for point in curve], marker=".", label=name)
    accuracy.set_title("held-out greedy accuracy")
    loss.set_title("training loss (response tokens)")
    loss.set_yscale("log")
    for ax in (accuracy, loss):
        ax.set_xlabel("warm-up step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(out, format="png")


def grpo_overrides(args: argparse.Namespace, shape: dict[str, Any], task: dict[str, str], run: Run, out: Path,
                   resumes: bool) -> list[str]:
    g, label = shape["grpo"], run.label
    return [
        f"model.path={task['model']}", f"data.train_files=[{task['train']}]", f"data.val_files=[{task['val']}]",
        "data.max_prompt_length=160", f"data.max_response_length={g['response']}",
        f"data.train_batch_size={g['batch']}", f"rollout.n={g['n']}", f"rollout.temperature={run.temperature}",
        *([f"rollout.gpu_memory_utilization={g['memory']}"] if g["memory"] else []),
        *([f"+rollout.engine_kwargs.kv_cache_memory_bytes={g['kv_gib'] * 2**30}"] if g.get("kv_gib") else []),
        f"actor.megatron.params_dtype={shape['dtype']}", "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_gpu={g['micro_tokens']}", f"actor.ppo_mini_batch_size={g['mini']}",
        f"actor.optim.lr={run.lr}", "actor.optim.weight_decay=0.0", "actor.optim.lr_warmup_steps=0",
        "algorithm.adv_estimator=grpo", f"reward.reward_fn='{REWARD_FN}'",
        "trainer.total_training_steps=100000", f"trainer.time_limit_s={run.seconds}",
        f"trainer.test_freq={args.test_freq}",
        # Only the step that crosses the time limit saves, so a later call with the same --out goes on from it
        # (a device lease caps one call's minutes); the resumed run does not measure its start again.
        f"trainer.val_before_train={not resumes}", "trainer.save_freq=1000000", "trainer.max_checkpoints_to_keep=1",
        f"trainer.seed={run.seed}",
        f"trainer.experiment_name={label}", f"trainer.default_local_dir={out / label}",
        "trainer.logger=[console,jsonl]", "trainer.rollout_dump_per_step=2",
        # CUTLASS: DeepGEMM compiles its kernels at an engine's first start on a machine (316 s against BF16's
        # 106 s on the seventeenth lease's fresh H100, docs/fp8.md), which a device call cannot spare.
        *(["rollout.quantization=fp8", "rollout.fp8_gemm=cutlass", "algorithm.rollout_correction.rollout_is=token"]
          if run.fp8 else []),
        *args.overrides,
    ]


def run_grpo(args: argparse.Namespace, shape: dict[str, Any], task: dict[str, str], run: Run,
             out: Path) -> dict[str, Any]:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import train
    from mrl.trainer.checkpointing import latest_checkpoint

    label = run.label
    resumes = latest_checkpoint(str(out / label)) is not None
    if not resumes:
        (out / label / "metrics.jsonl").unlink(missing_ok=True)
    cfg = load_config("tiny/grpo", grpo_overrides(args, shape, task, run, out, resumes))
    print(f"\n[learn] === {label}: lr {run.lr}, T {run.temperature}, B={cfg.data.train_batch_size} x "
          f"n={cfg.rollout.n}, {cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size} updates per step, "
          f"{run.seconds:.0f} s", flush=True)
    _, startup = train(cfg)
    # The run folder's metrics.jsonl holds every call's steps when a run was resumed.
    lines = (out / label / "metrics.jsonl").read_text().splitlines()
    result = summarize([json.loads(line) for line in lines], startup)
    (out / label / "run_summary.json").write_text(json.dumps(result, indent=1))
    return result


def summarize(history: list[dict[str, Any]], startup: float) -> dict[str, Any]:
    steps = [h for h in history if "timing_s/step" in h]
    step_s = [h["timing_s/step"] for h in steps]
    train_s = sum(step_s)
    curve = [(h["step"], h["val/greedy_acc"]) for h in history if "val/greedy_acc" in h]
    later = step_s[1:] or step_s

    def mean(key: str) -> float:
        values = [h[key] for h in steps if key in h]
        return statistics.mean(values) if values else float("nan")

    return {
        "val_greedy_acc": curve, "startup_s": round(startup, 1), "steps": len(steps), "train_s": round(train_s, 1),
        "steps_per_hour": 3600 / statistics.mean(later) if later else float("nan"),
        "tokens_per_s": mean("perf/tokens_per_s_per_gpu"), "response_length_mean": mean("response_length/mean"),
        "logprob_mismatch_max": max((h.get("rollout/logprob_mismatch", float("nan")) for h in steps), default=None),
        "grad_norm_max": max((h.get("actor/grad_norm", float("nan")) for h in steps), default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.1b", choices=sorted(SHAPES))
    parser.add_argument("--out", default="runs/learn", help="folder for the task, the runs and the summary")
    parser.add_argument("--write-task", metavar="DIR", help="only warm up and write the task into DIR")
    parser.add_argument("--task", help="a folder --write-task (or the warmup stage) wrote: skip the warm-up")
    parser.add_argument("--stages", nargs="+", default=["warmup", "grpo", "control"],
                        choices=["warmup", "grpo", "control"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stop-at", type=float, default=None,
                        help="warm-up: stop once held-out accuracy >= this (default: the larger of 0.15 and the "
                             "chance level, one answer in max_value + 1, plus 0.10)")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="end the warm-up at its first evaluation after this many seconds (default: its steps)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="warm-up steps between held-out evaluations (default: the shape's; each costs a few "
                             "seconds of generation on the device)")
    parser.add_argument("--init", help="warm up from this HF folder (an earlier warm-up's) instead of random weights")
    parser.add_argument("--lr", type=float, default=None, help="GRPO learning rate (default: the shape's)")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature")
    parser.add_argument("--grpo-runs", nargs="+", metavar="SEED:T[:LR[:fp8]]",
                        help="several GRPO runs from the same checkpoint, each a seed, a rollout temperature, "
                             "optionally a learning rate (empty: the shape's or --lr's) and `fp8` (FP8 rollout with "
                             "token TIS; e.g. 1:1:5e-6:fp8 beside 1:1:5e-6) (default: --seed:--temperature)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="the RL runs at once, each in its own process on the same device")
    parser.add_argument("--plot-warmups", nargs="+", metavar="PATH",
                        help="only plot: PNG then summary.json files, one warm-up curve each")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one run's label: a --side-by-side child
    parser.add_argument("--grpo-seconds", type=float, default=300.0)
    parser.add_argument("--control-seconds", type=float, default=120.0)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--num-cpus", type=int, default=16)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (key=value)")
    args = parser.parse_args()
    if args.plot_warmups:
        png, *summaries = args.plot_warmups
        plot_warmups({Path(f).stem: json.loads(Path(f).read_text())["warmup"]["curve"] for f in summaries}, Path(png),
                     title=f"arithmetic chain, {args.shape}: supervised warm-up")
        return
    shape = SHAPES[args.shape]
    if args.write_task:
        args.out, args.stages = args.write_task, ["warmup"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.setdefault("runs", {})
    if "warmup" in args.stages:
        task = warmup(args, shape, out / "task")
        summary["warmup"] = task.pop("warmup")
        plot_warmups({f"seed {args.seed}": summary["warmup"]["curve"]}, out / "warmup.png",
                     title=f"arithmetic chain, {args.shape}: supervised warm-up")
    else:
        folder = Path(args.task or out / "task")
        task = {"model": str(folder / "model"), "train": str(folder / "train.parquet"),
                "val": str(folder / "val.parquet")}
    summary_path.write_text(json.dumps(summary, indent=1))
    runs = planned_runs(args, shape)
    if args.side_by_side and len(runs) > 1:
        # CPU engines size their KV cache from VLLM_CPU_KVCACHE_SPACE, without profiling: no stagger needed
        side_by_side(runs, out, Path(task["model"]).parent, STAGGER_S if shape["grpo"]["memory"] else 0.0)
    elif runs:
        from mrl.trainer.main import init_ray

        init_ray(num_cpus=args.num_cpus)
        for run in runs:
            run_grpo(args, shape, task, run, out)
    for run in runs:
        run_file, metrics = out / run.label / "run_summary.json", out / run.label / "metrics.jsonl"
        if run_file.exists():
            summary["runs"][run.label] = json.loads(run_file.read_text())
        elif metrics.exists():  # the run stopped early: its steps still count, marked as such
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            summary["runs"][run.label] = {**summarize(records, float("nan")), "stopped_early": True}
        else:
            continue
        curve = summary["runs"][run.label]["val_greedy_acc"]
        if not curve:
            continue
        print(f"[learn] {run.label}: held-out greedy accuracy {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
              f"({100 * (curve[-1][1] - curve[0][1]):+.1f} points) in {summary['runs'][run.label]['train_s']:.0f} s",
              flush=True)
    if args.only:  # a side-by-side child: its parent writes the summary and the plot
        return
    summary_path.write_text(json.dumps(summary, indent=1))
    done = [out / label for label in summary["runs"] if (out / label / "metrics.jsonl").exists()]
    if done:
        from mrl.tools.report import load_records, render_comparison

        render_comparison({d.name: load_records(d / "metrics.jsonl") for d in done}, out / "learn.png",
                          title=f"arithmetic chain, {args.shape}: GRPO vs lr-0 control")
    print(f"[learn] summary: {summary_path}", flush=True)


if __name__ == "__main__":
    main()
