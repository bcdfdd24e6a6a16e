"""On CUDA (NCCL, world 1, local spec): bridge import gives HF logits, export gives the HF tensors bit for bit.

Covers the CUDA-only code paths the CPU suite cannot: parameters on the device, NCCL process groups, no CPU
compatibility layer. Families are run in one process, re-initialising parallel state between them.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def distributed():
    from mrl.engine.megatron.parallel import init_distributed, teardown
    from mrl.utils.distributed import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed(0, 1)
    yield
    teardown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_cuda_bridge_matches_hf(distributed, family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bridges import bridge_from_hf
    from mrl.engine.megatron.model import build_model, runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout, initialize_model_parallel
    from mrl.models.tiny import make_tiny_hf_model

    folder = make_tiny_hf_model(family, tmp_path / family)
    layout = ParallelLayout()
    initialize_model_parallel(layout)
    bridge = bridge_from_hf(folder)
    chunks = build_model(bridge.transformer_config(**runtime_config(layout)), bridge.model_kwargs())
    bridge.load_hf(chunks, folder)
    tokens = torch.randint(4, 512, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(16, device="cuda").unsqueeze(0).expand(2, -1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        chunks[0].eval()
        ours = chunks[0](tokens, positions, None)
        reference = hf(tokens).logits
    # TF32 may be on for matmuls on the GPU: a looser bound than the CPU's 1e-5, still far below a wrong mapping.
    assert (ours - reference).abs().max().item() < 1e-3
    on_disk = load_file(str(folder / "model.safetensors"))
    exported = {name: tensor.cpu() for name, tensor in bridge.export(chunks)}
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[n], on_disk[n]) for n in on_disk)
