"""Dispatch planning without Ray: which rank gets which chunk, how results are collected, when padding happens,
and how a future from an earlier call is forwarded."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mrl.controller import splitting
from mrl.controller.decorator import SPEC_ATTR, Dispatch, Execute, get_register_spec, nd_compute, register
from mrl.controller.dispatch import plan_call
from mrl.controller.future import CollectPlan, Gather, GroupFuture, combine
from mrl.controller.mesh import DeviceMesh, DispatchLayout


class Rows:
    """A batch-like object with only the duck-typed interface dispatch relies on (like mrl.data.Batch)."""

    def __init__(self, rows, padded=0):
        self.rows, self.padded = list(rows), padded

    def __len__(self):
        return len(self.rows)

    def chunk(self, n):
        k = len(self) // n
        return [Rows(self.rows[i * k : (i + 1) * k]) for i in range(n)]

    @staticmethod
    def concat(parts):
        return Rows([r for p in parts for r in p.rows])

    def pad_to_divisible(self, n):
        pad = -len(self) % n
        return Rows(self.rows + [None] * pad, pad), pad

    def unpad(self, pad_count):
        return Rows(self.rows[: len(self) - pad_count])


def spec(mode=Dispatch.DP_COMPUTE, **kw):
    @register(mode, **kw)
    def method(self, *a, **k): ...

    return get_register_spec(method)


def plan_dp(world, *args, pad=False, **kwargs):
    return plan_call("m", spec(pad=pad), world, args, kwargs, DispatchLayout.data_parallel(world))


def identity_resolve(handles):
    return list(handles)


# --- splitting ---


@given(st.integers(1, 6), st.integers(0, 30))
def test_pad_split_concat_unpad_round_trips(n, length):
    for data in (list(range(length)), torch.arange(length * 2).reshape(length, 2)):
        padded, pad = splitting.pad_to_divisible(data, n)
        assert splitting.data_len(padded) % n == 0 and pad == -length % n
        parts = splitting.split(padded, n)
        assert len(parts) == n and len({splitting.data_len(p) for p in parts}) == 1
        back = splitting.unpad(splitting.concat(parts), pad)
        assert (back == data) if isinstance(data, list) else torch.equal(back, data)


def test_tensor_chunks_pickle_only_their_own_rows():
    x = torch.zeros(4096, 64)
    sizes = [len(pickle.dumps(c)) for c in splitting.split(x, 4)]
    assert max(sizes) < x.nbytes / 4 + 4096  # a view would carry the whole 1 MiB storage


def test_batch_like_objects_are_split_through_their_own_methods():
    padded, pad = splitting.pad_to_divisible(Rows(range(5)), 4)
    assert pad == 3 and padded.padded == 3
    parts = splitting.split(padded, 4)
    assert [p.rows for p in parts] == [[0, 1], [2, 3], [4, None], [None, None]]
    assert splitting.unpad(splitting.concat(parts), pad).rows == [0, 1, 2, 3, 4]


def test_non_data_arguments_are_not_split():
    for value in ("abc", 3, {"a": [1, 2]}, (1, 2), None):
        assert not splitting.is_data(value)
    assert splitting.is_data([1]) and splitting.is_data(torch.zeros(2, 3)) and splitting.is_data(Rows([1]))


# --- register ---


def test_register_only_tags_the_function():
    def f(self, x):
        return x + 1

    tagged = register(Dispatch.ONE_TO_ALL, blocking=False)(f)
    assert tagged is f and f(None, 1) == 2
    s = getattr(f, SPEC_ATTR)
    assert s.dispatch_mode is Dispatch.ONE_TO_ALL and s.execute_mode is Execute.ALL and s.blocking is False


def test_register_rejects_meaningless_combinations():
    with pytest.raises(ValueError, match="pad=True needs a splitting"):
        register(Dispatch.ONE_TO_ALL, pad=True)
    with pytest.raises(ValueError, match="RANK_ZERO"):
        register(Dispatch.DP_COMPUTE, Execute.RANK_ZERO)
    with pytest.raises(TypeError):
        register("dp")


# --- plans per mode ---


def test_one_to_all_sends_the_same_arguments_to_every_rank():
    p = plan_call("m", spec(Dispatch.ONE_TO_ALL), 4, ([1, 2, 3],), {"k": "v"})
    assert p.ranks == [0, 1, 2, 3] and all(a == ([1, 2, 3],) and k == {"k": "v"} for a, k in zip(p.args, p.kwargs))
    assert combine(p.collect, ["r0", "r1", "r2", "r3"]) == ["r0", "r1", "r2", "r3"]


def test_rank_zero_runs_one_rank_and_returns_its_result_bare():
    p = plan_call("m", spec(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO), 4, (7,), {})
    assert p.ranks == [0] and combine(p.collect, ["only"]) == "only"


def test_all_to_all_gives_item_r_to_rank_r_and_checks_lengths():
    p = plan_call("m", spec(Dispatch.ALL_TO_ALL), 3, (["a", "b", "c"],), {"y": [0, 1, 2]})
    assert p.args == [("a",), ("b",), ("c",)] and p.kwargs == [{"y": 0}, {"y": 1}, {"y": 2}]
    with pytest.raises(ValueError, match=r"argument #0 must be a list with one item per rank \(3\), got list of 2"):
        plan_call("m", spec(Dispatch.ALL_TO_ALL), 3, (["a", "b"],), {})


def test_dp_compute_chunks_in_rank_order_and_broadcasts_non_data():
    x = torch.arange(8).reshape(8, 1)
    p = plan_dp(4, x, list("abcdefgh"), scale=2.0)
    for r in range(4):
        chunk, letters = p.args[r]
        assert torch.equal(chunk, x[2 * r : 2 * r + 2]) and letters == list("abcdefgh")[2 * r : 2 * r + 2]
        assert p.kwargs[r] == {"scale": 2.0}
    assert p.keep == [True] * 4 and p.collect == CollectPlan((0, 1, 2, 3), "concat", 0)


def test_training_call_with_indivisible_batch_names_the_sizes():
    with pytest.raises(ValueError, match=r"m: batch size 10 is not divisible by the data-parallel size 4"):
        plan_dp(4, list(range(10)))


def test_read_only_call_pads_and_collect_strips_the_padding():
    p = plan_dp(4, list(range(10)), pad=True)
    assert p.collect.pad_count == 2
    assert [a[0] for a in p.args] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    outputs = [[v * 10 for v in a[0]] for a in p.args]  # row-aligned outputs, as a log-prob call returns
    assert combine(p.collect, outputs) == [v * 10 for v in range(10)]


def test_data_arguments_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="same number of rows"):
        plan_dp(2, [1, 2], [1, 2, 3, 4])


def test_nd_compute_plan_sends_one_chunk_per_dp_group_and_keeps_only_collect_ranks():
    ms = [DeviceMesh.create({"pp": 2, "dp": 2}, rank=r) for r in range(4)]
    layout = DispatchLayout.from_meshes("actor", ms)
    p = plan_call("m", spec(nd_compute("actor")), 4, (["a", "b", "c", "d"],), {}, layout)
    assert [a[0] for a in p.args] == [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
    assert p.keep == [False, False, True, True]
    # rank outputs as the workers return them: non-collect ranks send None
    assert GroupFuture([None, None, ["A", "B"], ["C", "D"]], p.collect, identity_resolve).get() == ["A", "B", "C", "D"]


def test_non_data_results_of_a_split_call_come_back_as_a_list_in_dp_order():
    p = plan_dp(2, [1, 2])
    assert combine(p.collect, [{"loss": 1.0}, {"loss": 2.0}]) == [{"loss": 1.0}, {"loss": 2.0}]


@given(
    st.permutations(["pp", "dp", "cp", "tp"]),
    st.lists(st.integers(1, 3), min_size=4, max_size=4),
    st.integers(1, 25),
    st.sampled_from(["list", "tensor", "batch"]),
)
def test_identity_call_on_any_mesh_returns_its_input(order, sizes, length, kind):
    """Split → identity on every rank → collect reproduces the batch, padded or not, on any PP/DP/CP/TP layout."""
    dims = dict(zip(order, sizes))
    world = math.prod(sizes)
    layout = DispatchLayout.from_meshes("m", [DeviceMesh.create(dims, rank=r) for r in range(world)])
    rows = list(range(length))
    data = {"list": rows, "tensor": torch.tensor(rows), "batch": Rows(rows)}[kind]
    p = plan_call("m", spec(nd_compute("m"), pad=True), world, (data,), {}, layout)
    # every rank of a DP group got the same chunk
    for r in range(world):
        first = layout.collect_ranks[layout.chunk_of_rank[r]]
        assert p.args[r][0] is p.args[first][0]
    outputs = [a[0] if keep else None for a, keep in zip(p.args, p.keep)]
    back = GroupFuture(outputs, p.collect, identity_resolve).get()
    as_list = back.rows if kind == "batch" else list(map(int, back))
    assert as_list == rows


# --- futures ---


def future_of(parts, how="concat", pad=0):
    return GroupFuture(list(parts), CollectPlan(tuple(range(len(parts))), how, pad), identity_resolve)


def test_future_with_matching_chunks_is_forwarded_chunk_wise_without_resolving():
    fut = future_of([["a", "b"], ["c", "d"]])
    p = plan_dp(2, fut, [1, 2, 3, 4])
    assert p.args == [(["a", "b"], [1, 2]), (["c", "d"], [3, 4])]
    assert not fut._done  # the driver never fetched its value


def test_forwarded_future_makes_the_next_call_wait_for_its_uncollected_ranks():
    # a DP2 x PP2 call: ranks 2, 3 (last stage) were collected, ranks 0, 1 returned None
    fut = GroupFuture(["h0", "h1", "h2", "h3"], CollectPlan((2, 3), "concat"), identity_resolve)
    p = plan_dp(2, fut)
    assert [a[0] for a in p.args] == ["h2", "h3"] and p.after == ["h0", "h1"]
    assert plan_call("m", spec(Dispatch.ONE_TO_ALL), 2, (fut,), {}).after == ["h0", "h1"]
    assert plan_dp(2, [1, 2]).after == []


def test_padded_future_is_forwarded_only_into_a_call_that_accepts_padding():
    fut = future_of([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]], pad=2)
    forwarded = plan_dp(4, fut, pad=True)
    assert forwarded.collect.pad_count == 2 and not fut._done
    with pytest.raises(ValueError, match="batch size 10 is not divisible by the data-parallel size 4"):
        plan_dp(4, future_of(fut.handles, pad=2))


def test_future_is_resolved_by_the_driver_when_chunking_differs():
    fut = future_of([[0, 1, 2, 3], [4, 5, 6, 7]])
    p = plan_dp(4, fut)
    assert fut._done and [a[0] for a in p.args] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_future_into_one_to_all_becomes_a_gather_that_the_worker_resolves():
    fut = future_of([[1, 2], [3]])
    p = plan_call("m", spec(Dispatch.ONE_TO_ALL), 2, (fut,), {})
    gather = p.args[0][0]
    assert isinstance(gather, Gather) and not fut._done
    assert gather.resolve() == [1, 2, 3]


def test_list_future_into_all_to_all_forwards_result_r_to_rank_r():
    fut = future_of(["x0", "x1", "x2"], how="list")
    p = plan_call("m", spec(Dispatch.ALL_TO_ALL), 3, (fut,), {})
    assert p.args == [("x0",), ("x1",), ("x2",)] and not fut._done
