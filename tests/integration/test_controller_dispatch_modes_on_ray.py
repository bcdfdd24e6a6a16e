"""A RayWorkerGroup of 4 actors: every dispatch mode delivers the right chunk to each rank and collects in order,
padding is stripped, futures chain across group calls without ray.get, nd_compute follows the registered mesh,
and the rendezvous environment lets the workers form a torch.distributed group."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from mrl.controller import (
    Dispatch,
    Execute,
    GroupFuture,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    nd_compute,
    register,
)
from mrl.data.batch import Batch

pytestmark = pytest.mark.integration


class RankWorker(Worker):
    """Tags every output with the rank that produced it and remembers what it last received."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.offset = offset
        self.received = None

    @register(Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {"rank": self.rank, "pid": os.getpid(), **{k: os.environ[k] for k in keys}}

    @register(Dispatch.ONE_TO_ALL)
    def register_meshes(self) -> None:
        self.register_mesh("dp_tp", {"dp": 2, "tp": 2})
        self.register_mesh("dp_pp", {"pp": 2, "dp": 2})

    @register(Dispatch.ONE_TO_ALL)
    def last_received(self):
        return self.received

    @register(Dispatch.ONE_TO_ALL)
    def describe(self, x):
        self.received = x
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_only(self):
        return self.rank

    @register(Dispatch.ALL_TO_ALL)
    def pair(self, x, y):
        return (self.rank, x, y)

    @register(Dispatch.DP_COMPUTE)
    def tag_rows(self, rows: list, scale: int) -> list:
        self.received = rows
        return [(self.rank, r * scale + self.offset) for r in rows]

    @register(Dispatch.DP_COMPUTE, pad=True)
    def double_rows(self, x: torch.Tensor) -> torch.Tensor:
        # column 1 records which rank computed the row, and how many rows (padding included) the rank got
        return torch.stack([x * 2, torch.full_like(x, self.rank), torch.full_like(x, len(x))], dim=1)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def square(self, x: torch.Tensor) -> torch.Tensor:
        return x * x

    @register(Dispatch.DP_COMPUTE)
    def plus_one(self, x: torch.Tensor) -> torch.Tensor:
        self.received = x
        return x + 1

    @register(nd_compute("dp_tp"))
    def on_dp_tp(self, rows: list) -> list:
        self.received = rows
        m = self.mesh("dp_tp").coord
        return [(m["dp"], m["tp"], r) for r in rows]

    @register(nd_compute("dp_pp"), blocking=False)
    def on_dp_pp(self, rows: list, fail_rank: int = -1) -> list:
        if self.rank == fail_rank:
            raise RuntimeError(f"on_dp_pp failed on rank {self.rank}")
        self.received = rows
        m = self.mesh("dp_pp").coord
        return [(m["dp"], m["pp"], r) for r in rows]

    @register(Dispatch.DP_COMPUTE, pad=True)
    def score_batch(self, batch: Batch) -> Batch:
        """A read-only call on the real Batch: one score per sample (sum of its jagged response) and the rank.
        (type(batch), not the global Batch: a global reference would make every worker import mrl.data.batch,
        about 7 s and 400 MB per process on this machine, when the actor class arrives.)"""
        self.received = batch.as_list("uid")
        scores = torch.stack([r.sum() for r in batch.as_list("response")])
        return type(batch).from_dict(
            {"uid": batch.as_list("uid"), "score": scores, "rank": torch.full_like(scores, self.rank)}
        )

    @register(nd_compute("dp_tp"))
    def update_batch(self, batch: Batch) -> Batch:
        self.received = batch.as_list("uid")
        return type(batch).from_dict(
            {"uid": batch.as_list("uid"), "tp": torch.full((len(batch),), self.mesh("dp_tp").coord["tp"])}
        )

    @register(Dispatch.ONE_TO_ALL)
    def allreduce_ranks(self) -> float:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// from the variables the group set
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()


@pytest.fixture(scope="module")
def group(ray_cluster):
    # Ray workers cannot import this test module; ship its classes by value.
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = RayResourcePool([4], use_gpu=False, cpus_per_slot=0.25, timeout_s=60)
    start = time.monotonic()
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(RankWorker, offset=1000))
    wg.register_meshes()
    print(f"4-actor group ready in {time.monotonic() - start:.1f} s")
    yield wg
    wg.kill()
    pool.remove()


def test_workers_get_rank_world_and_one_rendezvous(group):
    envs = group.env()
    assert [e["rank"] for e in envs] == [0, 1, 2, 3]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", envs[0]["MASTER_PORT"])}
    assert len({e["pid"] for e in envs}) == 4
    assert group.allreduce_ranks() == [6.0] * 4


