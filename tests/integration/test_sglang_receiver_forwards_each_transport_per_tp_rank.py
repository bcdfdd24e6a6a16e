"""SGLang's weight-sync receiver, from a real mrl sender to the HTTP bodies SGLang's TP workers read.

A real `mrl.weight_sync` sender (ipc on /dev/shm, nccl on gloo, disk) sends to `SGLangAdapter.receive_weights`
over loopback; the SGLang server (CUDA only, it cannot run here) is replaced by an aiohttp app that answers with
the recorded shapes of sglang main @ 001067ff and does what each TP worker does with its request: deserialises
`serialized_named_tensors[tp_rank]` (UpdateWeightsFromTensorReqInput) in another process, as a worker does, and
keeps what it got. CPU tensors travel by shared-memory file name here: passed as file descriptors (torch's default)
they raced with the adapter's receiver threads (an fd closed twice: 2 runs in 8 failed on this 2-core machine).
On GPU the adapter forwards CUDA IPC handles, which pass no descriptors.

Proves: every transport arrives as one /update_weights_from_tensor per bucket, in the abort -> buckets -> flush
order, with exactly the recorded request fields and one entry per TP rank holding the whole stream; a per-device
sync gives TP rank j the TP slice trainer rank j sent, in place in the full-shaped tensor, and a rank whose stream
ended sooner sends empty entries; an engine that refuses a bucket fails the sync on both sides at once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from aiohttp import web
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from bridges.export import TpSlice
from mrl.weight_sync import WeightSyncPeerError, make_sender
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter

# UpdateWeightsFromTensorReqInput's fields that our body sets (io_struct.py @ 001067ff).
TENSOR_UPDATE_FIELDS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests"}
TP = 2


def _load_entry(entry: str) -> tuple[list[str], bytes]:
    """A TP worker's side, in the worker process: open the handles, copy the tensors out (names in order)."""
    for attempt in range(3):
        try:
            named = protocol.deserialize_named_tensors(entry)
            break
        except RuntimeError as error:
            # torch's shared-memory manager answers each mapping within 1 s or fails it; a loaded 2-core machine
            # (two test workers) missed that once in a CI run. The sender keeps the files until we answer.
            if "Shared memory manager connection has timed out" not in str(error) or attempt == 2:
                raise
    return [n for n, _ in named], st_save({n: t.clone() for n, t in named})


@pytest.fixture(scope="module")
def worker_process():
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(int).result()  # started before the first sync's deadline runs
            yield pool
    finally:
        tmp.set_sharing_strategy(before)


class TpWorkers:
    """The server: records the control calls and, per update, what each TP rank deserialised."""

    def __init__(self, pool: ProcessPoolExecutor, refuse_bucket: int | None = None) -> None:
        self.pool = pool
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        self.per_rank: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(TP)]
        self.counts: list[list[int]] = []  # per update: tensors per rank
        self.refuse_bucket = refuse_bucket
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        for path in ("/abort_request", "/update_weights_from_tensor", "/flush_cache"):
            self.app.router.add_post(path, self.handle)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.paths.append(request.path)
        if request.path != "/update_weights_from_tensor":
            return web.json_response({})
        self.bodies.append(body)
        if len(self.bodies) - 1 == self.refuse_bucket:
            return web.json_response({"success": False, "message": "weight shape mismatch"}, status=400)
        self.counts.append([])
        for rank, entry in enumerate(body["serialized_named_tensors"]):
            # The adapter keeps the tensors alive only until we answer: the worker loads (copies) them now.
            names, blob = await asyncio.get_running_loop().run_in_executor(self.pool, _load_entry, entry)
            tensors = st_load(blob)
            self.counts[-1].append(len(names))
            self.per_rank[rank] += [(n, tensors[n]) for n in names]
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.w", torch.randn(32, 16, generator=g)) for i in range(4)] + [("norm", torch.randn(16))]


