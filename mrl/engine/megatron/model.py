"""Build megatron-core GPTModel chunks (one per virtual pipeline stage) from a TransformerConfig.

The architecture comes from a bridge (`bridge.transformer_config(**runtime_config(...))` and
`bridge.model_kwargs()`); this module adds what depends on the machine and the layout: parallel sizes, dtypes,
the layer spec (TransformerEngine when importable, Megatron's local modules otherwise) and the fusion switches
that need CUDA kernels.

What runs on CPU with the local spec (megatron-core 0.19.2): dense GPT (GQA, QKV bias, QK-norm), MoE with
SequentialMLP experts (router softmax or sigmoid with expert bias and group-limited top-k, shared experts), and
multi-latent attention (MLASelfAttention with ColumnParallelLinear down/up projections and RMSNorm on the
q/kv latents), all with ordinary [batch, seq] inputs and a causal mask. Not without TransformerEngine: packed
(THD) sequences, context parallelism, TE's grouped-GEMM experts (TEGroupedMLP; the local spec's experts run grouped
GEMMs in bf16 through mrl/engine/megatron/grouped_experts.py instead) and MLA down-projection fusion.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mrl.engine.megatron.parallel import ParallelLayout


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


STAGE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def stage_fields(megatron: Any) -> dict[str, int]:
    """The uneven pipeline split of a MegatronConfig as TransformerConfig fields (those that are set)."""
    return {k: getattr(megatron, k) for k in STAGE_FIELDS if getattr(megatron, k, None) is not None}


def runtime_config(
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """TransformerConfig fields that depend on layout and machine, not on the architecture.

    Fusions that need CUDA kernels (or TE) are switched off without CUDA; dropout is off (RL recomputes
    log-probs, which must match the rollout's). `overrides` win over everything.
    """
    cuda = torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp if layout.etp is not None else layout.tp,
        sequence_parallel=sequence_parallel and layout.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=False,  # needs the fused_weight_gradient_mlp_cuda extension
        bias_activation_fusion=False,  # the fused SwiGLU path is only a speed-up; keep one code path
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,  # the local spec's fused softmax needs Megatron's CUDA extensions
        apply_rope_fusion=False,  # the fused RoPE path needs TE or apex
        persist_layer_norm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_grouped_gemm=False,  # local spec: SequentialMLP; TEGroupedMLP only with TE
        moe_token_dispatcher_type="alltoall",
        # With PP=2 a stage's previous and next stage are one peer. The batched p2p path posts both directions to
        # it in one group and NCCL (like gloo without tags) pairs sends with receives in posting order, so the
        # interleaved schedule would receive a gradient into an activation buffer of the same shape (a wrong loss
        # seen on two H200s). The unbatched path sends the two directions through two communicators.
        batch_p2p_comm=not (layout.pp == 2 and (layout.vpp or 1) > 1),
    )
    fields.update(overrides)
    return fields


def fusion_fields(architecture: Mapping[str, Any], enabled: bool) -> dict[str, Any]:
    """Fused-kernel switches that need neither TransformerEngine nor apex (`megatron.compile_fusions`): Megatron's
    torch.compile'd residual add (`bias_dropout_add_fused_train`) and, where the architecture is a SiLU-gated MLP,
    its torch.compile'd SwiGLU (`bias_swiglu_impl`: one kernel each way, saves only the fc1 output)."""
    if not enabled:
        return {}
    fields: dict[str, Any] = {"bias_dropout_fusion": True}
    if architecture.get("gated_linear_unit") and architecture.get("activation_func") is torch.nn.functional.silu:
        fields["bias_activation_fusion"] = True
    return fields


def build_sequence_parallel_norm(build: Callable[[], Any], config: Any) -> Any:
    """`build()` a torch norm of the local spec under sequence parallelism, which Megatron's `WrappedTorchNorm`
    refuses (MoE with TP > 1 requires SP): build it with SP masked, then tag its weights `sequence_parallel` so
    their gradients are all-reduced over TP, as TransformerEngine's norms are."""
    if not config.sequence_parallel:
        return build()
    object.__setattr__(config, "sequence_parallel", False)
    try:
        norm = build()
    finally:
        object.__setattr__(config, "sequence_parallel", True)
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


@functools.cache
def _local_mla_core_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        """Megatron's local (unfused) attention for MLA, whose key and value head sizes differ.

        MLASelfAttention passes k_channels/v_channels, which the local DotProductAttention (0.19.2) does not
        accept; its output width must be heads × v_head_dim instead of heads × kv_channels. The scores use the
        query/key tensors as given and the softmax scale MLA computes, so nothing else changes.
        """

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    return LocalMLACoreAttention


def layer_spec(config: Any, *, use_te: bool | None = None, vp_stage: int | None = None) -> Any:
    """The decoder block spec of this pipeline stage (dense/MoE per layer from `moe_layer_freq`, MLA or not)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    use_te = transformer_engine_available() if use_te is None else use_te
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )
    if config.multi_latent_attention and not use_te:
        mla_attention = _local_mla_core_attention()
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            if attention.core_attention is DotProductAttention:
                attention.core_attention = mla_attention
    if not use_te:
        _group_expert_gemms(spec)
    return spec


def _group_expert_gemms(spec: Any) -> None:
    """The local spec's SequentialMLP experts as GroupedGemmExperts (same parameters, grouped GEMMs in bf16)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mrl.engine.megatron.grouped_experts import GroupedGemmExperts

    for layer in spec.layer_specs:
        moe = getattr(getattr(layer.submodules, "mlp", None), "keywords", {}).get("submodules")
        experts = getattr(moe, "experts", None)
        if isinstance(experts, functools.partial) and experts.func is SequentialMLP:
            moe.experts = functools.partial(GroupedGemmExperts, *experts.args, **experts.keywords)


def build_model(
    config: Any,
    model_kwargs: dict[str, Any],
    *,
    use_te: bool | None = None,
    spec: Callable[[Any, int | None], Any] | None = None,
    vocab_divisor: int = 1,
) -> list[torch.nn.Module]:
    """GPTModel chunks of this rank: one per virtual stage (a single chunk without VPP), on the current device.

    Each chunk gets pre/post-processing (embedding, final norm and output layer) only where it is the
    first/last stage of the whole pipeline. The vocabulary is padded to a multiple of `vocab_divisor` × TP
    (Megatron's make_vocab_size_divisible_by): the bridge fills the padded rows with zeros and never exports them,
    log-probs put no mass on them.
    `spec(config, vp_stage)` replaces `layer_spec` (e.g. a spec with a different core-attention module).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from bridges.mapping import padded_vocab_size
    from mrl.engine.megatron import cpu_compat, rope

    cpu_compat.apply()
    rope.install()
    vocab = model_kwargs["vocab_size"]
    model_kwargs = {**model_kwargs, "vocab_size": padded_vocab_size(vocab, config.tensor_model_parallel_size,
                                                                    vocab_divisor)}
    vpp = config.virtual_pipeline_model_parallel_size
    stages = [None] if not vpp or vpp == 1 else list(range(vpp))
    chunks: list[torch.nn.Module] = []
    for vp_stage in stages:
        model = GPTModel(
            config=config,
            transformer_layer_spec=(
                spec(config, vp_stage) if spec is not None else layer_spec(config, use_te=use_te, vp_stage=vp_stage)
            ),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            **model_kwargs,
        )
        _cast_parameters(model, config.params_dtype)
        _dispatch_in_rank(model)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _dispatch_in_rank(model: torch.nn.Module) -> None:
    """MoE layers whose grouped experts all live on this rank take `InRankTokenDispatcher` (grouped_experts.py)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mrl.engine.megatron.grouped_experts import GroupedGemmExperts, InRankTokenDispatcher

    for module in model.modules():
        if (isinstance(module, MoELayer) and isinstance(module.experts, GroupedGemmExperts)
                and InRankTokenDispatcher.applies(module.token_dispatcher)):
            module.token_dispatcher.__class__ = InRankTokenDispatcher


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in the engine's dtype, as Megatron-LM's Float16Module casts its model. The local spec's
    torch norms are built in float32 whatever `params_dtype` says. Besides differing from the HF model (bf16
    norms), a parameter group mixing float32 and bf16 parameters breaks Megatron 0.19's distributed-optimizer
    checkpoint: its parameter-to-state index assumes one order, the optimizer's groups hold another (float32
    parameters first), and saving fails on a size mismatch. Buffers (RoPE frequencies) keep their dtype."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
