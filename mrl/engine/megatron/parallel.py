"""Process groups for Megatron: torch.distributed (gloo on CPU, NCCL on GPU) plus Megatron's model-parallel mesh.

World = TP × CP × EP-compatible DP × PP; Megatron derives the DP size from the world and the other sizes.
Layouts can be torn down and re-initialised inside the same processes (parity tests walk TP=2, PP=2 and EP=2
in one launch), because importing megatron.core costs about 10 s per process on a small machine.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes; `etp=None` means expert TP equals TP, `vpp=None` means no interleaving."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the default process group (env:// rendezvous: MASTER_ADDR/MASTER_PORT); no-op if already joined.

    The backend defaults to NCCL when CUDA is usable and gloo otherwise; on CUDA the device is LOCAL_RANK.
    """
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(layout: ParallelLayout, *, seed: int = 1234) -> None:
    """Build Megatron's TP/PP/VPP/CP/EP/ETP groups over the joined world and seed the model-parallel RNGs.

    Seeding follows Megatron: the same seed everywhere, offset internally per TP/EP rank, so tensor-parallel
    shards initialise differently while data-parallel replicas agree.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mrl.engine.megatron import cpu_compat

    if not dist.is_initialized():
        raise RuntimeError("init_distributed() must run before initialize_model_parallel()")
    if layout.cp > 1 and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            f"context parallel size {layout.cp} needs TransformerEngine attention (not importable here); "
            "set cp=1 or install transformer_engine"
        )
    world = dist.get_world_size()
    if world % (layout.model_parallel_size()) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {layout.model_parallel_size()}")
    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Drop Megatron's groups but keep the default process group (the next layout re-uses it)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def teardown() -> None:
    """Drop Megatron's groups and leave the default process group."""
    if dist.is_initialized():
        destroy_model_parallel()
        dist.destroy_process_group()
