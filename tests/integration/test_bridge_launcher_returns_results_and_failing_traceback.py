"""The local launcher (used by every bridge and engine test): ranks form one gloo world and results come back
in rank order; a failing rank's traceback is in the error; a hung rank is stopped at the timeout."""

from __future__ import annotations

import time

import pytest
import torch

from mrl.utils.distributed import LaunchError, launch

pytestmark = pytest.mark.integration


def _sum_of_ranks(rank: int, world: int, scale: float) -> dict[str, object]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return {"rank": rank, "sum": value * scale, "threads": torch.get_num_threads()}


def _rank_one_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one cannot continue")
    return rank


def _rank_zero_hangs(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_come_back_in_rank_order_from_one_world():
    results = launch(_sum_of_ranks, 2, 10.0, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(torch.equal(r["sum"], torch.tensor([10.0])) for r in results)
    assert all(r["threads"] == 1 for r in results)


def test_failing_rank_traceback_is_reported():
    with pytest.raises(LaunchError, match=r"(?s)rank 1/2.*ValueError: rank one cannot continue"):
        launch(_rank_one_fails, 2, timeout_s=120)


def test_hung_rank_is_stopped_at_the_timeout():
    start = time.monotonic()
    # Rank 1 normally reports at once; on a heavily shared machine it may still be importing torch at the deadline.
    with pytest.raises(LaunchError, match=r"ranks \[0(, 1)?\] did not finish within 15 s"):
        launch(_rank_zero_hangs, 2, timeout_s=15)
    assert time.monotonic() - start < 45
