"""CPU compatibility layer: lets megatron-core 0.19 run on a CPU-only torch build over gloo.

Megatron assumes CUDA in many places; each patch below names the assumption it meets. `apply()` is
idempotent and does nothing when CUDA is available, so product code may call it unconditionally before
building models. It imports the Megatron modules it patches, so the first call costs the Megatron import.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")
_applied: list[str] = []

# Modules whose functions build tensors with device="cuda" (or torch.cuda.current_device()) on the paths the
# engine and the bridges use: model build, forward/backward schedules, DDP buffers, optimizers, MoE dispatch.
_MEGATRON_MODULES = (
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)


def applied() -> list[str]:
    """Names of the patches in force (empty on a CUDA machine or before `apply()`)."""
    return list(_applied)


def apply() -> list[str]:
    """Install every patch once; a no-op when CUDA is available. Returns the patches in force."""
    if torch.cuda.is_available() or _applied:
        return applied()
    import importlib

    for name in _MEGATRON_MODULES:
        importlib.import_module(name)
    for patch in (
        _patch_torch_cuda,
        _patch_rng_tracker,
        _patch_cuda_factories,
        _patch_tensor_type,
        _patch_moe_split_sizes,
        _patch_torch_norm_sequence_parallel,
        _patch_uneven_gather,
    ):
        _applied.append(patch())
    return applied()


class _NoStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered, so waits and records are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        return _NoStream()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> str:
    # Megatron calls torch.cuda.current_device() as a device argument, synchronises, makes streams and events,
    # and pushes NVTX ranges; on a CPU build each raises "Torch not compiled with CUDA enabled".
    c = torch.cuda
    c.current_device = lambda: _CPU  # type: ignore[assignment]
    c.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    c.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    c.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    c.default_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    c.Stream = _NoStream  # type: ignore[assignment,misc]
    c.Event = _NoStream  # type: ignore[assignment,misc]
    c.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    c.nvtx = types.SimpleNamespace(  # type: ignore[assignment]
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
    )
    # `.cuda()` moves inputs and buffers in a few places (schedules, data broadcast); on CPU it stays put.
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    return "torch.cuda device/stream/event/nvtx/Tensor.cuda -> CPU no-ops"


def _patch_rng_tracker() -> str:
    # model_parallel_cuda_manual_seed and the CUDA RNG tracker (TP-distinct dropout/initialisation) save and
    # restore CUDA generator states; the CPU generator plays that role. torch.manual_seed seeds it already.
    import megatron.core.tensor_parallel.random as rng

    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    return "CUDA RNG tracker -> CPU generator"


class _CpuFactories(types.ModuleType):
    """`torch` as seen by a patched Megatron module: tensor factories given a CUDA device build on CPU."""

    _FACTORIES = frozenset(
        (
            "zeros",
            "ones",
            "empty",
            "tensor",
            "full",
            "arange",
            "randn",
            "rand",
            "randint",
            "zeros_like",
            "ones_like",
            "empty_like",
            "full_like",
            "as_tensor",
            "linspace",
            "eye",
            "randperm",
        )
    )

    def __getattr__(self, name: str) -> Any:
        obj = getattr(torch, name)
        if name not in self._FACTORIES:
            return obj

        def factory(*args: Any, __make: Callable[..., Any] = obj, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
                kwargs["device"] = _CPU
            return __make(*args, **kwargs)

        return factory


def _patch_cuda_factories() -> str:
    # Buffers (grad buckets, token counts, loss reductions) are created with device="cuda" literally. Replacing
    # the module-global `torch` of only those modules keeps every other caller untouched.
    proxy = _CpuFactories("torch")
    patched = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron") or module is None or getattr(module, "torch", None) is not torch:
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if 'device="cuda"' in source or "device='cuda'" in source:
            module.torch = proxy  # type: ignore[attr-defined]
            patched += 1
    return f'device="cuda" factories -> CPU in {patched} Megatron modules'


def _patch_tensor_type() -> str:
    # The (distributed) optimizer decides fp32 master copies by `param.type() == "torch.cuda.FloatTensor"`;
    # CPU tensors answer "torch.FloatTensor" and would be rejected. Only the argument-less query is changed.
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    return "Tensor.type() reports torch.cuda.* names"


def _patch_moe_split_sizes() -> str:
    # The all-to-all dispatcher turns split sizes into numpy only for CUDA tensors; on CPU a tensor reaches
    # dist.all_to_all_single(output_split_sizes=...) and raises TypeError.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    # Only Megatron's modules: getattr on lazy modules elsewhere (transformers) imports optional dependencies.
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron") and getattr(module, "maybe_move_tensor_to_cpu", None) is original:
            module.maybe_move_tensor_to_cpu = to_cpu  # type: ignore[attr-defined]
    return "MoE split sizes -> numpy on CPU"


def _patch_torch_norm_sequence_parallel() -> str:
    # The local spec's WrappedTorchNorm refuses sequence_parallel, which MoE with TP > 1 requires (the engine's
    # own spec builds its norms through the same helper on CUDA too; this covers the plain local spec on CPU).
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mrl.engine.megatron.model import build_sequence_parallel_norm

    original = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        return build_sequence_parallel_norm(lambda: original(cls, config, hidden_size, *args, **kwargs), config)

    WrappedTorchNorm.__new__ = new  # type: ignore[method-assign,assignment]
    return "WrappedTorchNorm accepts sequence_parallel"


def _patch_uneven_gather() -> str:
    # gloo's all_gather needs equal sizes ("ProcessGroupGloo::allgather: invalid tensor size"); the MoE
    # dispatcher gathers and reduce-scatters uneven token counts over TP. Pad to the largest and slice.
    import megatron.core.tensor_parallel.mappings as mappings

    gather_even, reduce_scatter_even = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False):
        if output_split_sizes is None or group.size() == 1:
            return gather_even(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)], 0)

    def reduce_scatter(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
    ):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter_even(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        full = input_.contiguous().clone()
        dist.all_reduce(full, group=group)
        start = sum(sizes[: dist.get_rank(group)])
        return full[start : start + sizes[dist.get_rank(group)]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter
    return "uneven all-gather/reduce-scatter padded for gloo"
