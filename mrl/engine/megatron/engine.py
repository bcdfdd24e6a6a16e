"""MegatronEngine: BaseEngine on megatron-core (TP × PP(+VPP) × DP × EP/ETP, sequence parallel, distributed optimizer).

One step (`forward_backward` then `optimizer_step`) runs this DP rank's samples as packed THD micro-batches
(mrl/engine/megatron/packing.py) through Megatron's pipeline schedule (`get_forward_backward_func`), with the
output layer replaced by the chunked vocab-parallel log-prob computation (logprob.py) via GPTModel's
`output_processor` hook, so full-vocabulary logits never exist.

Loss scaling. The caller's loss_fn returns s_m, micro-batch m's share of the step loss under step-global
denominators (mrl/algo/aggregation.py), so the step loss is L = Σ_{DP ranks} Σ_m s_m. Megatron's schedule
backpropagates s_m · cp / M (M = this rank's number of micro-batches) and DDP averages gradients over the
dp·cp ranks; the engine hands the schedule s_m · M · dp, so the reduced gradient is exactly ∇L. Only the last
pipeline stage computes s_m; earlier stages receive its gradient through the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mrl.algo.aggregation import LossNormalizer, loss_counts
from mrl.config.schema import ActorConfig, LoRAConfig, MegatronConfig, OptimConfig
from mrl.engine.base import BaseEngine, LossFn
from mrl.engine.megatron import logprob
from mrl.engine.megatron.packing import (
    JaggedBatch,
    PackedMicroBatch,
    next_token_labels,
    pack,
    scatter_to_batch,
    shift_to_tokens,
    split_by_count,
    split_by_tokens,
)
from mrl.engine.megatron.parallel import ParallelLayout


class MegatronEngine(BaseEngine):
    """Actor/reference engine over an HF model folder; see the module docstring for the step and its scaling.

    Micro-batches: `max_tokens_per_micro_batch` (dynamic batch size, verl's ppo_max_token_len_per_gpu) packs
    samples under a token budget; otherwise `micro_batch_size` samples per micro-batch. `optim=None` makes a
    forward-only engine (reference policy) without optimizer state.
    """

    def __init__(
        self,
        model_path: str,
        megatron: MegatronConfig,
        optim: OptimConfig | None = None,
        *,
        micro_batch_size: int | None = 1,
        max_tokens_per_micro_batch: int | None = None,
        total_steps: int = 1,
        seed: int = 1234,
        bridge_backend: str = "mrl",
        lora: LoRAConfig | None = None,
        temperature: float = 1.0,
    ) -> None:
        if micro_batch_size is None and max_tokens_per_micro_batch is None:
            raise ValueError("set micro_batch_size or max_tokens_per_micro_batch")
        self.model_path = model_path
        self.cfg = megatron
        self.optim_cfg = optim
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        self.total_steps = total_steps
        self.seed = seed
        self.chunk_tokens = megatron.logprob_chunk_tokens
        # The sampling temperature: log-probs and entropy are of softmax(z / T), the distribution samples come from
        # (greedy rollouts, T = 0, are scored at T = 1 as vLLM does).
        self.temperature = temperature if temperature > 0 else 1.0
        # megatron.compile_fusions resolved (None: on CUDA): compiled SwiGLU, residual add, RMSNorm, log-prob kernels
        compile_fusions = megatron.compile_fusions
        self.compiled_kernels = torch.cuda.is_available() if compile_fusions is None else compile_fusions
        self.bridge_backend = bridge_backend
        self.layout = ParallelLayout(
            tp=megatron.tensor_model_parallel_size,
            pp=megatron.pipeline_model_parallel_size,
            vpp=megatron.virtual_pipeline_model_parallel_size,
            ep=megatron.expert_model_parallel_size,
            etp=megatron.expert_tensor_parallel_size,
            cp=megatron.context_parallel_size,
        )
        # MoE routing replay (actor.megatron.router_replay): routers replay a batch's `routed_experts` and report
        # their own top-k (mrl/engine/megatron/routing.py).
        self.trace_routing = megatron.router_replay != "none"
        self._replays: dict[int, list[tuple[int, Any]]] = {}
        self._traces: dict[int, list[dict[str, dict[int, Tensor]]]] = {}
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._offloaders: dict[str, Any] = {}
        # actor.lora when enabled: adapters on the frozen base (mrl/engine/megatron/lora.py)
        self.lora = lora if lora is not None and lora.enable else None
        self.adapters: list[Any] = []

    @classmethod
    def from_actor_config(
        cls, model_path: str, actor: ActorConfig, *, total_steps: int = 1, temperature: float = 1.0
    ) -> MegatronEngine:
        """The actor engine of a recipe: verl's micro-batch knobs select count or token-budget packing."""
        if actor.use_dynamic_bsz:
            micro = {"micro_batch_size": None, "max_tokens_per_micro_batch": actor.ppo_max_token_len_per_gpu}
        else:
            micro = {"micro_batch_size": actor.ppo_micro_batch_size_per_gpu or 1}
        return cls(model_path, actor.megatron, actor.optim, total_steps=total_steps, lora=actor.lora,
                   temperature=temperature, **micro)

    # ---- construction ---------------------------------------------------------------------------------------
    def initialize(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from transformers import AutoConfig

        from bridges.registry import bridge_for
        from mrl.engine.megatron.attention import compile_norms
        from mrl.engine.megatron.model import fusion_fields, runtime_config, stage_fields
        from mrl.engine.megatron.parallel import init_distributed, initialize_model_parallel

        init_distributed()
        initialize_model_parallel(self.layout, seed=self.seed)
        self.bridge = self._select_bridge(bridge_for(AutoConfig.from_pretrained(self.model_path),
                                                     backend=self.bridge_backend))
        dtype = getattr(torch, self.cfg.params_dtype)
        overrides = {
            **fusion_fields(self.bridge.config_fields(), self.compiled_kernels),
            **self._recompute_fields(),
            **({"moe_enable_routing_replay": True} if self.trace_routing else {}),
            **stage_fields(self.cfg),
            **self.cfg.override_transformer_config,
        }
        fields = runtime_config(
            self.layout, params_dtype=dtype, sequence_parallel=self.cfg.sequence_parallel, **overrides
        )
        self.tf_config = self.bridge.transformer_config(**fields)
        chunks = build_chunks(self.tf_config, self.bridge.model_kwargs(), self.cfg.make_vocab_size_divisible_by)
        compile_norms(chunks, self.compiled_kernels)
        self._prepare_chunks(chunks)
        self.bridge.load_hf(chunks, self.model_path)
        if self.lora is not None:
            from mrl.engine.megatron import lora

            # Before DDP and the optimizer: both skip requires_grad=False parameters (no grad buffer, no state).
            self.adapters = lora.apply(chunks, self.lora)
        if self.optim_cfg is None:
            # A forward-only engine (the reference) never runs a backward. DDP allocates its fp32 gradient buffer
            # for the parameters that require grad only, so frozen ones leave it empty (else ≈16 GB per GPU for an
            # 8B reference at TP 2); the schedule's forward_only path needs the DDP wrapper, not its buffers.
            for chunk in chunks:
                chunk.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer and self.optim_cfg is not None,
        )
        self.model = [
            DistributedDataParallel(self.tf_config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        if self.trace_routing:
            self._install_routing(chunks)
        if self.optim_cfg is not None:
            self._build_optimizer(dtype)

    def _install_routing(self, chunks: list[torch.nn.Module]) -> None:
        from mrl.engine.megatron import routing

        c = self.tf_config
        if not c.num_moe_experts:
            raise ValueError("actor.megatron.router_replay: the model has no MoE layers")
        self.moe_layers = routing.moe_layer_numbers(c.num_layers, c.moe_layer_freq)
        # Keyed by the DDP chunk the schedule hands forward_step.
        self._replays = {id(ddp): replays for ddp, replays in zip(self.model, routing.install(chunks, self.moe_layers))}

    def _select_bridge(self, bridge: Any) -> Any:
        """Hook: the bridge whose table builds and fills the chunks (the critic's drops the vocabulary head)."""
        return bridge

    def _prepare_chunks(self, chunks: list[torch.nn.Module]) -> None:
        """Hook between building the chunks and importing the weights (the critic swaps in its value head)."""

    def _recompute_fields(self) -> dict[str, Any]:
        if not self.cfg.recompute_granularity:
            return {}
        if self.cfg.recompute_granularity == "full":
            return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        return {"recompute_granularity": self.cfg.recompute_granularity}

    def _build_optimizer(self, dtype: torch.dtype) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim_cfg
        assert o is not None
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=1e-8,
                clip_grad=o.clip_grad,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                params_dtype=dtype,
                use_distributed_optimizer=self.cfg.use_distributed_optimizer,
            ),
            self.model,
        )
        steps = max(self.total_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=steps,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=steps,
            wd_incr_style="constant",
        )
        # What Megatron's training loop wires into the config: the schedule calls these after the last
        # micro-batch (DP reduction, embedding/SP/expert grad all-reduces) and to scale losses for fp16.
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.tf_config.grad_scale_func = self.optimizer.scale_loss
        self._zero_grads()

    # ---- micro-batches --------------------------------------------------------------------------------------
    def micro_batches(self, batch: JaggedBatch) -> list[PackedMicroBatch]:
        """This rank's packed micro-batches (identical on the TP/PP ranks of one DP group)."""
        pp, vpp = self.layout.pp, self.layout.vpp
        lengths = batch.lengths.tolist()
        min_mb = pp if pp > 1 else 1
        if self.max_tokens is not None:
            groups = split_by_tokens(lengths, self.max_tokens, min_micro_batches=min(min_mb, len(lengths)))
            if vpp and vpp > 1 and len(groups) % pp:
                # The interleaved schedule runs micro-batches in groups of PP; round the count up.
                groups = split_by_tokens(lengths, self.max_tokens, min_micro_batches=-(-len(groups) // pp) * pp)
        else:
            assert self.micro_batch_size is not None
            groups = split_by_count(lengths, self.micro_batch_size, multiple_of=pp if vpp and vpp > 1 else 1)
        multiple = self.layout.tp if self.tf_config.sequence_parallel else 1
        mbs = [pack(batch, g, pad_to_multiple=multiple) for g in groups]
        if pp > 1:
            # Stages exchange activations of one fixed shape per step: pad every row to the longest.
            length = max(mb.input_ids.shape[1] for mb in mbs)
            mbs = [pack(batch, g, pad_to_multiple=multiple, length=length) for g in groups]
        return mbs

    def _normalizer(self, mbs: list[PackedMicroBatch]) -> LossNormalizer:
        from megatron.core import parallel_state

        # Collectives run on the device: NCCL has no CPU tensors.
        counts = torch.zeros(2, dtype=torch.float64, device=_device())
        for mb in mbs:
            mask = mb.fields.get("response_mask", mb.token_mask)
            counts += loss_counts(mask).to(counts.device)
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        return LossNormalizer.from_counts(counts)

    # ---- the schedule ---------------------------------------------------------------------------------------
    def _run_schedule(self, mbs: list[PackedMicroBatch], loss_func: Any, forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mrl.engine.megatron.model import transformer_engine_available

        device = _device()
        mbs = [mb.to(device) for mb in mbs]
        host_offsets = not transformer_engine_available()

        self._traces = {key: [] for key in self._replays}

        def forward_step(data_iterator: Iterator[PackedMicroBatch], model: Any) -> tuple[Any, Any]:
            mb = next(data_iterator)
            replays = self._replays.get(id(model))
            if replays is not None:
                self._replay(replays, mb)
            output = model(
                mb.input_ids,
                mb.position_ids,
                None,
                packed_seq_params=mb.packed_seq_params(host_rope_offsets=host_offsets),
                output_processor=self._output_processor(),
                output_processor_context=self._processor_context(mb, model),
            )
            if replays is not None:
                from mrl.engine.megatron.routing import read_back

                self._traces[id(model)].append(read_back(replays))
            return output, partial(loss_func, mb)

        iterators = [iter(mbs) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=mbs[0].input_ids.shape[1],
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _replay(self, replays: list[tuple[int, Any]], mb: PackedMicroBatch) -> None:
        """Point this chunk's routers at the micro-batch's `routed_experts` (this rank's rows), if it has them."""
        from megatron.core import parallel_state as ps

        from mrl.engine.megatron import routing

        target = None
        if "routed_experts" in mb.fields:
            packed = routing.packed_routing(mb.fields, mb.token_mask, mb.input_ids.shape[1])
            target = routing.local_rows(packed, self.tf_config.sequence_parallel,
                                        ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        routing.set_targets(replays, target)

    def _gathered_routing(self, mbs: list[PackedMicroBatch], kind: str) -> list[Tensor]:
        """Per micro-batch, the [T, L, K] routing of kind 'own' or 'used' of its whole packed row: the chunks'
        layers merged, sequence-parallel slices gathered over TP, the stages' layers over PP (every rank)."""
        from megatron.core import parallel_state as ps

        from mrl.engine.megatron.routing import ROUTING_DTYPE

        out = []
        for m in range(len(mbs)):
            layers: dict[int, Tensor] = {}
            for traces in self._traces.values():
                layers.update(traces[m][kind])
            if self.tf_config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
                group = ps.get_tensor_model_parallel_group()
                for i, local in sorted(layers.items()):
                    # int64 on the device: gloo and NCCL both reduce it; int16 is only the storage dtype.
                    local = local.to(_device(), torch.int64)
                    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
                    dist.all_gather(parts, local, group=group)
                    layers[i] = torch.cat(parts).to("cpu", ROUTING_DTYPE)
            if ps.get_pipeline_model_parallel_world_size() > 1:
                stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
                dist.all_gather_object(stages, layers, group=ps.get_pipeline_model_parallel_group())
                layers = {i: t for stage in stages for i, t in stage.items()}
            out.append(torch.stack([layers[i] for i in range(len(self.moe_layers))], dim=1))
        return out

    def _output_processor(self) -> Any:
        return logprob.output_processor

    def _processor_context(self, mb: PackedMicroBatch, model: Any) -> dict[str, Any]:
        return {
            "labels": next_token_labels(mb.input_ids),
            "chunk_tokens": self.chunk_tokens,
            "keep_logits_bytes": int(self.cfg.logprob_keep_logits_gib * 2**30),
            "compiled": self.compiled_kernels,
            "temperature": self.temperature,
            "vocab_size": self.bridge.hf_config.vocab_size,
        }

    def _token_outputs(self, mb: PackedMicroBatch, output: Any) -> dict[str, Tensor]:
        """Model outputs of one micro-batch as padded [n, max_len] tensors, token-aligned (see packing.py)."""
        logp, ent = output
        return {
            "log_probs": mb.unpack(shift_to_tokens(logp[0], mb.cu_seqlens)),
            "entropy": mb.unpack(shift_to_tokens(ent[0], mb.cu_seqlens)),
        }

    def forward_backward(self, batch: JaggedBatch, loss_fn: LossFn) -> dict[str, float]:
        from megatron.core import parallel_state

        if self.optimizer is None:
            raise RuntimeError("forward_backward: this engine is forward-only (optim=None): it has no gradients")
        for chunk in self.model:
            chunk.train()
        mbs = self.micro_batches(batch)
        normalizer = self._normalizer(mbs)
        scale = len(mbs) * parallel_state.get_data_parallel_world_size()

        def loss_func(mb: PackedMicroBatch, output: Any) -> tuple[Tensor, dict[str, Tensor]]:
            loss, metrics = loss_fn(self._token_outputs(mb, output), mb.fields, normalizer)
            reported = {k: v.detach().float() for k, v in metrics.items()}
            return loss * scale, {"loss": loss.detach().float(), **reported}

        stats = self._run_schedule(mbs, loss_func, forward_only=False)
        return self._reduce_metrics(stats, len(mbs))

    def _reduce_metrics(self, stats: list[dict[str, Tensor]], num_mbs: int) -> dict[str, float]:
        """loss: Σ over micro-batches and DP ranks; other metrics: mean over micro-batches, then over DP ranks."""
        from megatron.core import parallel_state

        keys: list[str] = sorted(stats[0]) if stats else []
        keys_box = [keys]
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(keys_box, src=last, group=pp_group)
        keys = keys_box[0]
        values = torch.zeros(len(keys), dtype=torch.float64, device=_device())
        if parallel_state.is_pipeline_last_stage():
            for i, k in enumerate(keys):
                total = sum(float(s[k]) for s in stats)
                values[i] = total if k == "loss" else total / max(num_mbs, 1)
        dist.broadcast(values, src=last, group=pp_group)
        dp_group = parallel_state.get_data_parallel_group()
        dist.all_reduce(values, group=dp_group)
        dp = dist.get_world_size(dp_group)
        return {k: float(v) if k == "loss" else float(v) / dp for k, v in zip(keys, values.tolist())}

    def optimizer_step(self) -> dict[str, float]:
        """Clip and update, unless the gradients hold NaN/Inf anywhere: then the update is skipped on every rank
        (weights, Adam moments and LR schedule untouched) and `update_ok` is False. fp16 runs leave that check to
        Megatron's loss scaler, which also lowers its scale; fp32/bf16 have no scaler, and Megatron would apply
        a NaN gradient norm to the weights."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (optim=None)")
        ok, grad_norm = False, None
        if self.tf_config.fp16 or self._grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.scheduler.step(increment=1)
        self._zero_grads()
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr, "update_ok": ok}

    def _grads_finite(self) -> bool:
        """Whether every gradient of every rank is finite. After the DP reduction each rank holds its own TP/PP
        shard (and, with the distributed optimizer, its reduced DP slice beside its local gradients), so the
        verdict is a MAX over all ranks: they must all skip or all update, never leave the weights half-updated.
        Each buffer's min and max (one pass, no copy) are NaN if any element is and ±Inf if one is: exact, unlike
        a sum, which can overflow, and 25x faster on CPU than the float64 sum that avoided the overflow."""
        bad = torch.zeros(1, device=_device())
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                if buffer.grad_data.numel():
                    extremes = torch.stack(torch.aminmax(buffer.grad_data))
                    bad = torch.maximum(bad, (~torch.isfinite(extremes)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def _zero_grads(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    @torch.no_grad()
    def infer(self, batch: JaggedBatch, *, entropy: bool = False, routing: bool = False) -> dict[str, Tensor]:
        """Per-token `log_probs` (and `entropy`) in the batch's flat layout, on every rank of the DP group. With
        `routing` (router replay on), also `routed_experts` (what the routers routed by: the batch's routing where
        it has one, replayed) and `own_experts` (the routers' own top-k), [N, L, K] int16."""
        from megatron.core import parallel_state

        for chunk in self.model:
            chunk.eval()
        mbs = self.micro_batches(batch)

        def collect(mb: PackedMicroBatch, output: Any) -> tuple[Tensor, dict[str, Any]]:
            outputs = self._token_outputs(mb, output)
            return torch.zeros((), device=_device()), {k: v.cpu() for k, v in outputs.items()}

        stats = self._run_schedule(mbs, collect, forward_only=True)
        keys = self._output_keys(entropy)
        lengths = batch.lengths.tolist()
        n = int(sum(lengths))
        out = torch.zeros(len(keys), n, dtype=torch.float32, device=_device())
        if parallel_state.is_pipeline_last_stage():
            for i, k in enumerate(keys):
                out[i] = scatter_to_batch([(mb.sample_index, s[k]) for mb, s in zip(mbs, stats)], lengths).to(out)
        dist.broadcast(
            out,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        result = dict(zip(keys, out.cpu()))
        if routing and self.trace_routing:
            for key, kind in (("routed_experts", "used"), ("own_experts", "own")):
                rows = [(mb.sample_index, mb.unpack(r)) for mb, r in zip(mbs, self._gathered_routing(mbs, kind))]
                result[key] = scatter_to_batch(rows, lengths)
        return result

    def _output_keys(self, entropy: bool) -> list[str]:
        return ["log_probs", "entropy"] if entropy else ["log_probs"]

    def adapters_disabled(self) -> Any:
        """Context: the base model without its LoRA adapters (the reference policy of a LoRA run)."""
        from mrl.engine.megatron import lora

        if not self.adapters:
            raise RuntimeError("adapters_disabled: this engine has no LoRA adapters (actor.lora.enable=false)")
        return lora.disabled(self.adapters)

    # ---- the rest of the contract ---------------------------------------------------------------------------
    def state_sizes(self) -> dict[str, int]:
        """This rank's optimizer-state bytes (Adam moments, fp32 master copies) and its share of the trainable
        parameters, TP duplicates and DP replicas counted once (the sum over ranks is the model's)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        from mrl.engine.megatron.offload import optimizer_tensors

        state = optimizer_tensors(self.optimizer) if self.optimizer is not None else []
        first_replica = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        trainable = sum(p.numel() for chunk in self.model for p in chunk.parameters()
                        if p.requires_grad and param_is_not_tensor_parallel_duplicate(p)) if first_replica else 0
        return {"optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
                "trainable_params": trainable}

    def unwrapped(self) -> list[torch.nn.Module]:
        return [chunk.module for chunk in self.model]

    def export_weights(self, tp_slices: bool = False, row_blocks: bool = False) -> Iterator[tuple]:
        return self.bridge.export(self.unwrapped(), tp_slices=tp_slices, row_blocks=row_blocks)

    def to(self, device: str, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """`to("cpu")` offloads the selected state (its device storage is freed); any other device brings it
        back bit for bit (mrl/engine/megatron/offload.py)."""
        from mrl.engine.megatron import offload

        sources = {
            "params": lambda: offload.param_tensors(self.model),
            "grads": lambda: offload.grad_tensors(self.model),
            "optimizer": lambda: offload.optimizer_tensors(self.optimizer) if self.optimizer is not None else [],
        }
        to_host = torch.device(device).type == "cpu"
        for kind, selected in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if not selected:
                continue
            offloader = self._offloaders.setdefault(kind, offload.StorageOffloader())
            if to_host and not offloader.offloaded:
                offloader.offload(sources[kind]())
            elif not to_host and offloader.offloaded:
                offloader.onload()

    def save_checkpoint(self, path: str) -> None:
        from mrl.engine.megatron import checkpoint

        checkpoint.save(path, self.unwrapped(), self.optimizer, self.scheduler)
        if self.lora is not None and dist.get_rank() == 0:
            from mrl.engine.megatron import lora

            lora.write_settings(path, self.lora)  # `mrl convert to-hf` rebuilds the adapters from it

    def load_checkpoint(self, path: str) -> None:
        from mrl.engine.megatron import checkpoint

        checkpoint.load(path, self.unwrapped(), self.optimizer, self.scheduler)

    def mesh(self, name: str = "train") -> Any:
        """Dense-parameter mesh in Megatron's rank order (tp fastest, then cp, dp, pp)."""
        from megatron.core import parallel_state as ps

        from mrl.controller.mesh import DeviceMesh

        dims = {
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
        }
        coords = {
            "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
            "cp": ps.get_context_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_rank(),
        }
        return DeviceMesh.create(dims, coords=coords)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_chunks(config: Any, model_kwargs: Mapping[str, Any], vocab_divisor: int = 1) -> list[torch.nn.Module]:
    """GPTModel chunks (one per virtual stage) with packing-capable attention: TransformerEngine's spec when TE is
    importable, else the local spec with SdpaAttention. The vocabulary is padded to a multiple of vocab_divisor × TP."""
    from mrl.engine.megatron.attention import sdpa_layer_spec
    from mrl.engine.megatron.model import build_model, transformer_engine_available

    if transformer_engine_available():
        return build_model(config, dict(model_kwargs), use_te=True, vocab_divisor=vocab_divisor)
    return build_model(config, dict(model_kwargs), spec=lambda cfg, vp_stage: sdpa_layer_spec(cfg, vp_stage=vp_stage),
                       vocab_divisor=vocab_divisor)
