"""Key-value sample store: agent loops put trajectories, workers fetch them by key, the driver moves keys and tags.

Two kinds of Ray actors: `StorageUnit`s hold values (a key lives on unit hash(key) mod #units, so puts and gets
spread out), and one `MetadataService` holds each key's tags (e.g. step, uid, status) so the driver can select
keys without touching data. `SampleStore` is the picklable client every process uses.

A value may be a dict of fields (a trajectory's per-token tensors, mrl/data/samples.py): `get(keys, fields)` ships
only the fields asked for, and `update` adds fields to stored values (a worker's outputs under the sample's key).
For 1-D tensor fields, `put_jagged_async` / `get_jagged` / `update_jagged` move one `JaggedTensor` per field and
storage unit instead of one tensor per sample: pickling cost grows with the number of tensors (measured under load:
512 samples × 3 fields cost 300 ms per fetch one by one, 27 ms as columns).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch

from mrl.data.jagged import JaggedTensor


class StorageUnit:
    # Its module imports torch when the actor starts: a unit unpickling its first tensor would otherwise import it
    # then, seconds on a busy host, stalling the puts of the trajectories that finish first.
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def put(self, items: dict[str, Any]) -> int:
        self.data.update(items)
        return len(items)

    def get(self, keys: Sequence[str], fields: Sequence[str] | None = None) -> list[Any]:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise KeyError(f"sample store: no values for keys {missing[:8]}")
        if fields is None:
            return [self.data[k] for k in keys]
        absent = sorted({f for k in keys for f in fields if f not in self.data[k]})
        if absent:
            raise KeyError(f"sample store: fields {absent} missing from some of the keys {list(keys)[:8]}")
        return [{f: self.data[k][f] for f in fields} for k in keys]

    def get_jagged(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, JaggedTensor]:
        rows = self.get(keys, fields)
        return {f: JaggedTensor.from_list([r[f] for r in rows]) for f in fields}

    def put_jagged(self, keys: Sequence[str], columns: dict[str, JaggedTensor], new: bool = True) -> int:
        """Row i of each column becomes that field of keys[i]: a new value (`new`), else added to the stored one."""
        # clone: a row of the column is a view, and a later `get` of it would pickle the whole column
        rows = {k: {f: j[i].clone() for f, j in columns.items()} for i, k in enumerate(keys)}
        return self.put(rows) if new else self.update(rows)

    def put_copies(self, keys: Sequence[str], values: list[Any]) -> int:
        """`values[0]` (another unit's `get` of one key, resolved by Ray) under each of `keys`."""
        return self.put({k: values[0] for k in keys})

    def update(self, fields_by_key: dict[str, dict[str, Any]]) -> int:
        missing = [k for k in fields_by_key if k not in self.data]
        if missing:
            raise KeyError(f"sample store: cannot add fields to absent keys {missing[:8]}")
        for key, fields in fields_by_key.items():
            self.data[key] = {**self.data[key], **fields}
        return len(fields_by_key)

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def size(self) -> int:
        return len(self.data)


class MetadataService:
    def __init__(self) -> None:
        self.tags: dict[str, dict[str, Any]] = {}

    def register(self, tags_by_key: dict[str, dict[str, Any]]) -> None:
        for key, tags in tags_by_key.items():
            self.tags.setdefault(key, {}).update(tags)

    def select(self, where: dict[str, Any]) -> list[str]:
        """Keys whose tags match every (tag, value) of `where`, in insertion order."""
        return [k for k, t in self.tags.items() if all(t.get(name) == v for name, v in where.items())]

    def size(self) -> int:
        return len(self.tags)

    def tags_of(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        return [dict(self.tags[k]) for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.tags.pop(k, None)


class SampleStore:
    def __init__(self, units: list[Any], metadata: Any) -> None:
        self.units = units
        self.metadata = metadata

    @classmethod
    def create(cls, num_units: int = 2) -> SampleStore:
        """Start the actors (without waiting for them: `wait_ready`)."""
        unit = ray.remote(StorageUnit).options(num_cpus=0)
        return cls([unit.remote() for _ in range(num_units)], ray.remote(MetadataService).options(num_cpus=0).remote())

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every actor of the store has started and answers this process."""
        ray.get([u.size.remote() for u in self.units] + [self.metadata.size.remote()], timeout=timeout_s)

    def _unit_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.units)

    def _positions_by_unit(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Positions in `keys` grouped by the unit holding each key (repeated keys keep every position)."""
        positions: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            positions.setdefault(self._unit_of(k), []).append(i)
        return positions

    def _by_unit(self, keys: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for k in keys:
            groups.setdefault(self._unit_of(k), []).append(k)
        return groups

    def put(self, items: dict[str, Any], tags: dict[str, dict[str, Any]] | None = None) -> list[str]:
        """Store values by key (values first, then tags, so a key that can be selected can always be read)."""
        ray.get([self.units[u].put.remote({k: items[k] for k in ks}) for u, ks in self._by_unit(items).items()])
        ray.get(self.metadata.register.remote({k: (tags or {}).get(k, {}) for k in items}))
        return list(items)

    async def put_jagged_async(self, keys: Sequence[str], columns: dict[str, JaggedTensor]) -> None:
        """New dict values from columns aligned with `keys` (see `update_jagged`), from a coroutine (an agent-loop
        actor): awaits instead of blocking its event loop."""
        for ref in self._jagged_refs(keys, columns, new=True):
            await ref
        await self.metadata.register.remote({k: {} for k in keys})

    def copy(self, sources: dict[str, str]) -> None:
        """Store the value of key `src` under key `dst` too, for each dst → src. A value moves from its unit to the
        destination's as an object reference: it never passes through this process (the driver)."""
        by_source: dict[str, list[str]] = {}
        for dst, src in sources.items():
            by_source.setdefault(src, []).append(dst)
        refs = []
        for src, dsts in by_source.items():
            value = self.units[self._unit_of(src)].get.remote([src])
            refs += [self.units[u].put_copies.remote(ks, value) for u, ks in self._by_unit(dsts).items()]
        ray.get(refs)
        ray.get(self.metadata.register.remote({k: {} for k in sources}))

    def get(self, keys: Sequence[str], fields: Sequence[str] | None = None) -> list[Any]:
        """Values in the order of `keys`; with `fields`, only those entries of each (dict) value."""
        groups = self._by_unit(keys)
        refs = [self.units[u].get.remote(ks, None if fields is None else list(fields)) for u, ks in groups.items()]
        fetched = dict(zip(groups, ray.get(refs)))
        values = {k: v for u, ks in groups.items() for k, v in zip(ks, fetched[u])}
        return [values[k] for k in keys]

    def get_jagged(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, JaggedTensor]:
        """1-D tensor `fields` of `keys` (repeats allowed), one JaggedTensor per field with rows in `keys` order."""
        positions = self._positions_by_unit(keys)
        parts = ray.get([self.units[u].get_jagged.remote([keys[i] for i in ps], list(fields))
                         for u, ps in positions.items()])
        # rows arrive grouped by unit; row r of the request is row inverse[r] of their concatenation
        arrival = torch.tensor([i for ps in positions.values() for i in ps], dtype=torch.long)
        inverse = torch.empty_like(arrival)
        inverse[arrival] = torch.arange(len(arrival))
        return {f: JaggedTensor.cat([part[f] for part in parts]).index_select(inverse) for f in fields}

    def update_jagged(self, keys: Sequence[str], columns: dict[str, JaggedTensor]) -> None:
        """`update` from columns aligned with `keys`: row i of each column becomes that field of keys[i]."""
        ray.get(self._jagged_refs(keys, columns, new=False))

    def _jagged_refs(self, keys: Sequence[str], columns: dict[str, JaggedTensor], new: bool) -> list[Any]:
        return [self.units[u].put_jagged.remote([keys[i] for i in ps],
                                                {f: j.index_select(torch.tensor(ps)) for f, j in columns.items()}, new)
                for u, ps in self._positions_by_unit(keys).items()]

    def update(self, fields_by_key: dict[str, dict[str, Any]]) -> None:
        """Add (or replace) fields of stored dict values: {key: {field: value}}."""
        refs = [self.units[u].update.remote({k: fields_by_key[k] for k in ks})
                for u, ks in self._by_unit(fields_by_key).items()]
        ray.get(refs)

    def size(self) -> dict[str, int]:
        """Keys held by the storage units and by the metadata service (both 0 once every step cleaned up)."""
        return {"values": sum(ray.get([u.size.remote() for u in self.units])),
                "tags": ray.get(self.metadata.size.remote())}

    def select(self, **where: Any) -> list[str]:
        return ray.get(self.metadata.select.remote(where))

    def tag(self, keys: Sequence[str], **tags: Any) -> None:
        ray.get(self.metadata.register.remote({k: tags for k in keys}))

    def tags(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        return ray.get(self.metadata.tags_of.remote(list(keys)))

    def delete(self, keys: Sequence[str]) -> int:
        ray.get(self.metadata.remove.remote(list(keys)))
        return sum(ray.get([self.units[u].delete.remote(ks) for u, ks in self._by_unit(keys).items()]))

    def shutdown(self) -> None:
        for actor in [*self.units, self.metadata]:
            ray.kill(actor)