def test_one_to_all_sends_the_same_argument_and_collects_in_rank_order(group):
    assert group.describe({"k": [1, 2]}) == [(r, {"k": [1, 2]}) for r in range(4)]
    assert group.rank_zero_only() == 0


def test_all_to_all_sends_item_r_to_rank_r(group):
    assert group.pair(["a", "b", "c", "d"], y=[10, 11, 12, 13]) == [
        (0, "a", 10),
        (1, "b", 11),
        (2, "c", 12),
        (3, "d", 13),
    ]


def test_dp_compute_chunks_in_rank_order(group):
    out = group.tag_rows(list(range(8)), scale=3)
    assert out == [(i // 2, i * 3 + 1000) for i in range(8)]
    assert group.last_received() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_dp_compute_pads_read_only_calls_and_strips_the_padding(group):
    x = torch.arange(10, dtype=torch.float32)
    out = group.double_rows(x)
    assert out.shape == (10, 3)
    assert torch.equal(out[:, 0], x * 2)
    assert out[:, 1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # 12 padded rows, 3 per rank
    assert set(out[:, 2].tolist()) == {3.0}


def test_training_call_with_indivisible_batch_fails_naming_the_sizes(group):
    with pytest.raises(ValueError, match="tag_rows: batch size 10 is not divisible by the data-parallel size 4"):
        group.tag_rows(list(range(10)), scale=1)


def test_futures_chain_across_two_group_calls(group):
    x = torch.arange(8, dtype=torch.float32)
    fut = group.square(x)
    assert isinstance(fut, GroupFuture)
    out = group.plus_one(fut)
    assert torch.equal(out, x * x + 1)
    assert not fut._done  # each rank got its chunk's ObjectRef; the driver never fetched the squares
    assert [t.tolist() for t in group.last_received()] == [(x * x)[2 * r : 2 * r + 2].tolist() for r in range(4)]
    # Into ONE_TO_ALL every rank gathers the whole result itself; .get() resolves explicitly.
    gathered = group.describe(fut)
    assert all(torch.equal(v, x * x) for _, v in gathered)
    assert torch.equal(fut.get(), x * x)


def test_nd_compute_dp2_tp2_gives_both_tp_ranks_the_same_chunk(group):
    out = group.on_dp_tp(["a", "b", "c", "d"])
    assert out == [(0, 0, "a"), (0, 0, "b"), (1, 0, "c"), (1, 0, "d")]  # 2 results: tp 0 of each DP group
    # dims (dp, tp): ranks 0, 1 form DP group 0, ranks 2, 3 DP group 1
    assert group.last_received() == [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]


def test_nd_compute_dp2_pp2_collects_from_the_last_stage(group):
    fut = group.on_dp_pp(["a", "b", "c", "d"])
    assert fut.collect.indices == (2, 3)  # (pp 1, dp 0) and (pp 1, dp 1)
    assert fut.get() == [(0, 1, "a"), (0, 1, "b"), (1, 1, "c"), (1, 1, "d")]
    assert group.last_received() == [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]


def jagged_batch(n: int) -> Batch:
    responses = [torch.arange(i % 3 + 1, dtype=torch.float32) + i for i in range(n)]  # lengths 1, 2, 3, 1, ...
    return Batch.from_dict({"uid": [f"s{i}" for i in range(n)], "response": responses})


def test_real_batch_is_padded_split_and_unpadded_through_dp_compute(group):
    batch = jagged_batch(10)
    out = group.score_batch(batch)
    assert isinstance(out, Batch) and len(out) == 10
    assert out.as_list("uid") == [f"s{i}" for i in range(10)]
    assert torch.equal(out["score"], torch.stack([r.sum() for r in batch.as_list("response")]))
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert group.last_received()[3] == ["s9", "s0", "s1"]  # the padded rows are leading samples again


def test_real_batch_follows_the_nd_mesh_and_training_calls_refuse_padding(group):
    out = group.update_batch(jagged_batch(4))
    assert out.as_list("uid") == ["s0", "s1", "s2", "s3"] and out["tp"].tolist() == [0, 0, 0, 0]
    assert group.last_received() == [["s0", "s1"], ["s0", "s1"], ["s2", "s3"], ["s2", "s3"]]
    with pytest.raises(ValueError, match="update_batch: batch size 5 is not divisible by the data-parallel size 2"):
        group.update_batch(jagged_batch(5))


def test_error_on_an_uncollected_rank_fails_the_call_a_future_is_forwarded_to(group):
    fut = group.on_dp_pp(["a", "b"], fail_rank=0)  # rank 0 = (pp 0, dp 0): not collected
    with pytest.raises(RuntimeError, match="on_dp_pp failed on rank 0"):
        group.on_dp_tp(fut)  # 2 DP chunks: forwarded chunk-wise, never fetched by the driver
    with pytest.raises(RuntimeError, match="on_dp_pp failed on rank 0"):
        fut.get()