async def _sync(workers: TpWorkers, senders: list, streams: list, spec_for_adapter) -> tuple[int, int, list]:
    """Run the senders in threads and the adapter's receive in this loop; return loaded count, version, errors."""
    runner = web.AppRunner(workers.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    adapter = SGLangAdapter("/m", base_url=url, tensor_parallel_size=TP, max_model_len=64)
    await adapter.start()
    specs = [s.prepare() for s in senders]

    def send(sender, stream) -> None:
        sender.init_process_group()
        try:
            sender.send_weights(stream)
            sender.finalize()
        except BaseException:
            sender.finalize(wait=False)
            raise

    try:
        spec, rank = spec_for_adapter(specs)
        results = await asyncio.gather(adapter.receive_weights(spec, rank, 3),
                                       *[asyncio.to_thread(send, s, st) for s, st in zip(senders, streams)],
                                       return_exceptions=True)
        return results[0], adapter.version, results[1:]
    finally:
        await adapter.shutdown()
        await runner.cleanup()


@pytest.mark.parametrize("transport", ["ipc", "nccl", "disk"])
def test_each_transport_reaches_every_tp_rank_in_recorded_bodies(transport, tmp_path, worker_process):
    weights = _weights()
    kwargs = {"directory": str(tmp_path)} if transport == "disk" else {}
    sender = make_sender(transport, 1 + TP, 4096, 60.0, **kwargs)
    workers = TpWorkers(worker_process)
    loaded, version, errors = asyncio.run(_sync(workers, [sender], [iter(weights)], lambda specs: (specs[0], 1)))
    assert errors == [None] and loaded == len(weights) and version == 3
    assert workers.paths[0] == "/abort_request" and workers.paths[-1] == "/flush_cache"
    assert set(workers.paths[1:-1]) == {"/update_weights_from_tensor"} and len(workers.bodies) >= 2
    for body in workers.bodies:
        assert set(body) == TENSOR_UPDATE_FIELDS and len(body["serialized_named_tensors"]) == TP
        assert body["flush_cache"] is False and body["abort_all_requests"] is False
    for got in workers.per_rank:
        assert [n for n, _ in got] == [n for n, _ in weights]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, weights))


def test_per_device_sync_gives_each_tp_rank_its_own_slice(worker_process):
    weights = _weights()
    # Trainer rank j sends TP slice j of the 2-D tensors (dim 0) and the norm whole; rank 1 packs smaller buckets,
    # so its stream has more of them and rank 0's entries run empty at the end.
    streams = [[(n, t.chunk(TP)[j], TpSlice(0, j, TP)) if t.dim() == 2 else (n, t) for n, t in weights]
               for j in range(TP)]
    senders = [make_sender("ipc", 2, bucket, 60.0) for bucket in (8192, 2048)]
    workers = TpWorkers(worker_process)
    loaded, version, errors = asyncio.run(
        _sync(workers, senders, [iter(s) for s in streams], lambda specs: ([(s, 1) for s in specs], 0)))
    assert errors == [None, None] and loaded == len(weights) and version == 3
    assert any(c[0] == 0 and c[1] > 0 for c in workers.counts)  # rank 0 done, rank 1 still sending
    for j, got in enumerate(workers.per_rank):
        by_name = dict(got)
        assert sorted(by_name) == sorted(n for n, _ in weights)
        for name, full in weights:
            if full.dim() == 2:
                assert by_name[name].shape == full.shape  # full-shaped, for SGLang's TP loader to narrow
                assert torch.equal(by_name[name].chunk(TP)[j], full.chunk(TP)[j])
            else:
                assert torch.equal(by_name[name], full)


def test_a_refused_bucket_fails_the_sync_on_both_sides(worker_process):
    sender = make_sender("ipc", 1 + TP, 4096, 60.0)
    workers = TpWorkers(worker_process, refuse_bucket=1)
    loaded, version, errors = asyncio.run(_sync(workers, [sender], [iter(_weights())], lambda specs: (specs[0], 1)))
    assert isinstance(loaded, RuntimeError) and "weight shape mismatch" in str(loaded)
    assert isinstance(errors[0], WeightSyncPeerError) and "weight shape mismatch" in str(errors[0])
    assert version == 0 and "/flush_cache" not in workers.paths
