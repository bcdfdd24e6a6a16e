"""mrl's block-FP8 quantiser (mrl/weight_sync/fp8.py) produces the same e4m3 bytes and the same fp32 block scales as
vLLM's own (`vllm.utils.deep_gemm.per_block_cast_to_fp8`, what its block-FP8 method runs on a BF16 checkpoint), bit
for bit: on whole blocks and on shapes that are not multiples of 128 (partial edge blocks), in bf16, fp16 and fp32,
with an all-zero block (the 1e-4 amax floor), values below that floor, an outlier and ±0. The bytes times the
scales stay within e4m3's rounding of the weight."""

import pytest
import torch

from mrl.weight_sync.fp8 import BLOCK, FP8_DTYPE, dequantize, quantize

vllm_cast = pytest.importorskip("vllm.utils.deep_gemm").per_block_cast_to_fp8


def weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    rows, cols = shape
    w[: min(rows, BLOCK), : min(cols, BLOCK)] = 0.0  # an all-zero block: the amax floor gives it a scale
    if rows > BLOCK:
        w[BLOCK:, :3] = torch.randn(rows - BLOCK, 3, generator=g) * 1e-6  # below the floor: rounds to tiny bytes
        w[-1, -1] = 7.5  # an outlier sets its block's scale
    w[-1, 0] = -0.0
    return w.to(dtype)


SHAPES = [(256, 384), (300, 200), (129, 257), (1, 5), (128, 1000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_bytes_and_scales_equal_vllms(shape, dtype):
    w = weight(shape, dtype, seed=sum(shape))
    ours, ours_scale = quantize(w)
    theirs, theirs_scale = vllm_cast(w)
    assert ours.dtype == theirs.dtype == FP8_DTYPE and ours.shape == theirs.shape == w.shape
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert ours_scale.dtype == theirs_scale.dtype == torch.float32
    assert ours_scale.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    assert torch.equal(ours_scale.view(torch.int32), theirs_scale.view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantised_weight_is_within_e4m3_rounding(shape):
    w = weight(shape, torch.bfloat16, seed=1).float()
    q, scale = quantize(w)
    step = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); below its normal range steps are 2^-9 of the scale unit
    assert ((dequantize(q, scale) - w).abs() <= w.abs() / 16 + step * 2**-9).all()
