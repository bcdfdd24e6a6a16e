"""Start-up rules of the parallel layout: Megatron's TP / PP / VPP / CP / EP over the trainer's devices, the engine
knobs that depend on it, and every parallel size against the model's shape (heads, key-value heads, vocabulary,
layers per stage, routed experts) for the trainer's roles and the rollout engines. Registered with `@rule`.
"""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.model_shape import layout_shape_problems, num_experts
from mrl.config.startup.validate import (
    ENGINE_ROLES,
    PARALLEL_SIZES,
    Violation,
    _get,
    _one_of,
    hf_config,
    rule,
    trainer_world_size,
)

DTYPES = ("float32", "bfloat16", "float16")
RECOMPUTE = (None, "full", "selective")


@rule
def _megatron_layout(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    world = trainer_world_size(cfg)
    for role in ENGINE_ROLES:
        m = f"{role}.megatron"
        tp, pp, cp, ep = (_get(cfg, f"{m}.{key}") for key in PARALLEL_SIZES)
        if min(tp, pp, cp, ep) < 1 or world < 1:
            continue  # reported by _positive_sizes
        if world % (tp * pp * cp):
            yield Violation(f"{m}.tensor_model_parallel_size", tp,
                            f"TP×PP×CP = {tp}×{pp}×{cp} must divide the trainer's devices "
                            f"(resources.nnodes × resources.n_gpus_per_node = {world})")
        etp = _get(cfg, f"{m}.expert_tensor_parallel_size") or tp
        tp_named = world % (tp * pp * cp) and _get(cfg, f"{m}.expert_tensor_parallel_size") is None
        if (world // pp) % (ep * etp) and not tp_named:  # an ETP inherited from a bad TP is that TP's line
            yield Violation(f"{m}.expert_model_parallel_size", ep,
                            f"EP×ETP = {ep}×{etp} must divide the devices of one pipeline stage ({world // pp})")
        vpp = _get(cfg, f"{m}.virtual_pipeline_model_parallel_size")
        if vpp is not None and vpp > 1 and pp == 1:
            yield Violation(f"{m}.virtual_pipeline_model_parallel_size", vpp,
                            "virtual pipeline stages need pipeline_model_parallel_size > 1")


@rule
def _engine_knobs(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    for role in ENGINE_ROLES:
        m = f"{role}.megatron"
        yield from _one_of(cfg, f"{m}.params_dtype", DTYPES)
        yield from _one_of(cfg, f"{m}.recompute_granularity", RECOMPUTE)
        if _get(cfg, f"{m}.sequence_parallel") and _get(cfg, f"{m}.tensor_model_parallel_size") == 1:
            yield Violation(f"{m}.sequence_parallel", True, "sequence parallel splits activations over TP ranks: "
                                                            "it needs tensor_model_parallel_size > 1")
    kl = _get(cfg, "actor.use_kl_loss") or _get(cfg, "algorithm.use_kl_in_reward")
    colocated = any(m.placement == "colocated" and m.kind == "discriminative" for m in _get(cfg, "reward.models") or [])
    teacher = _get(cfg, "algorithm.distill.enable") and _get(cfg, "algorithm.distill.placement") == "colocated"
    if (kl and not _get(cfg, "actor.lora.enable")) or teacher or colocated:
        # The reference engine, the distillation teacher and colocated reward models (on ref.megatron) live in the
        # actor's processes, and Megatron's parallel state is per process. (LoRA builds no reference: the actor
        # with its adapters off.)
        for key in (*PARALLEL_SIZES, "virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
            ref, actor = _get(cfg, f"ref.megatron.{key}"), _get(cfg, f"actor.megatron.{key}")
            if ref != actor:
                yield Violation(f"ref.megatron.{key}", ref, f"the reference policy (and a distillation teacher, a "
                                                           f"colocated reward model) shares the actor's processes "
                                                           f"and parallel layout: set it to the actor's ({actor})")
    if not _get(cfg, "actor.use_dynamic_bsz"):
        micro = _get(cfg, "actor.ppo_micro_batch_size_per_gpu")
        if micro is None or micro < 1:
            yield Violation("actor.ppo_micro_batch_size_per_gpu", micro,
                            "must be >= 1 when actor.use_dynamic_bsz is false (micro-batches by sample count)")
    else:
        budget, longest = (_get(cfg, "actor.ppo_max_token_len_per_gpu"),
                           _get(cfg, "data.max_prompt_length") + _get(cfg, "data.max_response_length"))
        if budget < longest:
            yield Violation("actor.ppo_max_token_len_per_gpu", budget,
                            f"a micro-batch budget must hold the longest sample (data.max_prompt_length + "
                            f"data.max_response_length = {longest} tokens)")


@rule
def _model_shape(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    hf = hf_config(cfg, check_paths)
    if hf is None:
        return
    if _get(cfg, "model.bridge_backend") == "mrl":
        from bridges.registry import architectures

        arch = (hf.get("architectures") or [None])[0]
        if arch not in architectures():
            yield Violation("model.path", _get(cfg, "model.path"), f"its architecture {arch!r} has no bridge; "
                                                                    f"known: {', '.join(architectures())}")
    for role in ENGINE_ROLES:
        yield from role_shape_violations(cfg, role, hf)
    engine_tps = ["rollout.tensor_model_parallel_size"]
    if _get(cfg, "rollout.pd.enabled"):
        engine_tps += ["rollout.pd.prefill_tp", "rollout.pd.decode_tp"]
    for setting in engine_tps:
        yield from _engine_tp(setting, _get(cfg, setting), hf)
    context = hf.get("max_position_embeddings")
    longest = _get(cfg, "data.max_prompt_length") + _get(cfg, "data.max_response_length")
    if context and longest > context:
        yield Violation("data.max_response_length", _get(cfg, "data.max_response_length"),
                        f"max_prompt_length + max_response_length = {longest} exceeds the model's context "
                        f"(max_position_embeddings = {context})")


def role_shape_violations(cfg: DictConfig, role: str, hf: dict, whose: str = "") -> Iterator[Violation]:
    """`role.megatron`'s layout against an HF config (`hf`: the policy's, or with `whose` naming it another model
    the role's engine loads, e.g. the distillation teacher on ref.megatron)."""
    m = f"{role}.megatron"
    tp, pp, vpp, ep = (_get(cfg, f"{m}.{k}") for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                       "virtual_pipeline_model_parallel_size",
                                                       "expert_model_parallel_size"))
    split = {k: _get(cfg, f"{m}.{k}") for k in ("num_layers_in_first_pipeline_stage",
                                               "num_layers_in_last_pipeline_stage")}
    split = {k: n for k, n in split.items() if n is not None and n >= 1}  # below 1: the field's own line
    if split and pp == 1:
        if not whose:  # the policy's pass already said so
            yield from (Violation(f"{m}.{k}", n, "an uneven pipeline split needs pipeline_model_parallel_size > 1")
                        for k, n in split.items())
        split = {}
    divisor = _get(cfg, f"{m}.make_vocab_size_divisible_by") or 1
    for knob, why in layout_shape_problems(hf, tp, pp, vpp, ep, split, vocab_divisor=divisor):
        yield Violation(f"{m}.{knob}", _get(cfg, f"{m}.{knob}"), f"{whose}{why}")
    if num_experts(hf) and tp > 1 and not _get(cfg, f"{m}.sequence_parallel"):
        yield Violation(f"{m}.sequence_parallel", False, f"{whose}Megatron needs sequence parallel for MoE with TP > 1")


def _engine_tp(setting: str, tp: int, hf: dict) -> Iterator[Violation]:
    """An inference engine's TP over the model's heads; with fewer key-value heads than ranks the engines
    replicate them (vLLM, SGLang), so TP must divide the KV heads or be a multiple of them."""
    heads = int(hf.get("num_attention_heads", 1))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if tp < 1:
        return
    if heads % tp:
        yield Violation(setting, tp, f"must divide the model's attention heads ({heads})")
    elif kv_heads % tp and tp % kv_heads:
        yield Violation(setting, tp, f"must divide the model's key-value heads ({kv_heads}) or be a multiple of them "
                                     "(each rank holds whole KV heads)")
