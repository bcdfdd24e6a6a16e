"""CUDA IPC handles of flat device buffers (the `ipc` weight-sync transport on GPU: hybrid and colocated replicas).

The sender shares a flat uint8 buffer once per sync; a receiver in another process on the same GPU maps it and
takes views, with no copy through host memory. The sender must keep the buffer alive until every receiver is done.
The handle is torch's `reduce_tensor` output, pickled: it only travels between our own trainer and rollout
processes (through Ray, which pickles everything anyway). Only torch is imported here: the GPU machine runs this
without vLLM or Ray.
"""

from __future__ import annotations

import pickle

import torch


def share_cuda_buffer(buffer: torch.Tensor) -> bytes:
    """An IPC handle of a CUDA tensor, as bytes (msgpack- and Ray-safe)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return pickle.dumps(args)


def open_cuda_buffer(handle: bytes, device: int | None = None) -> torch.Tensor:
    """Map a buffer shared by `share_cuda_buffer` on `device` (default: this process's current device)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(handle))
    args[6] = torch.cuda.current_device() if device is None else device  # the sender's index means nothing here
    return rebuild_cuda_tensor(*args)
