"""Start-up rules of LoRA: actor.lora's ranges and targets, and adapter-only sync (what vLLM's LoRA support
serves). Registered with `@rule`.
"""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.engine_capabilities import VLLM_LORA_RANKS
from mrl.config.startup.validate import Violation, _get, _one_of, rule


@rule
def _lora(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """actor.lora's ranges and target names (mrl/engine/megatron/lora.py)."""
    from mrl.engine.megatron.lora import TARGETS

    if not _get(cfg, "actor.lora.enable"):
        return
    if _get(cfg, "actor.lora.rank") <= 0:
        yield Violation("actor.lora.rank", _get(cfg, "actor.lora.rank"), "the adapter rank must be > 0")
    if _get(cfg, "actor.lora.alpha") <= 0:
        yield Violation("actor.lora.alpha", _get(cfg, "actor.lora.alpha"), "alpha (scale alpha / rank) must be > 0")
    dropout = _get(cfg, "actor.lora.dropout")
    if not 0 <= dropout < 1:
        yield Violation("actor.lora.dropout", dropout, "dropout must be in [0, 1)")
    targets = list(_get(cfg, "actor.lora.target_modules"))
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown:
        yield Violation("actor.lora.target_modules", targets,
                        f"name one or more of {list(TARGETS)} (Megatron's layer names; expert layers are not adapted: "
                        f"the local spec's SequentialMLP experts have no LoRA wrapping yet)")
    if _get(cfg, "model.bridge_backend") != "mrl":
        yield Violation("model.bridge_backend", _get(cfg, "model.bridge_backend"),
                        "LoRA merges its adapters in mrl's bridge export: set model.bridge_backend=mrl")


@rule
def _lora_sync(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """actor.lora.sync=adapter: what vLLM's LoRA support serves (mrl/engine/megatron/lora_peft.py)."""
    from mrl.engine.megatron.lora_peft import SYNC_MODES

    yield from _one_of(cfg, "actor.lora.sync", SYNC_MODES)
    sync = _get(cfg, "actor.lora.sync")
    if sync != "adapter" or not _get(cfg, "actor.lora.enable"):
        return
    setting = "actor.lora.sync"
    if _get(cfg, "rollout.name") != "vllm":
        yield Violation(setting, sync, f"adapter-only sync loads a PEFT adapter through vLLM's LoRA support: needs "
                                       f"rollout.name=vllm (got {_get(cfg, 'rollout.name')}); use sync=merged")
    if _get(cfg, "actor.lora.rank") > max(VLLM_LORA_RANKS):
        yield Violation("actor.lora.rank", _get(cfg, "actor.lora.rank"),
                        f"vLLM serves LoRA ranks up to {max(VLLM_LORA_RANKS)}; use actor.lora.sync=merged")
    if _get(cfg, "rollout.pd.enabled"):
        yield Violation(setting, sync, "PD replicas are not given adapters (untested): use sync=merged")
    if _get(cfg, "rollout.data_parallel_size") != 1:
        yield Violation(setting, sync, "an engine with data parallelism is not given adapters (untested): set "
                                       "rollout.data_parallel_size=1 (more replicas instead) or sync=merged")
    if _get(cfg, "rollout.mode") == "hybrid" and _get(cfg, "rollout.sleep_level") == 2:
        yield Violation("rollout.sleep_level", 2, "adapter-only sync keeps the engine's base weights: a hybrid "
                                                  "replica must sleep at level 1 (level 2 discards them)")
    if max(_get(cfg, "resources.nnodes"), _get(cfg, "rollout.nnodes")) > 1:
        yield Violation(setting, sync, "the adapter folder (actor.lora.adapter_dir) is written on the trainer's "
                                       "node and read by every server: one node only; use sync=merged")
