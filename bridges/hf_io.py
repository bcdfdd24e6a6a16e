"""HF folders on disk: lazy, slice-wise reads of (sharded) safetensors, and writing a loadable checkpoint.

Reads go through `safe_open(...).get_slice(name)`, so indexing a tensor reads only that slice. The reader
counts the bytes it hands out that are still alive (weak references), so a test can prove that an import
never held more than a bound at once.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mrl.utils.buckets import group_by_bytes

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Files an HF folder carries besides weights and config; copied by save_hf when present.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
    "generation_config.json",
)


class ReadStats:
    """Bytes read from disk: in total, alive now (not yet garbage), and the peak of alive bytes."""

    def __init__(self) -> None:
        self.total = 0
        self.alive = 0
        self.peak = 0

    def _add(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.total += nbytes
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.alive -= nbytes


class _LazySlice:
    def __init__(self, handle: Any, name: str, stats: ReadStats) -> None:
        self._slice = handle.get_slice(name)
        self._stats = stats
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            index = tuple(slice(None) for _ in self.shape)
        tensor = self._slice[index]
        self._stats._add(tensor)
        return tensor


class HFCheckpoint:
    """An HF model folder opened for slice-wise reading; a context manager that closes its file handles."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.stats = ReadStats()
        index = self.folder / _INDEX
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / _SINGLE).exists():
            with safe_open(str(self.folder / _SINGLE), "pt") as handle:
                self.weight_map = {name: _SINGLE for name in handle.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(f"{self.folder} has neither {_INDEX} nor {_SINGLE}")
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> set[str]:
        return set(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __call__(self, name: str) -> _LazySlice:
        """The lazy tensor `name`; index it to read (only) a slice."""
        if name not in self.weight_map:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.folder}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(str(self.folder / file), "pt"))
        return _LazySlice(self._handles[file], name, self.stats)


def copy_hf_metadata(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Copy config.json and tokenizer/generation files of an HF folder (those that exist)."""
    src, dst = Path(source), Path(target)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *_TOKENIZER_FILES):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[str]:
    """Write a (name, tensor) stream as HF safetensors shards plus an index when there are several.

    Tensors are held only until their shard is written, so memory stays near one shard. Returns file names.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    files: list[str] = []
    total = 0
    # Moved to host as they arrive, so the stream's device tensors are freed while a shard fills.
    on_host = ((name, tensor.detach().to("cpu").contiguous()) for name, tensor in _unique(tensors))
    for group in group_by_bytes(on_host, max_shard_bytes):
        shard = dict(group)
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    if len(files) == 1:
        (out / files[0]).rename(out / _SINGLE)
        return [_SINGLE]
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return files


def _unique(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight stream")
        seen.add(name)
        yield name, tensor
