"""On CUDA: the fused block-FP8 kernel (mrl/weight_sync/fp8_fused.py, what a sync runs on the trainer's GPU) gives
the same e4m3 bytes and fp32 scales as the torch quantiser on the same device and on the CPU (which the CPU suite
checks against vLLM's own), bit for bit: whole and partial blocks, bf16/fp16/fp32, the 1e-4 amax floor, values
below it, an outlier, ±0, and a non-contiguous TP slice."""

from __future__ import annotations

import pytest
import torch

from mrl.weight_sync import fp8_fused
from mrl.weight_sync.fp8 import BLOCK, quantize, quantize_with_torch

pytestmark = pytest.mark.gpu


def weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    rows, cols = shape
    w[: min(rows, BLOCK), : min(cols, BLOCK)] = 0.0  # an all-zero block: the floor gives its scale
    if rows > BLOCK:
        w[BLOCK:, :3] = torch.randn(rows - BLOCK, 3, generator=g) * 1e-6  # below the floor
        w[-1, -1] = 7.5
    w[-1, 0] = -0.0
    return w.to(dtype).cuda()


def assert_same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert a[0].dtype == b[0].dtype and a[0].shape == b[0].shape and a[1].shape == b[1].shape
    assert torch.equal(a[0].cpu().view(torch.uint8), b[0].cpu().view(torch.uint8))
    assert torch.equal(a[1].cpu().view(torch.int32), b[1].cpu().view(torch.int32))


@pytest.fixture(scope="module", autouse=True)
def fused_runs_here():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not fp8_fused.available(torch.device("cuda", 0)):
        pytest.skip("no hardware e4m3 conversion (compute capability < 8.9) or no Triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 257), (1, 5), (1536, 8960), (8960, 1536)])
def test_fused_equals_torch_on_gpu_and_cpu(shape, dtype):
    w = weight(shape, dtype, seed=sum(shape))
    fused = quantize(w)
    assert_same_bits(fused, quantize_with_torch(w))
    assert_same_bits(fused, quantize_with_torch(w.cpu()))


def test_fused_takes_a_strided_tp_slice():
    w = weight((512, 1024), torch.bfloat16, seed=3)
    rows, cols = w[128:384], w[:, 256:768]  # a row slice is contiguous; a column slice is strided
    assert not cols.is_contiguous()
    assert_same_bits(quantize(rows), quantize_with_torch(rows.contiguous()))
    assert_same_bits(quantize(cols), quantize_with_torch(cols.contiguous()))
