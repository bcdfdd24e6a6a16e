"""Per-device memory estimate of a recipe: training engines (params, grads, optimizer, activations) and the
rollout engine's KV-cache budget. An estimate to catch layouts that cannot fit, not a profiler.

Training engine of one device, for the heaviest pipeline stage (the most layers of any stage under the uneven split
of num_layers_in_first/last_pipeline_stage, ceil(L/PP) without it, plus the embedding or output layer; both when
PP=1):
- params: dense parts / TP + routed experts / (EP × expert-TP), in `params_dtype`;
- grads: the same count in fp32 (the engine reduces gradients in fp32: `grad_reduce_in_fp32=True`);
- optimizer: Adam's two fp32 moments plus an fp32 master copy when params are 16-bit, i.e. 12 or 8 bytes per
  parameter, divided by the data-parallel size when `use_distributed_optimizer` (dense parameters by
  DP = world / (TP × PP × CP), experts by world / (EP × expert-TP × PP));
- activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", for
  16-bit activations): per layer and token h·(10 + 24/TP) bytes, or h·34/TP with sequence parallel; the
  5·heads·seq/h attention-score term is dropped because attention runs through SDPA/flash kernels; full
  recompute keeps only each layer's 2·h-byte input (/TP with SP). Tokens per micro-batch are
  `ppo_max_token_len_per_gpu` with dynamic batch size, else micro-batch × (prompt + response) length; 1F1B keeps
  up to PP micro-batches in flight on the first stage. MoE layers are counted like dense ones, and the chunked
  log-prob path keeps logits small, so neither is modelled further. fp32 activations count twice.
The reference engine (when a KL term is used) holds params only: the engine freezes a forward-only engine's
parameters before DDP, so it has no gradient buffer (tests/integration/test_reference_engine_holds_parameters_only.py);
the critic is a full training engine whose last stage holds a [hidden → 1] value head instead of the vocabulary
projection (mrl/engine/megatron/critic.py).

Rollout engine of one device: vLLM/SGLang take `gpu_memory_utilization` × device memory for weights, a
profiling reserve and the KV cache, so KV budget = util × device − weights / (TP × PP) − reserve (weights in bf16,
or with rollout.quantization=fp8 the linear weights in block FP8). A KV token costs
2 (K and V) × layers/PP × max(1, kv_heads/TP) × head_dim × 2 bytes (1 with an FP8 KV cache; MLA: the latent +
rope key, not split over TP).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from omegaconf import DictConfig

from mrl.config.model_shape import ModelShape, stage_layers

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class EngineMemory:
    """One engine's bytes on one device."""

    role: str
    params: float
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass
class RolloutMemory:
    reserved: float  # gpu_memory_utilization × device
    weights: float
    overhead: float
    kv_cache: float  # may be negative: the configuration cannot start
    kv_bytes_per_token: float
    kv_tokens: int
    sequences_in_kv: int  # full (prompt + response) sequences the KV cache of one replica holds at once


@dataclass
class MemoryEstimate:
    device_bytes: float
    training: list[EngineMemory] = field(default_factory=list)
    rollout: RolloutMemory | None = None

    @property
    def training_total(self) -> float:
        return sum(e.total for e in self.training)


def heaviest_stage_layers(shape: ModelShape, m: DictConfig) -> int:
    """Layers of the pipeline stage that holds the most (the uneven split where one is set)."""
    pp = m.pipeline_model_parallel_size
    first, last = m.get("num_layers_in_first_pipeline_stage"), m.get("num_layers_in_last_pipeline_stage")
    if first is None and last is None:
        return math.ceil(shape.num_layers / pp)
    return max(stage_layers(shape.num_layers, pp, first, last))


def _stage_params(shape: ModelShape, tp: int, pp: int, ep: int, etp: int, layers: int) -> tuple[float, float]:
    """(dense, expert) parameters of one device on the heaviest pipeline stage (`layers` layers)."""
    layer_share = layers / shape.num_layers
    ends = shape.embedding_params + shape.output_params if pp == 1 else max(shape.embedding_params, shape.output_params)
    dense = (shape.layer_dense_params * layer_share + ends) / tp
    expert = shape.layer_expert_params * layer_share / (ep * etp)
    return dense, expert


