"""The block-FP8 quantiser of mrl.weight_sync.fp8 as one Triton kernel per tensor, for CUDA devices that convert to
e4m3 in hardware (compute capability 8.9 and up).

Why: the torch quantiser takes about seven kernel launches per tensor and writes a full-size fp32 temporary. Here
each program reads one 128×128 block once and writes its bytes and its scale: one launch, no temporary. On an H100
the 196 linear weights of a 7B model (13 GB) took 8.8 ms this way, 64.1 ms through torch, 9.1 ms to clone
(docs/fp8.md).

The arithmetic is the torch quantiser's, step for step, so the results are the same bits: amax of |w| in fp32,
floored at 1e-4, scale = amax / 448 and its reciprocal as IEEE round-to-nearest divisions (`div_rn`: Triton's `/` may
compile to an approximate division), the product in fp32, then the cast to e4m3 (round to nearest even; the
hardware's saturation only acts above 464, which a block's own scale never reaches). Edge blocks are masked with
zeros, which leave the amax as the torch quantiser's padding does.
tests/gpu/test_fp8_fused_quantiser_matches_torch_bit_for_bit.py checks it against the torch quantiser bit for bit on
the GPU (Triton's CPU interpreter rounds to e4m3 otherwise than the hardware, so there is no CPU test).

Triton is imported only here, lazily: the CPU machine may not have it, and vLLM's worker processes import
mrl.weight_sync.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 128
_FLOOR = 1e-4
_FP8_MAX = 448.0


@functools.cache
def _kernel() -> Any:  # the Triton JIT function
    import triton
    import triton.language as tl

    @triton.jit
    def block_quantize(w_ptr, q_ptr, s_ptr, n, k, w_row_stride, scale_cols,
                       FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row, col = tl.program_id(0), tl.program_id(1)
        rows = row * BLOCK + tl.arange(0, BLOCK)
        cols = col * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(w_ptr + rows[:, None] * w_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(w)), FLOOR)
        scale = tl.math.div_rn(amax, FP8_MAX)
        q = w * tl.math.div_rn(1.0, scale)
        tl.store(q_ptr + rows[:, None] * k + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * scale_cols + col, scale)

    return block_quantize


@functools.cache
def available(device: torch.device) -> bool:
    """Whether `device` runs the fused kernel: CUDA with a hardware e4m3 conversion, and Triton importable."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        _kernel()
    except ImportError:
        return False
    return True


def addressable(weight: torch.Tensor) -> bool:
    """Whether the kernel's 32-bit offsets reach every element of `weight` (rows × row stride: a column slice of a
    wider tensor spans more than its own elements)."""
    return weight.shape[0] * max(weight.stride(0), weight.shape[1]) < 2**31


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes of weight's shape, fp32 scales [ceil(N/128), ceil(K/128)]), as mrl.weight_sync.fp8.quantize with
    fp32 scales; `weight` is 2-D on a device where `available()`."""
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((rows, cols), dtype=torch.float32, device=weight.device)
    with torch.cuda.device(weight.device):
        _kernel()[(rows, cols)](weight.detach(), q, scale, n, k, weight.stride(0), cols,
                                FLOOR=_FLOOR, FP8_MAX=_FP8_MAX, BLOCK=BLOCK, num_warps=8)
    return q, scale
