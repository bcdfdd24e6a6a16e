"""HF ⇄ Megatron bridges: declarative mapping tables per model family, sharded import, HF-named export.

    bridge = bridge_from_hf(folder)                       # picks the family by config.architectures[0]
    config = bridge.transformer_config(**runtime_config(layout))
    chunks = build_model(config, bridge.model_kwargs())  # mrl.engine.megatron.model
    bridge.load_hf(chunks, folder)                         # each rank reads only its slices
    for name, tensor in bridge.export(chunks): ...         # HF names, full tensors, on every rank

See bridges/README.md for adding an architecture.
"""

from bridges.bridge import Bridge, UnmappedParametersError
from bridges.registry import architectures, bridge_for, bridge_from_hf, register, verify

__all__ = [
    "Bridge",
    "UnmappedParametersError",
    "architectures",
    "bridge_for",
    "bridge_from_hf",
    "register",
    "verify",
]
