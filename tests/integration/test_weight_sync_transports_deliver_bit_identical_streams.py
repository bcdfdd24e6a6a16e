"""Each weight-sync transport (ipc over shared memory on CPU, nccl over gloo, disk) carries a stream of assorted
dtypes and shapes (a block-FP8 weight larger than a bucket and its scales among them: rollout.quantization=fp8),
one tensor larger than a bucket, a strided view and an empty tensor, from a sender to two receiver processes bit for
bit, and in the order sent; with small buckets both buffers are reused many times. A receiver that never joins
makes the sender fail within `timeout_s`, naming the stage, the missing rank and the knob; a receiver that fails
makes the sender stop at once with the receiver's error. The control store listens on loopback only."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from mrl.weight_sync import TRANSPORTS, WeightSyncPeerError, WeightSyncTimeout, make_sender, receive_into
from mrl.weight_sync.fp8 import quantize

pytestmark = pytest.mark.integration

BUCKET = 4096


def stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    fp8, scale = quantize(torch.randn(130, 40, generator=g).to(torch.bfloat16))  # 5200 bytes: split over two
    return [
        ("embed", torch.randn(40, 33, generator=g)),  # 5280 bytes: larger than a bucket, split over two
        ("q", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("norm", torch.randn(63, generator=g).to(torch.float16)),
        ("strided", torch.randn(3, 5, 7, generator=g)[:, 1]),
        ("empty", torch.zeros(0, 4)),
        ("steps", torch.arange(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("big", torch.randn(3000, generator=g, dtype=torch.float64)),  # 24000 bytes: six buckets
        ("tail", torch.randn(2, 2, generator=g)),
        ("fp8.weight", fp8),
        ("fp8.weight_scale_inv", scale),
    ]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _receive(spec, rank, out, fail) -> None:
    torch.set_num_threads(1)
    got = []

    def load(named):
        if fail:
            raise RuntimeError("cannot load this bucket")
        got.extend((name, t.dtype, tuple(t.shape), raw(t)) for name, t in named)

    try:
        receive_into(spec, rank, load)
        out.put((rank, got))
    except RuntimeError as error:
        out.put((rank, str(error)))


def run_sync(transport: str, failing_rank: int | None = None, world: int = 3, timeout_s: float = 120.0):
    ctx = mp.get_context("fork")  # the receivers touch no state of this process; spawn costs seconds each
    sender = make_sender(transport, world, BUCKET, timeout_s)
    spec = sender.prepare()
    out = ctx.Queue()
    procs = [ctx.Process(target=_receive, args=(spec, r, out, r == failing_rank)) for r in range(1, 3)]
    for p in procs:
        p.start()
    try:
        # Spawned receivers need seconds to import torch on a loaded machine: the timeout under test starts after.
        sender.control.wait("start", {r: sender.control.key("joined", r) for r in (1, 2)}, timeout_s=120)
        sender.init_process_group()
        sent = sender.send_weights(stream())
        sender.finalize()
        return sent, dict(out.get(timeout=60) for _ in procs)
    finally:
        sender.finalize(wait=False)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stream_arrives_bit_identical(transport):
    sent, received = run_sync(transport)
    expected = [(name, t.dtype, tuple(t.shape), raw(t)) for name, t in stream()]
    assert sent == len(expected)
    assert set(received) == {1, 2}
    for rank in (1, 2):
        assert [r[0] for r in received[rank]] == [e[0] for e in expected]
        assert received[rank] == expected, f"rank {rank} received different bytes"


def test_missing_receiver_times_out_naming_rank_stage_and_knob():
    with pytest.raises(WeightSyncTimeout) as error:
        run_sync("ipc", world=4, timeout_s=3.0)  # rank 3 is never started
    message = str(error.value)
    assert "'rendezvous'" in message and "[3]" in message and "weight_sync.timeout_s" in message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failing_receiver_stops_the_sender_with_its_error(transport):
    with pytest.raises(WeightSyncPeerError, match="rank 2: RuntimeError: cannot load this bucket"):
        run_sync(transport, failing_rank=2)


def listening_addresses(port: int) -> list[str]:
    """Hex local addresses of the sockets listening on `port` (Linux /proc tables; 0100007F is 127.0.0.1)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if int(hex_port, 16) == port and state == "0A":
                    found.append(address)
    return found


def test_control_store_listens_on_loopback_only():
    sender = make_sender("ipc", 2, BUCKET, 5.0)
    spec = sender.prepare()
    try:
        assert listening_addresses(spec["port"]) == ["0100007F"]
    finally:
        sender.finalize(wait=False)
