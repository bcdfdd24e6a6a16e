"""On one GPU in bf16: a packed row of documents through SdpaAttention (one variable-length flash-attention call)
gives the per-token losses and gradients of Megatron's stock local spec run on each document alone, within bf16
tolerance. The worker is the fp32 CPU test's (tests/integration/test_engine_sdpa_attention_loss_matches_local_spec.py).
"""

from __future__ import annotations

import os
import sys

import pytest

from mrl.utils.distributed import launch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from test_engine_sdpa_attention_loss_matches_local_spec import spec_losses

pytestmark = pytest.mark.gpu


def test_packed_documents_match_local_spec_per_document_bf16(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    path = str(
        make_tiny_hf_model(
            "qwen3",
            tmp_path / "m",
            tokenizer=False,
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            init_std=0.02,
        )
    )
    out = launch(spec_losses, 1, path, "bfloat16", [300, 1024, 1, 2048, 517], timeout_s=300)[0]
    local, ours = out["local"], out["ours"]
    diff = (ours["loss"] - local["loss"]).abs()
    rel_mean = float((ours["loss"].mean() - local["loss"].mean()).abs() / local["loss"].mean())
    grad_rel = {n: float((ours["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in local["grads"].items()}
    worst = max(grad_rel, key=grad_rel.get)
    print(
        f"per-token |Δloss| max {diff.max():.3e} mean {diff.mean():.3e}; mean loss rel {rel_mean:.3e}; "
        f"worst grad rel {grad_rel[worst]:.3e} ({worst})"
    )
    assert rel_mean < 2e-3
    assert float(diff.mean()) < 2e-2 and float(diff.max()) < 0.25
    assert grad_rel[worst] < 5e-2, (worst, grad_rel[worst])
