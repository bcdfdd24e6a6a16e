"""The `ipc` weight-sync transport on CUDA: a stream of CUDA tensors (mixed dtypes and shapes, a strided view, one
tensor larger than a bucket) packed into two shared device buffers is read by a receiver process on the same GPU
through CUDA IPC handles, bit for bit and without passing through host memory (the receiver sees device views);
with `one_copy` the same stream arrives as views of the sender's own tensors (no shared buffers)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from mrl.weight_sync import make_sender, receive_into

pytestmark = pytest.mark.gpu

BUCKET = 64 << 10


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _receiver(spec, outbox) -> None:
    torch.cuda.set_device(0)
    got = []

    def load(named):
        # Raw bytes, not tensors: views of the sender's buffers must not outlive this bucket.
        got.extend((name, str(t.device), t.dtype, tuple(t.shape), raw_bytes(t)) for name, t in named)

    receive_into(spec, 1, load)
    outbox.put(got)


@pytest.mark.parametrize("one_copy", [False, True])
def test_stream_crosses_processes_bit_exact_through_cuda_ipc(one_copy):
    torch.manual_seed(0)
    tensors = [
        ("model.embed_tokens.weight", torch.randn(1000, 64, device="cuda")),  # 256 000 bytes: four buckets
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(63, device="cuda", dtype=torch.float16)),
        ("model.layers.0.mlp.gate_up.weight", torch.randn(3, 5, 7, device="cuda")[:, 1]),  # a strided view
        ("step", torch.arange(3, device="cuda")),
    ] + [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(96, 96, device="cuda")) for i in range(1, 6)]
    sender = make_sender("ipc", 2, BUCKET, 120.0, device="cuda", one_copy=one_copy)
    spec = sender.prepare()
    assert spec["device"] == "cuda" and len(spec["handles"]) == (0 if one_copy else 2)
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(spec, outbox))
    proc.start()
    try:
        sender.init_process_group()
        assert sender.send_weights(iter(tensors)) == len(tensors)
        sender.finalize()
        received = outbox.get(timeout=120)
    finally:
        sender.finalize(wait=False)
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert [item[0] for item in received] == [name for name, _ in tensors]
    for (name, device, dtype, shape, got), (_, sent) in zip(received, tensors):
        assert device.startswith("cuda"), name
        assert dtype == sent.dtype and shape == tuple(sent.shape), name
        assert got == raw_bytes(sent), name
