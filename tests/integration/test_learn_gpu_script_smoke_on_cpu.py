"""`tools/bench/learn_gpu.py --shape smoke` on CPU (hf rollout, gloo): the supervised warm-up runs through the Megatron
engine, the task it writes is self-contained (an HF folder transformers loads, parquet files pandas reads in verl's
layout, a reward module that imports and scores without mrl), and a GRPO run and the lr-0 control from that
checkpoint, side by side in processes of their own and stopped by trainer.time_limit_s, each end on a validated step
and reach the summary and the comparison plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_learn_script_smoke_writes_a_self_contained_task_and_a_timed_grpo_run(tmp_path):
    out = tmp_path / "learn"
    # trainer.time_limit_s counts the validation before training, whose first generation (vLLM, when the smoke used
    # it) took over 4 s beside the other run on 2 cores: a control limited to 4 s then ended with no step.
    cmd = [sys.executable, str(ROOT / "tools/bench/learn_gpu.py"), "--shape", "smoke", "--out", str(out),
           "--stages", "warmup", "grpo", "control", "--side-by-side", "--grpo-seconds", "8", "--control-seconds", "8",
           "--test-freq", "100", "--num-cpus", "2",
           # The script's plumbing is under test, not the engine (vLLM's trainer path is the trainer tests'): the
           # hf rollout starts two side-by-side runs 20 s sooner on 2 cores (85 -> 65 s).
           "rollout.name=hf"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warmup"]["steps"] == 20 and len(summary["warmup"]["curve"]) == 2
    assert set(summary["runs"]) == {"grpo_seed1_t1", "control_lr0_seed1"}
    for run in summary["runs"].values():
        # test_freq 100 never comes up in a few steps: the step that crossed the time limit validated.
        assert run["steps"] >= 1 and run["val_greedy_acc"][-1][0] == run["steps"]
    assert (out / "learn.png").stat().st_size > 0

    task = out / "task"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(task / "model")
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    assert tokenizer.eos_token == "<|im_end|>"
    import pandas as pd

    val = pd.read_parquet(task / "val.parquet")
    row = val.iloc[0]
    assert row["data_source"] == "mrl/arith_chain" and row["prompt"][0]["role"] == "user"
    # The reward module alone, in a bare interpreter that cannot import mrl (-I: no cwd, no PYTHONPATH).
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import chain_reward as r; "
             "print(r.compute_score('mrl/arith_chain', sys.argv[2], sys.argv[3]), r.score('answer 1', '2'))")
    solution, truth = row["extra_info"]["solution"], row["reward_model"]["ground_truth"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    printed = subprocess.run([sys.executable, "-I", "-c", probe, str(task), solution, truth], env=env,
                             capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert printed == ["1.0", "0.0"]
