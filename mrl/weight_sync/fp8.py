"""Blockwise FP8 weights for the rollout engine (rollout.quantization=fp8, docs/fp8.md): the layout vLLM loads for
DeepSeek-style block-FP8 checkpoints. Each linear weight [N, K] becomes float8_e4m3fn bytes of the same shape plus
`<name>_scale_inv`, one fp32 scale per 128×128 block ([ceil(N/128), ceil(K/128)]; edge blocks are partial), with
weight ≈ bytes × scale. Norms, embeddings, the output layer and MoE routers stay in the trainer's dtype.

The arithmetic is vLLM's own block quantiser's (`vllm.utils.deep_gemm.per_block_cast_to_fp8`, the one its online
block-FP8 method runs on a BF16 checkpoint), step for step, so the bytes and scales agree bit for bit
(tests/unit/test_fp8_blockwise_quantiser_matches_vllm_bit_for_bit.py): amax of |w| per block, floored at 1e-4,
scale = amax / 448, bytes = (w × (1 / scale)) cast to e4m3. The division is IEEE fp32 on every device: CUDA divides
a tensor by a Python number as a × (1 / b), a last-bit different scale for about half the blocks and 0.2% of
differing bytes (an H100 run found them between the trainer's GPU export and its CPU re-quantisation); dividing by
a 0-dim tensor makes CPU and GPU quantise alike, so the engine's start-up copy and every sync agree.

Scale formats (rollout.fp8_scale_format). `fp32`: any fp32 scale; the vllm adapter turns DeepGEMM's E8M0 scales
off (VLLM_USE_DEEP_GEMM_E8M0=0), because with them on (vLLM's default on Hopper and Blackwell) vLLM re-quantises
every block-FP8 weight it loads to power-of-two scales (`requant_weight_ue8m0_inplace`), and the engine would not
hold what was sent: an H100 run found every FP8 weight and scale changed after the first sync. `ue8m0`: scales
rounded up to powers of two, as vLLM's `per_block_cast_to_fp8(use_ue8m0=True)` does, then put in the form that
vLLM's re-quantisation leaves unchanged (`_ue8m0_fixed_point`), so the engine again holds the bytes as sent.

Used on both sides: the trainer quantises its export stream tensor by tensor on its own device as it is sent
(`quantized_stream`: no second full-precision copy of the model), and the vllm adapter writes the block-FP8 copy of
the model folder its engine starts from (`write_quantized_copy`). Imports torch and safetensors only (the package
rule: vLLM's worker processes import mrl.weight_sync).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from bridges.export import stream_tags
from mrl.weight_sync import fp8_fused

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
AMAX_FLOOR = 1e-4  # vLLM's floor: an all-zero block gets a finite scale
SCALE_SUFFIX = "_scale_inv"  # vLLM's Fp8LinearMethod registers the block scale as `weight_scale_inv`
QUANTIZATION_CONFIG = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}
# The HF weights of the layers vLLM builds as quantisable linear layers: attention and MLP projections (dense,
# per-expert and shared experts; DeepSeek's MLA projections). A router (`mlp.gate`, `shared_expert_gate`), the
# embeddings, the output layer and every 1-D tensor keep the trainer's dtype.
_LINEAR = re.compile(r"_proj(_with_mqa)?\.weight$")


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether `rollout.quantization=fp8` sends this HF tensor as block FP8."""
    return tensor.dim() == 2 and bool(_LINEAR.search(name))


def _fp8_max(like: torch.Tensor) -> torch.Tensor:
    """448 as a 0-dim tensor on `like`'s device, filled there: `new_tensor(448.0)` copies from the host, and a host to
    GPU copy waits for the device to finish its queue, once per quantised tensor of a sync."""
    return torch.full((), FP8_MAX, dtype=like.dtype, device=like.device)


