"""Weight buckets shared by CUDA IPC (same device: hybrid and colocated replicas on GPU).

The sender copies a bucket of tensors into one flat uint8 device buffer and ships a pickled IPC handle of it plus
(name, dtype, shape, byte offset) metadata; the receiver (a vLLM worker on the same GPU) maps the buffer and takes
views, with no copy through host memory. The sender must keep its buffer alive until the receiver has loaded it.
Only torch is imported here: the GPU machine runs this without vLLM or Ray.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch

# Offsets are rounded up so that every view is aligned for any dtype (and for vectorised copies).
ALIGN = 256

IpcMeta = list[tuple[str, str, list[int], int]]


def pack_ipc_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, bytes, IpcMeta]:
    """Copy CUDA tensors into one flat buffer; return (buffer to keep alive, pickled IPC handle, metadata)."""
    from torch.multiprocessing.reductions import reduce_tensor

    meta: IpcMeta = []
    offset = 0
    for name, tensor in named_tensors:
        meta.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    device = named_tensors[0][1].device if named_tensors else torch.device("cuda")
    flat = torch.empty(max(offset, ALIGN), dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, start) in zip(named_tensors, meta):
        nbytes = tensor.numel() * tensor.element_size()
        flat[start : start + nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    torch.cuda.current_stream(device).synchronize()  # the receiver reads on another stream, in another process
    return flat, pickle.dumps(reduce_tensor(flat)), meta


def unpack_ipc_bucket(handle: bytes, meta: IpcMeta) -> list[tuple[str, torch.Tensor]]:
    """Map the sender's buffer on this process's current device and return views of the named tensors."""
    rebuild, args = pickle.loads(handle)
    args = list(args)
    args[6] = torch.cuda.current_device()  # storage device: the sender's index means nothing in this process
    flat = rebuild(*args)
    named = []
    for name, dtype, shape, offset in meta:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        named.append((name, flat[offset : offset + nbytes].view(dt).view(shape)))
    return named
