"""On one GPU, a shortened `tools/bench/learn_gpu.py` (0.1b shape, bf16, hybrid vLLM): GRPO from the warmed-up
arithmetic-chain checkpoint raises held-out greedy accuracy by at least MARGIN more than an lr-0 control from the
same checkpoint does, the control stays within CONTROL_BAND of its start, responses average at least 200 tokens, and
`logprob_mismatch` and the gradient norm stay finite.

The two runs go side by side (each its own process and Ray cluster, one device). MRL_LEARN_TASK names a task folder
the script wrote before (its warm-up is then skipped, e.g. in the same lease as the full run); MRL_LEARN_OUT keeps
the runs' files (default: a temporary folder)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
MARGIN = 0.15
CONTROL_BAND = 0.03


def test_grpo_learns_the_chain_task_beyond_its_lr0_control(tmp_path):
    out = Path(os.environ.get("MRL_LEARN_OUT", tmp_path))
    task = os.environ.get("MRL_LEARN_TASK")
    stages = ["grpo", "control"] if task else ["warmup", "grpo", "control"]
    cmd = [sys.executable, str(ROOT / "tools/bench/learn_gpu.py"), "--shape", "0.1b", "--out", str(out),
           "--seed", "2", "--grpo-seconds", "240", "--control-seconds", "120", "--side-by-side", "--stages", *stages,
           *(["--task", task] if task else [])]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    grpo, control = runs["grpo_seed2_t1"], runs["control_lr0_seed2"]

    def gain(run: dict) -> float:
        curve = run["val_greedy_acc"]
        return curve[-1][1] - curve[0][1]

    print(f"GRPO {grpo['val_greedy_acc']}, control {control['val_greedy_acc']}")
    assert abs(gain(control)) <= CONTROL_BAND, control["val_greedy_acc"]
    assert gain(grpo) - gain(control) >= MARGIN, (grpo["val_greedy_acc"], control["val_greedy_acc"])
    assert grpo["response_length_mean"] >= 200
    assert math.isfinite(grpo["logprob_mismatch_max"]) and math.isfinite(grpo["grad_norm_max"])
