"""CUDA IPC weight buckets (the same-device transport into a vLLM worker): a bucket packed in one process is mapped
by another process on the same GPU, and every tensor (mixed dtypes and shapes, unaligned sizes) arrives bit for bit
without passing through host memory."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from rollout_adapters.cuda_ipc import pack_ipc_bucket, unpack_ipc_bucket

pytestmark = pytest.mark.gpu


def _receiver(inbox, outbox) -> None:
    torch.cuda.set_device(0)
    handle, meta = inbox.get()
    named = unpack_ipc_bucket(handle, meta)
    # Raw bytes, not tensors: a CPU tensor put on a torch queue is shared through this process's file
    # descriptors, which vanish when it exits.
    outbox.put([(name, str(t.device), t.dtype, tuple(t.shape), raw_bytes(t)) for name, t in named])


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_bucket_crosses_processes_bit_exact():
    torch.manual_seed(0)
    tensors = [
        ("model.embed_tokens.weight", torch.randn(1000, 64, device="cuda")),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(63, device="cuda", dtype=torch.float16)),
        ("model.layers.0.mlp.gate_up.weight", torch.randn(3, 5, 7, device="cuda")[:, 1]),  # a strided view
        ("step", torch.arange(3, device="cuda")),
    ]
    flat, handle, meta = pack_ipc_bucket(tensors)
    assert all(offset % 256 == 0 for *_, offset in meta)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(inbox, outbox))
    proc.start()
    inbox.put((handle, meta))
    received = outbox.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert [item[0] for item in received] == [name for name, _ in tensors]
    for (name, device, dtype, shape, got), (_, sent) in zip(received, tensors):
        assert device.startswith("cuda"), name
        assert dtype == sent.dtype and shape == tuple(sent.shape), name
        assert got == raw_bytes(sent), name
    del flat  # the sender keeps the buffer alive until the receiver is done
