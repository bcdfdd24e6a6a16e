"""Key-value sample store: agent loops put trajectories, workers fetch them by key, the driver moves keys and tags.

Two kinds of Ray actors: `StorageUnit`s hold values (a key lives on unit hash(key) mod #units, so puts and gets
spread out), and one `MetadataService` holds each key's tags (e.g. step, uid, status) so the driver can select
keys without touching data. `SampleStore` is the picklable client every process uses.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import ray


class StorageUnit:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def put(self, items: dict[str, Any]) -> int:
        self.data.update(items)
        return len(items)

    def get(self, keys: Sequence[str]) -> list[Any]:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise KeyError(f"sample store: no values for keys {missing[:8]}")
        return [self.data[k] for k in keys]

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
        unit = ray.remote(StorageUnit).options(num_cpus=0)
        return cls([unit.remote() for _ in range(num_units)], ray.remote(MetadataService).options(num_cpus=0).remote())

    def _unit_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.units)

    def _by_unit(self, keys: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for k in keys:
            groups.setdefault(self._unit_of(k), []).append(k)
        return groups

    def put(self, items: dict[str, Any], tags: dict[str, dict[str, Any]] | None = None) -> list[str]:
        """Store values by key (values first, then tags, so a key that can be selected can always be read)."""
        refs = [self.units[u].put.remote({k: items[k] for k in ks}) for u, ks in self._by_unit(items).items()]
        ray.get(refs)
        ray.get(self.metadata.register.remote({k: (tags or {}).get(k, {}) for k in items}))
        return list(items)

    def get(self, keys: Sequence[str]) -> list[Any]:
        groups = self._by_unit(keys)
        fetched = dict(zip(groups, ray.get([self.units[u].get.remote(ks) for u, ks in groups.items()])))
        values = {k: v for u, ks in groups.items() for k, v in zip(ks, fetched[u])}
        return [values[k] for k in keys]

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
