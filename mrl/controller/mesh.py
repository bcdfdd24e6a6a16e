"""Named device meshes: a rank's coordinates in a PP × DP × CP × TP × EP layout, and the dispatch layout
a group derives from all ranks' meshes.

Convention (`DeviceMesh`): `dims` is ordered slowest to fastest, so for dims (d_0, …, d_k) with sizes
(s_0, …, s_k) a rank's coordinates c satisfy rank = ((c_0·s_1 + c_1)·s_2 + …)·s_k + c_k.
Megatron's default rank order "tp-cp-ep-dp-pp" (tp fastest) is dims {"pp", "dp", "ep", "cp", "tp"}.

Data axes are "dp" and "ep": in Megatron expert parallelism is carved out of data parallelism, so ranks that
differ in either coordinate see different data; their DP index is the row-major index over those two dims.
TP, CP and PP ranks of one DP group get the same chunk; the collected rank has tp = 0, cp = 0 and the last
pp stage (where the outputs of the pipeline exist).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MESH_DIMS = ("pp", "dp", "cp", "tp", "ep")
DATA_DIMS = ("dp", "ep")


@dataclass(frozen=True)
class DeviceMesh:
    dims: tuple[tuple[str, int], ...]
    coords: tuple[tuple[str, int], ...]

    @classmethod
    def create(cls, dims: Mapping[str, int], coords: Mapping[str, int] | None = None, rank: int | None = None):
        """Build from dims (ordered slowest → fastest) and either explicit coords or this rank's global rank."""
        if not dims:
            raise ValueError("a device mesh needs at least one dimension")
        unknown = [d for d in dims if d not in MESH_DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; allowed: {list(MESH_DIMS)}")
        bad = {d: s for d, s in dims.items() if not isinstance(s, int) or s < 1}
        if bad:
            raise ValueError(f"mesh dimension sizes must be positive ints, got {bad}")
        if coords is None:
            if rank is None:
                raise ValueError("give either coords or rank")
            coords = coords_of_rank(dims, rank)
        if set(coords) != set(dims):
            raise ValueError(f"coords {dict(coords)} must name exactly the mesh dims {list(dims)}")
        out_of_range = {d: c for d, c in coords.items() if not 0 <= c < dims[d]}
        if out_of_range:
            raise ValueError(f"coords {out_of_range} outside the mesh {dict(dims)}")
        return cls(tuple(dims.items()), tuple((d, coords[d]) for d in dims))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def coord(self) -> dict[str, int]:
        return dict(self.coords)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.dims)

    @property
    def dp_size(self) -> int:
        return math.prod(s for d, s in self.dims if d in DATA_DIMS)

    @property
    def dp_rank(self) -> int:
        index = 0
        for d, s in self.dims:
            if d in DATA_DIMS:
                index = index * s + self.coord[d]
        return index

    @property
    def is_collect(self) -> bool:
        c, s = self.coord, self.sizes
        return c.get("tp", 0) == 0 and c.get("cp", 0) == 0 and c.get("pp", 0) == s.get("pp", 1) - 1


def coords_of_rank(dims: Mapping[str, int], rank: int) -> dict[str, int]:
    """Inverse of the row-major rank formula in the module docstring."""
    total = math.prod(dims.values())
    if not 0 <= rank < total:
        raise ValueError(f"rank {rank} outside a mesh of {total} ranks {dict(dims)}")
    coords = {}
    for d, s in reversed(list(dims.items())):
        coords[d] = rank % s
        rank //= s
    return {d: coords[d] for d in dims}


@dataclass(frozen=True)
class DispatchLayout:
    """How a splitting call maps chunks onto ranks.

    chunk_of_rank[r]: the chunk index rank r receives; collect_ranks[i]: the rank whose output is chunk i's.
    """

    chunk_of_rank: tuple[int, ...]
    collect_ranks: tuple[int, ...]

    @property
    def n_chunks(self) -> int:
        return len(self.collect_ranks)

    @classmethod
    def data_parallel(cls, world_size: int) -> DispatchLayout:
        return cls(tuple(range(world_size)), tuple(range(world_size)))

    @classmethod
    def from_meshes(cls, name: str, meshes: Sequence[DeviceMesh | None]) -> DispatchLayout:
        """Derive the layout from the mesh `name` as registered by each rank (index = rank)."""
        missing = [r for r, m in enumerate(meshes) if m is None]
        if missing:
            raise RuntimeError(
                f"mesh {name!r} is not registered on rank(s) {missing}; call register_mesh({name!r}, ...) "
                "in every worker (e.g. in init_model) before an nd_compute call"
            )
        first = meshes[0]
        if any(m.dims != first.dims for m in meshes):
            raise RuntimeError(f"mesh {name!r}: ranks registered different dims: {sorted({m.dims for m in meshes})}")
        if first.size != len(meshes):
            raise RuntimeError(f"mesh {name!r} {first.sizes} has {first.size} ranks but the group has {len(meshes)}")
        if len({m.coords for m in meshes}) != len(meshes):
            raise RuntimeError(f"mesh {name!r}: two ranks registered the same coordinates")
        collect: list[int | None] = [None] * first.dp_size
        for r, m in enumerate(meshes):
            if m.is_collect:
                collect[m.dp_rank] = r  # unique: coords are distinct and the collect coords pin tp, cp and pp
        return cls(tuple(m.dp_rank for m in meshes), tuple(collect))