def _sizes(m: DictConfig, world: int) -> tuple[int, int, int, int, int, int, int]:
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    dp = max(world // (tp * pp * cp), 1)
    edp = max(world // (ep * etp * pp), 1)
    return tp, pp, cp, ep, etp, dp, edp


def engine_memory(role: str, shape: ModelShape, m: DictConfig, world: int, *, train: bool,
                  micro_tokens: int) -> EngineMemory:
    tp, pp, cp, ep, etp, dp, edp = _sizes(m, world)
    layers = heaviest_stage_layers(shape, m)
    dense, expert = _stage_params(shape, tp, pp, ep, etp, layers)
    p_bytes = DTYPE_BYTES.get(m.params_dtype, 4)
    out = EngineMemory(role, params=(dense + expert) * p_bytes)
    if not train:
        return out
    out.grads = (dense + expert) * 4
    opt_bytes = 8 + (4 if p_bytes < 4 else 0)
    shard = (dp, edp) if m.use_distributed_optimizer else (1, 1)
    out.optimizer = opt_bytes * (dense / shard[0] + expert / shard[1])
    h, sp = shape.hidden_size, m.sequence_parallel and tp > 1
    tokens = micro_tokens / cp
    if m.recompute_granularity == "full":
        per_layer = 2 * tokens * h / (tp if sp else 1)
    else:
        per_layer = tokens * h * (34 / tp if sp else 10 + 24 / tp)
    in_flight_layers = layers * pp
    out.activations = per_layer * in_flight_layers * (p_bytes / 2)
    return out


def rollout_memory(shape: ModelShape, cfg: DictConfig, device_bytes: float, overhead_bytes: float) -> RolloutMemory:
    r = cfg.rollout
    tp, pp = r.tensor_model_parallel_size, r.pipeline_model_parallel_size
    reserved = r.gpu_memory_utilization * device_bytes
    weights = shape.export_bytes(r.quantization) / (tp * pp)  # what the engine holds: bf16, or block FP8
    kv = reserved - weights - overhead_bytes
    heads_share = 1.0 if shape.kv_heads == 0 else max(1, shape.kv_heads / tp) / shape.kv_heads
    per_token = shape.kv_bytes_per_token * heads_share / pp * kv_cache_element_bytes(r) / 2
    tokens = max(int(kv // per_token), 0)
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    return RolloutMemory(reserved, weights, overhead_bytes, kv, per_token, tokens, tokens // seq_len)


def kv_cache_element_bytes(rollout: DictConfig) -> int:
    """Bytes of one cached K or V element: 1 with vLLM's FP8 KV cache (`rollout.engine_kwargs.kv_cache_dtype`: fp8,
    fp8_e4m3, fp8_e5m2, ...), else 2 (the model's bf16)."""
    dtype = str((rollout.engine_kwargs or {}).get("kv_cache_dtype", "auto"))
    return 1 if dtype.startswith("fp8") else 2


def micro_batch_tokens(cfg: DictConfig) -> int:
    a = cfg.actor
    if a.use_dynamic_bsz:
        return a.ppo_max_token_len_per_gpu
    return (a.ppo_micro_batch_size_per_gpu or 1) * (cfg.data.max_prompt_length + cfg.data.max_response_length)


def value_model_shape(shape: ModelShape) -> ModelShape:
    """`shape` under HF's one-label score head ([hidden → 1] and its bias) instead of the vocabulary projection:
    the critic, and a reward model (its classifier's folder counts a vocabulary projection it does not have)."""
    return dataclasses.replace(shape, output_params=shape.hidden_size + 1)


def estimate(cfg: DictConfig, shape: ModelShape, device_gib: float, rollout_overhead_gib: float,
             frozen: Mapping[str, ModelShape] | None = None) -> MemoryEstimate:
    """`frozen`: {role: shape} of the forward-only engines beside the reference in the actor's processes, on
    ref.megatron's layout (the distillation teacher, colocated reward models)."""
    world = cfg.resources.nnodes * cfg.resources.n_gpus_per_node
    tokens = micro_batch_tokens(cfg)
    est = MemoryEstimate(device_bytes=device_gib * GiB)
    est.training.append(engine_memory("actor", shape, cfg.actor.megatron, world, train=True, micro_tokens=tokens))
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        est.training.append(engine_memory("ref", shape, cfg.ref.megatron, world, train=False, micro_tokens=tokens))
    for role, frozen_shape in (frozen or {}).items():
        est.training.append(engine_memory(role, frozen_shape, cfg.ref.megatron, world, train=False,
                                          micro_tokens=tokens))
    if cfg.critic.enable:
        est.training.append(engine_memory("critic", value_model_shape(shape), cfg.critic.megatron, world,
                                          train=True, micro_tokens=tokens))
    est.rollout = rollout_memory(shape, cfg, est.device_bytes, rollout_overhead_gib * GiB)
    return est
