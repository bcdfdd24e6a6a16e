"""What a vLLM engine's parameters must hold after loading an HF-named export: vLLM's Llama-family models keep
q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (their `stacked_params_mapping`), stacked along the
output dimension in that order, pad the vocabulary rows of embeddings to a multiple of 64, and hold every tensor
in the engine's dtype. With rollout.quantization=fp8 the export is the
quantised stream (mrl/weight_sync/fp8.py): e4m3 weights and their fp32 `weight_scale_inv` blocks, which vLLM's
block-FP8 layers keep as sent (fused like the weights: every fused part is whole 128-row blocks). Used to check,
bit for bit, that a weight sync delivered the export (tests/gpu, and the TP 2 trainer test on CPU)."""

from __future__ import annotations

from typing import Any

import torch

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def expected_engine_params(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors under vLLM's parameter names, fused where vLLM fuses them (TP 1)."""
    out = dict(hf)
    for fused, parts in STACKED.items():
        for name in [n for n in hf if f".{parts[0]}." in n]:
            names = [name.replace(f".{parts[0]}.", f".{part}.") for part in parts]
            out[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([hf[n] for n in names], dim=0)
            for n in names:
                del out[n]
    return out


def mismatched_params(engine: dict[str, torch.Tensor], hf: dict[str, torch.Tensor],
                      compared: list[str] | None = None) -> list[str]:
    """Names whose engine tensor differs in any bit from the export cast to the engine's dtype (vocabulary padding
    rows ignored), or that one side lacks (a tied lm_head is absent from both or present in both). Empty engine
    parameters are skipped on the CPU backend only: vLLM-CPU moves linear weights into oneDNN's packed handles.
    `compared` receives the names actually compared."""
    expected = expected_engine_params(hf)
    bad = sorted(set(engine) ^ set(expected))
    packed_on_cpu = {n for n, t in engine.items() if t.numel() == 0 and not torch.cuda.is_available()}
    for name in sorted(set(engine) & set(expected) - packed_on_cpu):
        if compared is not None:
            compared.append(name)
        got, want = engine[name], expected[name]
        if got.shape != want.shape and got.shape[1:] == want.shape[1:] and got.shape[0] >= want.shape[0]:
            got = got[: want.shape[0]]  # vocabulary rows padded for the engine's kernels
        if want.dtype != torch.float8_e4m3fn:  # FP8 bytes are stored as sent
            want = want.to(got.dtype)  # what the engine's loader stores (a copy into its parameter)
        if got.shape != want.shape or got.dtype != want.dtype or not same_bits(got, want):
            bad.append(name)
    return bad


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (torch.equal has no FP8 kernel for every case, and calls NaN unequal and -0 equal to 0)."""
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def hybrid_engine_mismatches(actor_rollout: Any, rollout: Any, compared: list[str] | None = None) -> list[str]:
    """Parameters of the first replica that differ in any bit from the hybrid actor's export. The actor's
    parameters are offloaded while the engine generates: they come back for the export and go again."""
    actor_rollout.onload()
    exported = actor_rollout.export_to_host()[0]
    actor_rollout.offload()
    return mismatched_params(rollout.read_weights()[0], exported, compared)
