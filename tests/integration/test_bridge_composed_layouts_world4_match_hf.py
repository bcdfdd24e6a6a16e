"""Composed layouts in a 4-process world (one launch): TP=2×PP=2 (dense and MoE), EP=2×PP=2 (DeepSeek-V3, with
DP=2) and TP=2×PP=2×VPP=2 reproduce HF logits within 1e-5 and export the HF tensors bit for bit on every rank.

Slow on a small CPU machine (four Megatron processes, about 80 s on 2 cores); the world-2 test covers each
dimension alone, this one their composition.
"""

from __future__ import annotations

import pytest
import torch
from test_bridge_families_match_hf_in_every_layout import _run_cases, _tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYOUTS = {"tp2_pp2": {"tp": 2, "pp": 2}, "ep2_pp2": {"ep": 2, "pp": 2}, "tp2_pp2_vpp2": {"tp": 2, "pp": 2, "vpp": 2}}
CASES = [("qwen2", "tp2_pp2"), ("qwen3_moe", "tp2_pp2"), ("deepseek_v3", "ep2_pp2"), ("llama4", "tp2_pp2_vpp2")]


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    from mrl.models.tiny import make_tiny_hf_model
    from mrl.utils.distributed import launch

    root = tmp_path_factory.mktemp("bridge_world4")
    folders = {f: str(make_tiny_hf_model(f, root / f)) for f in ("qwen2", "qwen3_moe", "deepseek_v3")}
    folders["llama4"] = str(make_tiny_hf_model("llama", root / "llama4", num_hidden_layers=4))
    per_rank = launch(_run_cases, 4, CASES, LAYOUTS, folders, None, {}, False, timeout_s=900)
    with torch.no_grad():
        reference = {
            f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(_tokens()).logits
            for f, p in folders.items()
        }
    return {"per_rank": per_rank, "reference": reference}


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_composed_layout_matches_hf_and_exports_exactly(world4, family, layout):
    produced = [r[(family, layout)]["logits"] for r in world4["per_rank"] if r[(family, layout)]["logits"] is not None]
    assert len(produced) == 2  # the last pipeline stage of each of the two TP ranks / DP replicas
    for logits in produced:
        assert (logits - world4["reference"][family]).abs().max().item() <= 1e-5
    for results in world4["per_rank"]:
        assert results[(family, layout)]["export"] == {"wrong": [], "missing": [], "extra": []}
        assert results[(family, layout)]["buckets"]["same_stream"]
