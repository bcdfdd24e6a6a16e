"""Start-up rules on what the chosen backends can run as mrl drives them today: the rollout backends' sleep levels
and layouts, and the Megatron features that TransformerEngine layers do not support here yet. Each of these
used to fail late (at the first sleep, the first weight sync, or after Ray had started the workers).

Registered with `@rule` like those of validate.py, which imports this module.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from mrl.config.startup.validate import ENGINE_ROLES, Violation, rule

# Why a hybrid replica of these backends cannot sleep at level 1 (rollout_adapters/*/adapter.py `_sleep`).
NO_SLEEP_LEVEL_1 = {
    "sglang": "the sglang server is started without --enable-weights-cpu-backup, so level 1 (keep a host copy of "
              "the weights) is refused at the first sleep; use 2 (the weight sync after each step refills them)",
    "trtllm": "TensorRT-LLM's released weights come back with undefined content, so level 1 is refused at the "
              "first sleep; use 2 (the weight sync after each step refills them)",
}
# Backends whose replica server holds one device slot (mrl/rollout/replica.py): the engine's workers beyond the
# first are not placed on the replica's other slots, and the first weight sync to one of them fails
# (docs/rollout_backends.md, "Weight sync into SGLang and TensorRT-LLM"). sglang's PP is refused on its own.
ONE_SLOT_BACKENDS = {"sglang": ("tensor_model_parallel_size",),
                     "trtllm": ("tensor_model_parallel_size", "pipeline_model_parallel_size")}


def transformer_engine_importable() -> bool:
    """The engines build TransformerEngine layers whenever it is importable (mrl/engine/megatron/engine.py)."""
    return importlib.util.find_spec("transformer_engine") is not None


@rule
def _rollout_backends(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    r = cfg.rollout
    sleeps = r.mode == "hybrid" and r.free_cache_engine  # only then is rollout.sleep_level used
    if sleeps and r.sleep_level == 1 and r.name in NO_SLEEP_LEVEL_1:
        yield Violation("rollout.sleep_level", 1, f"rollout.name={r.name}: {NO_SLEEP_LEVEL_1[r.name]}")
    for key in ONE_SLOT_BACKENDS.get(r.name, ()) if not r.pd.enabled else ():
        if r[key] > 1:
            yield Violation(f"rollout.{key}", r[key],
                            f"a {r.name} replica's server holds one device slot, so its other workers are not "
                            "placed on the replica's devices (the first weight sync fails); keep 1 and scale with "
                            "more replicas")


@rule
def _transformer_engine(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    te = transformer_engine_importable()
    for role in ENGINE_ROLES:
        setting = f"{role}.megatron.context_parallel_size"
        cp = OmegaConf.select(cfg, setting)
        if cp is None or cp <= 1:
            continue
        if not te:
            yield Violation(setting, cp,
                            "context parallel needs TransformerEngine, which is not importable here; set it to 1")
        else:  # TE's attention could run it, but the rest of the engine is not built for it
            yield Violation(setting, cp, "context parallel is not built yet: packing does not split sequences "
                                         "across CP ranks and losses are scaled over DP ranks only; set it to 1")
    if OmegaConf.select(cfg, "actor.lora.enable") and te:
        yield Violation("actor.lora.enable", True,
                        "LoRA wraps megatron-core's local linear layers, and the engines build TransformerEngine "
                        "layers whenever it is importable (as it is here), which LoRA does not wrap yet: turn LoRA "
                        "off or run where transformer_engine is not installed")


# The rules on rollout.quantization (FP8 rollout) register themselves on import.
from mrl.config.startup import quantization_rules  # noqa: E402, F401
