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


def _vllm_requant(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM holds after loading these bytes and scales with DeepGEMM's E8M0 on (in place, on copies)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    q, scale = q.clone(), scale.clone()
    requant_weight_ue8m0_inplace(q, scale, [BLOCK, BLOCK])
    return q, scale


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def edge_blocks_weight() -> torch.Tensor:
    """Blocks whose largest byte lands on exactly 224 under a power-of-two scale (amax / s in (224, 232)), one that
    the 1e-4 amax floor decides, and ordinary ones."""
    w = weight((256, 384), torch.float32, seed=3)
    w[:BLOCK, BLOCK:2 * BLOCK] *= 0.01
    w[0, BLOCK] = 228 * 2.0**-12  # s = 2^-12 (228 / 448 rounds up to 2^0 of it), the byte rounds to 224
    w[BLOCK:, 2 * BLOCK:] = torch.linspace(-3e-5, 3e-5, BLOCK * BLOCK).view(BLOCK, BLOCK)  # below the floor
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_ue8m0_scales_are_vllms_and_survive_its_requantisation_unchanged(shape):
    """rollout.fp8_scale_format=ue8m0: the scales are vLLM's power-of-two ones, the values are what vLLM's own UE8M0
    cast followed by its load-time re-quantisation hold, and re-quantising mrl's bytes changes no bit (the engine
    holds what was sent)."""
    for w in (weight(shape, torch.bfloat16, seed=sum(shape)), edge_blocks_weight()):
        ours, ours_scale = quantize(w, ue8m0=True)
        assert torch.equal(ours_scale, torch.pow(2.0, torch.log2(ours_scale).round()))  # powers of two
        held, held_scale = _vllm_requant(ours, ours_scale)
        assert same(held, ours) and same(held_scale, ours_scale)
        theirs, theirs_scale = _vllm_requant(*vllm_cast(w, use_ue8m0=True))
        assert same(ours, theirs) and same(ours_scale, theirs_scale)


def test_the_edge_block_is_one_vllm_would_change():
    """The edge case is real: vLLM's own UE8M0 cast leaves a block whose largest byte is 224, which its load-time
    re-quantisation rewrites (same values, half the scale), so sending vLLM's cast unchanged would not be held."""
    q, scale = vllm_cast(edge_blocks_weight(), use_ue8m0=True)
    held, held_scale = _vllm_requant(q, scale)
    assert not same(held_scale, scale)
    assert torch.equal(dequantize(held, held_scale), dequantize(q, scale))


def test_fp32_scales_are_what_vllm_rewrites_when_e8m0_is_on():
    """Why the fp32 format turns DeepGEMM's E8M0 off in the engine: with it on, vLLM re-quantises fp32-scale bytes
    and every block changes (what an H100 run saw: every FP8 weight and scale differed after the first sync)."""
    q, scale = quantize(weight((256, 384), torch.bfloat16, seed=5))
    held, held_scale = _vllm_requant(q, scale)
    assert not same(held_scale, scale) and not same(held, q)


class DivisorsSeen(torch.overrides.TorchFunctionMode):
    """Records the divisor of every true division run under it."""

    def __init__(self):
        super().__init__()
        self.divisors = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide):
            self.divisors.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_scales_divide_by_a_tensor_so_cuda_and_cpu_round_alike(ue8m0):
    """CUDA runs `tensor / python_number` as a × (1 / b): on an H100 that moved half the fp32 scales by one last
    bit and 0.2% of the bytes, against the same weights quantised on the CPU. A 0-dim tensor divisor is an IEEE
    division on both devices."""
    with DivisorsSeen() as seen:
        quantize(weight((256, 384), torch.bfloat16, seed=3), ue8m0=ue8m0)
    assert seen.divisors and all(isinstance(d, torch.Tensor) for d in seen.divisors), seen.divisors


def test_the_fused_kernel_is_used_only_where_it_runs_and_its_offsets_reach():
    """The fused Triton kernel (mrl/weight_sync/fp8_fused.py; tests/gpu checks its bits) never runs on the CPU, and
    never on a tensor whose rows × row stride passes its 32-bit offsets (a column slice spans its parent's rows)."""
    from mrl.weight_sync import fp8_fused

    assert not fp8_fused.available(torch.device("cpu"))
    wide = torch.empty(2**12, 2**19, dtype=FP8_DTYPE)  # 2^31 elements, 2 GiB
    assert fp8_fused.addressable(wide[:, :BLOCK]) is False and fp8_fused.addressable(wide[: 2**11, :BLOCK]) is True
    assert fp8_fused.addressable(torch.empty(256, 384).t())  # transposed: copied to rows first, n × k elements