def quantize(weight: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes of weight's shape, fp32 scales [ceil(N/128), ceil(K/128)]) of one 2-D weight, on its device;
    `ue8m0`: power-of-two scales (the `ue8m0` scale format above). On a CUDA device with hardware e4m3 conversion
    and fp32 scales, one fused kernel (mrl.weight_sync.fp8_fused), else `quantize_with_torch`: the same bits.
    """
    if not ue8m0 and fp8_fused.addressable(weight) and fp8_fused.available(weight.device):
        return fp8_fused.quantize(weight)  # the same bits in one kernel launch (its docstring)
    return quantize_with_torch(weight, ue8m0)


def quantize_with_torch(weight: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` in torch operations, on any device (the reference the fused kernel is checked against). Only a
    shape that is not a multiple of the block is padded (with zeros, which leave every block's amax as it is); the
    one full-size temporary is the fp32 product that is cast to e4m3."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    w = weight.detach()
    if (rows * BLOCK, cols * BLOCK) != (n, k):
        w = torch.nn.functional.pad(w, (0, cols * BLOCK - k, 0, rows * BLOCK - n))
    blocks = w.view(rows, BLOCK, cols, BLOCK)
    # max |w| per block in one reduction (no full-size |w| temporary); |w| and widening to fp32 are exact, so it
    # equals vLLM's `abs().float().amax()`.
    amax = torch.linalg.vector_norm(blocks, float("inf"), dim=(1, 3), keepdim=True, dtype=torch.float32)
    amax = amax.clamp(min=AMAX_FLOOR)
    scale = amax / _fp8_max(amax)  # not `/ FP8_MAX`: see the module's docstring
    if ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    q = (blocks * (1.0 / scale)).to(FP8_DTYPE)
    if ue8m0:
        q, scale = _ue8m0_fixed_point(q, scale)
    q = q.view(rows * BLOCK, cols * BLOCK)
    if q.shape != (n, k):
        q = q[:n, :k].contiguous()
    return q, scale.view(rows, cols)


def _ue8m0_fixed_point(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same block values in the form vLLM's UE8M0 re-quantisation keeps: that re-quantisation, once, step for
    step (dequantise, amax floored at 1e-4, scale rounded up to a power of two, cast). With power-of-two scales it
    changes a block only where the largest byte is exactly 224 (amax / s in (224, 232) rounds down to it: it picks
    s / 2 and doubles the bytes, exactly) or where the 1e-4 floor decides; its output is unchanged by a second pass.
    (Blocks [rows, 128, cols, 128].)"""
    values = q.float() * scale
    amax = values.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / _fp8_max(amax))))
    return (values * (1.0 / scale)).to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bytes × scale, block by block, in `dtype` (tests and read-back checks)."""
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return (q.float() * expanded).to(dtype)


def quantized_stream(stream: Iterable[tuple], ue8m0: bool = False, spent: dict[str, float] | None = None
                     ) -> Iterator[tuple]:
    """The export stream with each linear weight replaced by its e4m3 bytes, one tensor at a time (`ue8m0`:
    power-of-two scales), and its `<name>_scale_inv` after the last weight of the same module (q/k/v/o, gate/up/down
    of one layer or expert): the engine fuses q/k/v and gate/up into one parameter, and a receiver copies a run of
    weights that lie back to back in both the bucket and that parameter in one launch, which a scale between them
    would split. A TP slice (weight_sync.tp_slices) is quantised on its own, which equals the same rows of the whole
    tensor's quantisation when the slice is whole blocks along its cut (what vLLM requires of block-FP8 TP layouts);
    its scales travel as the same slice of the scale tensor. `spent["quantize_s"]` gathers the host seconds spent
    quantising (a sync's metrics split its stream's time with it)."""
    scales: list[tuple] = []  # the current module's, sent when it ends (each is a few hundred bytes)
    for name, tensor, *tags in stream:
        quantised = is_quantized(name, tensor)
        if scales and not (quantised and _module(name) == _module(scales[0][0])):
            yield from scales
            scales = []
        tp_slice, blocks = stream_tags(tags)
        if blocks and _LINEAR.search(name):
            raise ValueError(f"rollout.quantization=fp8: {name} arrived as row blocks (weight_sync.one_copy), which "
                             "are not quantised; one_copy is refused with fp8 at start-up")
        if not quantised:
            yield (name, tensor, *tags)
            continue
        if tp_slice is not None and tensor.shape[tp_slice.dim] % BLOCK:
            raise ValueError(f"rollout.quantization=fp8: {name}'s TP slice has {tensor.shape[tp_slice.dim]} rows "
                             f"along dim {tp_slice.dim}, not whole {BLOCK}-blocks; vLLM's block-FP8 layers need "
                             "them too (use an engine TP that divides the layer into 128-multiples)")
        start = time.perf_counter()
        q, scale = quantize(tensor, ue8m0)
        if spent is not None:
            spent["quantize_s"] = spent.get("quantize_s", 0.0) + time.perf_counter() - start
        yield (name, q, *tags)
        scales.append((name + SCALE_SUFFIX, scale, *tags))
    yield from scales


def _module(name: str) -> str:
    """`model.layers.3.self_attn` of `model.layers.3.self_attn.q_proj.weight` (or of its scale)."""
    return name.rsplit(".", 2)[0]


def write_quantized_copy(source: str, target: str, ue8m0: bool = False) -> str:
    """Write the block-FP8 copy of the HF folder `source` to `target`: its safetensors files with every linear
    weight quantised (the scales beside them; `ue8m0`: powers of two), config.json with `quantization_config`
    (QUANTIZATION_CONFIG, every 2-D weight kept in full precision listed in `ignored_layers`), every other file
    copied. Written beside
    `target` and renamed into place, so engines of one node may race to write the same copy; returns `target`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    weight_map: dict[str, str] = {}
    kept: set[str] = set()
    for file in sorted(os.listdir(source)):
        path = os.path.join(source, file)
        if file.endswith(".safetensors"):
            with safe_open(path, "pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
            out = dict(quantized_stream(tensors.items(), ue8m0))
            kept.update(n.removesuffix(".weight") for n, t in tensors.items()
                        if n.endswith(".weight") and t.dim() == 2 and not is_quantized(n, t))
            weight_map.update(dict.fromkeys(out, file))
            save_file(out, os.path.join(partial, file), metadata={"format": "pt"})
        elif file not in ("config.json", "model.safetensors.index.json") and os.path.isfile(path):
            shutil.copy2(path, partial)
    with open(os.path.join(source, "config.json")) as f:
        config: dict[str, Any] = json.load(f)
    # vLLM builds some of these as linear layers that the quantization config would otherwise cover (routers).
    config["quantization_config"] = {**QUANTIZATION_CONFIG, "ignored_layers": sorted(kept)}
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.isfile(os.path.join(source, "model.safetensors.index.json")):
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    try:
        os.rename(partial, target)
    except OSError:  # another engine of this node renamed its copy first
        shutil.rmtree(partial, ignore_errors=True)
    return target
