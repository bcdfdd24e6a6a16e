"""Mesh arithmetic: rank ↔ coordinates, DP index, collect rank, and the dispatch layout a group derives."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mrl.controller.mesh import MESH_DIMS, DeviceMesh, DispatchLayout, coords_of_rank


def meshes(dims: dict[str, int]) -> list[DeviceMesh]:
    return [DeviceMesh.create(dims, rank=r) for r in range(math.prod(dims.values()))]


@given(
    st.lists(st.sampled_from(MESH_DIMS), min_size=1, max_size=5, unique=True).flatmap(
        lambda names: st.tuples(st.just(names), st.lists(st.integers(1, 3), min_size=len(names), max_size=len(names)))
    )
)
def test_coords_follow_row_major_rank_order(names_sizes):
    names, sizes = names_sizes
    dims = dict(zip(names, sizes))
    # Enumerating coordinates with the first dim slowest must reproduce ranks 0, 1, 2, ...
    expected = [dict(zip(names, c)) for c in itertools.product(*(range(s) for s in sizes))]
    assert [coords_of_rank(dims, r) for r in range(math.prod(sizes))] == expected


def test_dp_by_tp_layout_gives_tp_ranks_the_same_chunk_and_collects_tp0():
    layout = DispatchLayout.from_meshes("actor", meshes({"dp": 2, "tp": 2}))
    assert layout.chunk_of_rank == (0, 0, 1, 1)
    assert layout.collect_ranks == (0, 2)


def test_dp_by_pp_layout_collects_from_last_stage():
    layout = DispatchLayout.from_meshes("actor", meshes({"pp": 2, "dp": 2}))
    # ranks: (pp0,dp0)=0 (pp0,dp1)=1 (pp1,dp0)=2 (pp1,dp1)=3
    assert layout.chunk_of_rank == (0, 1, 0, 1)
    assert layout.collect_ranks == (2, 3)


def test_pp_dp_cp_tp_layout_collects_tp0_cp0_last_stage_in_dp_order():
    dims = {"pp": 2, "dp": 2, "cp": 2, "tp": 2}
    ms = meshes(dims)
    layout = DispatchLayout.from_meshes("train", ms)
    assert layout.n_chunks == 2
    for dp, rank in enumerate(layout.collect_ranks):
        assert ms[rank].coord == {"pp": 1, "dp": dp, "cp": 0, "tp": 0}
    for rank, m in enumerate(ms):
        assert layout.chunk_of_rank[rank] == m.coord["dp"]


def test_expert_parallel_ranks_are_data_parallel():
    # EP is carved out of DP in Megatron: ranks that differ in ep see different data.
    ms = meshes({"dp": 2, "ep": 2, "tp": 2})
    layout = DispatchLayout.from_meshes("moe", ms)
    assert layout.n_chunks == 4
    assert [ms[r].coord for r in layout.collect_ranks] == [
        {"dp": d, "ep": e, "tp": 0} for d in range(2) for e in range(2)
    ]


def test_explicit_coords_override_rank_order():
    # A worker may register coordinates that do not follow its global rank (e.g. a custom rank order).
    ms = [DeviceMesh.create({"dp": 2, "tp": 2}, coords={"dp": r % 2, "tp": r // 2}) for r in range(4)]
    layout = DispatchLayout.from_meshes("x", ms)
    assert layout.chunk_of_rank == (0, 1, 0, 1)
    assert layout.collect_ranks == (0, 1)


def test_layout_errors_name_the_problem():
    with pytest.raises(RuntimeError, match=r"not registered on rank\(s\) \[1\]"):
        DispatchLayout.from_meshes("actor", [meshes({"dp": 2})[0], None])
    with pytest.raises(RuntimeError, match="same coordinates"):
        DispatchLayout.from_meshes("actor", [DeviceMesh.create({"dp": 2}, coords={"dp": 0})] * 2)
    with pytest.raises(RuntimeError, match="has 4 ranks but the group has 2"):
        DispatchLayout.from_meshes("actor", meshes({"dp": 2, "tp": 2})[:2])
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        DeviceMesh.create({"dp": 2, "xp": 2}, rank=0)
    with pytest.raises(ValueError, match="outside the mesh"):
        DeviceMesh.create({"dp": 2}, coords={"dp": 2})
