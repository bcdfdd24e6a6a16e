"""The Bridge: one HF architecture's config translation and mapping table, and what they drive.

A family declares two things (see bridges/families/): `config_fields()` (HF config → TransformerConfig fields
and GPTModel keyword arguments) and `mappings()` (a list of primitives from `bridges.mapping`). The same table
drives `load_hf` (each rank reads only its slices), `export` (HF-named stream from any layout, in
`bridges.export`) and `save_hf`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from bridges.hf_io import HFCheckpoint, ReadStats, copy_hf_metadata, write_safetensors
from bridges.mapping import Mapping, ModelShape, Replicated, Shard
from bridges.names import LocalTensor, local_tensors


class UnmappedParametersError(ValueError):
    """Megatron parameters that no mapping of the bridge covers."""


@dataclass(frozen=True)
class Resolved:
    mapping: Mapping
    indices: tuple[int, ...]


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings of an HF config (transformers 5: `rope_parameters`; older: rope_theta + rope_scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


# Megatron's Llama-3 RoPE scaling has these constants built in; other values cannot be expressed.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """GPTModel RoPE arguments: plain RoPE or Llama-3 scaling; anything else raises NotImplementedError."""
    rope = rope_parameters(hf_config)
    kwargs: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": int(rope["rope_theta"])}
    if rope["rope_type"] == "llama3":
        fixed = {k: rope.get(k) for k in _MEGATRON_LLAMA3_ROPE}
        if fixed != _MEGATRON_LLAMA3_ROPE:
            raise NotImplementedError(f"Llama-3 RoPE {fixed} differs from Megatron's {_MEGATRON_LLAMA3_ROPE}")
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif rope["rope_type"] != "default":
        raise NotImplementedError(f"RoPE type {rope['rope_type']!r} of {type(hf_config).__name__}")
    return kwargs


class Bridge:
    """Base class of a family bridge. Subclasses set `architectures` and implement the two declarations."""

    architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self._table: list[Mapping] | None = None
        self._export_plans: dict[Any, Any] = {}
        # HF tensors a folder may lack: their parameters then keep the initialisation they were built with.
        self.optional_hf_names: set[str] = set()
        self.ignored: set[str] = set()  # HF tensors of the folder that this model has no parameter for

    # ---- declarations (per family) -------------------------------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        """Architecture fields of the TransformerConfig (no parallel sizes, dtypes or fusion switches)."""
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of GPTModel: vocab size, positions, RoPE, tied embeddings."""
        raise NotImplementedError

    def mappings(self) -> list[Mapping]:
        raise NotImplementedError

    def config_class(self) -> type:
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    # ---- generic --------------------------------------------------------------------------------------------
    def value_model(self) -> Bridge:
        """This family as a value model (the critic): HF's `…ForTokenClassification` with one label. The
        vocabulary projection is gone (a causal-LM folder's lm_head is not read, and nothing is tied to the
        embedding); in its place the last stage's `output_layer` is the score head `score.weight` [1, H]
        (+ `score.bias`), replicated over TP, read where the folder has one and left as initialised where it has
        not."""
        value = copy.copy(self)
        value.hf_config = copy.copy(self.hf_config)
        value.hf_config.tie_word_embeddings = False
        head = [Replicated("output_layer.weight", "score.weight"), Replicated("output_layer.bias", "score.bias")]
        value._table = [m for m in value.mappings() if m.match("output_layer.weight") is None] + head
        value._export_plans = {}
        value.optional_hf_names = {"score.weight", "score.bias"}
        value.ignored = {"lm_head.weight"}
        return value

    def transformer_config(self, **runtime: Any) -> Any:
        """The TransformerConfig: the family's architecture fields, then runtime fields (layout, dtype...)."""
        return self.config_class()(**{**self.config_fields(), **runtime})

    @property
    def table(self) -> list[Mapping]:
        if self._table is None:
            self._table = self.mappings()
        return self._table

    def resolve(self, megatron_name: str) -> Resolved | None:
        for mapping in self.table:
            indices = mapping.match(megatron_name)
            if indices is not None:
                return Resolved(mapping, indices)
        return None

    def local_tensors(self, chunks: Sequence[torch.nn.Module]) -> list[LocalTensor]:
        from megatron.core import parallel_state as ps

        ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        return [t for chunk in chunks for t in local_tensors(chunk, ep_rank, ep_size)]

    def check_coverage(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Raise UnmappedParametersError listing every parameter of `chunks` that no mapping covers.

        Persistent buffers are covered only where a mapping names them (Megatron keeps counters as buffers).
        """
        params = {id(p) for chunk in chunks for p in chunk.parameters()}
        missing = sorted(
            t.name for t in self.local_tensors(chunks) if id(t.tensor) in params and self.resolve(t.name) is None
        )
        if missing:
            raise UnmappedParametersError(
                f"{type(self).__name__} ({', '.join(self.architectures) or 'unregistered'}) leaves "
                f"{len(missing)} Megatron parameter(s) unmapped: {missing}"
            )

    def model_shape(self, config: Any) -> ModelShape:
        return ModelShape(
            config.num_attention_heads, config.num_query_groups or config.num_attention_heads, config.kv_channels
        )

    def chunk_shape(self, chunks: Sequence[torch.nn.Module]) -> ModelShape:
        """`model_shape` of built chunks, with the HF vocabulary and the model's padded one (build_model)."""
        chunk = _unwrap(chunks[0])
        padded = getattr(chunk, "vocab_size", 0)
        return replace(self.model_shape(chunk.config), vocab=self.hf_config.vocab_size, padded_vocab=padded)

    @staticmethod
    def shard_of(tensor: LocalTensor) -> Shard:
        from megatron.core import parallel_state as ps

        if tensor.is_expert:
            return Shard(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
        return Shard(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())

    @torch.no_grad()
    def load_hf(self, chunks: Sequence[torch.nn.Module], folder: str | os.PathLike[str]) -> ReadStats:
        """Fill this rank's model chunks from an HF folder, one parameter at a time, reading only own slices.

        Returns the reader's byte counters (total read, peak alive) for this rank. Collective when
        torch.distributed is initialised: the ranks pool the HF names they read, and a checkpoint tensor that no
        rank read (a config translation that dropped a feature, say) fails the import with the list of names.
        """
        self.check_coverage(chunks)
        shape = self.chunk_shape(chunks)
        used: set[str] = set()
        with HFCheckpoint(folder) as checkpoint:
            for tensor in self.local_tensors(chunks):
                resolved = self.resolve(tensor.name)
                if resolved is None:
                    continue  # an unmapped buffer (router counters): state, not weights
                names = resolved.mapping.hf_names(resolved.indices)
                if not any(n in checkpoint for n in names) and set(names) <= self.optional_hf_names:
                    continue
                used.update(names)
                value = resolved.mapping.load([checkpoint(n) for n in names], self.shard_of(tensor), shape)
                if value.shape != tensor.tensor.shape:
                    raise ValueError(
                        f"{tensor.local_name} ({tensor.name}): HF {names} give shape {tuple(value.shape)}, "
                        f"the model expects {tuple(tensor.tensor.shape)}"
                    )
                tensor.tensor.copy_(value)
                del value
            self._check_all_read(checkpoint.names(), used)
            return checkpoint.stats

    def ignored_hf_names(self, names: set[str]) -> set[str]:
        """Checkpoint tensors that are deliberately not imported (a tied model's stored lm_head copy)."""
        tied = {"lm_head.weight"} if getattr(self.hf_config, "tie_word_embeddings", False) else set()
        return (tied | self.ignored) & names

    def _check_all_read(self, names: set[str], used: set[str]) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            pooled: list[set[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(pooled, used)
            used = set().union(*(p or set() for p in pooled))
        unread = sorted(names - used - self.ignored_hf_names(names))
        if unread:
            raise ValueError(
                f"{type(self).__name__}: {len(unread)} checkpoint tensor(s) map to no Megatron parameter of this "
                f"model (check the config translation and the table): {unread}"
            )

    def export(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        dtype: torch.dtype | None = None,
        tp_slices: bool = False,
        row_blocks: bool = False,
    ) -> Iterator[tuple]:
        """Every HF tensor as (hf_name, tensor), on every rank (collective: all ranks must iterate it fully).

        Gathers over TP / expert-TP, gathers experts over EP, broadcasts from the owning PP stage. Tensors
        may be views of parameters when no gather was needed: copy them if the model changes meanwhile.
        `tp_slices`: dense TP-split tensors come as (hf_name, this rank's slice, TpSlice) instead (every rank
        must pass the same value); `row_blocks`: fused QKV's q/k/v as uncopied [groups, rows, *rest] views
        tagged ROW_BLOCKS, for a consumer that places rows itself (bridges/export.py).
        """
        from bridges.export import export_stream

        return export_stream(self, chunks, dtype=dtype, tp_slices=tp_slices, row_blocks=row_blocks)

    def export_plan(self, chunks: Sequence[torch.nn.Module], *, dtype: torch.dtype | None = None) -> Any:
        """The export plan (collective the first time, then cached): every unit's HF names, shapes and bytes,
        known before any tensor moves, e.g. to size receive buffers on a rollout replica."""
        from bridges.export import plan_for

        return plan_for(self, chunks, dtype)

    def export_buckets(
        self,
        chunks: Sequence[torch.nn.Module],
        bucket_bytes: int,
        *,
        dtype: torch.dtype | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The export stream grouped into buckets of at most `bucket_bytes` (a bigger tensor gets its own).

        The bucket boundaries come from the export plan, computed once per model and dtype.
        """
        from bridges.export import export_buckets

        return export_buckets(self, chunks, bucket_bytes, dtype=dtype)

    def save_hf(
        self,
        chunks: Sequence[torch.nn.Module],
        folder: str | os.PathLike[str],
        *,
        source: str | os.PathLike[str] | None = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 * 1024**3,
    ) -> None:
        """Write a loadable HF checkpoint: config, tokenizer files copied from `source`, safetensors.

        Collective: every rank iterates the export stream; global rank 0 writes.
        """
        writer = dist.get_rank() == 0 if dist.is_initialized() else True
        stream = self.export(chunks, dtype=dtype)
        if not writer:
            for _ in stream:
                pass
            return
        out = Path(folder)
        if source is not None:
            copy_hf_metadata(source, out)
        config = copy.deepcopy(self.hf_config)
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(str(out))
        write_safetensors(stream, out, max_shard_bytes=max_shard_bytes)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

