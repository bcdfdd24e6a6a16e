"""`mrl convert`: HF ⇄ Megatron dist-checkpoint at any TP/PP/EP, and RL (engine) checkpoints → HF for serving.

    mrl convert to-megatron HF_DIR OUT_DIR --tp 2 --pp 1 --ep 1
    mrl convert to-hf CKPT_DIR OUT_DIR [--hf-config HF_DIR] [--peft PEFT_DIR] [--tp 1 ...]

Both directions run the bridge of the model's family (bridges/) inside N local processes that form one
torch.distributed world (gloo on CPU, NCCL on GPU; mrl/utils/distributed.py), N = PP × lcm(TP, EP × expert-TP):
each rank reads only its slices of the HF safetensors, and the checkpoint is written with Megatron's
dist-checkpointing (mrl/engine/megatron/checkpoint.py), so it loads under any other layout later. Under torchrun
(`torchrun --nproc-per-node N -m mrl.tools.convert ...`, e.g. across nodes) the ranks are torchrun's.

A Megatron checkpoint written here carries `hf_config/` (the HF config and tokenizer files) and
`mrl_convert.json` (layout and dtype), so `to-hf` needs no other input. An RL checkpoint written by the engine
(`save_checkpoint`: model, optimizer, LR schedule) has neither: pass `--hf-config` (the run's model.path) and the
layout it was saved with when it used virtual pipeline stages; only the model weights are read. A LoRA run's
checkpoint (`lora.json` beside it) exports the merged model: base + (alpha / rank)·B·A in every adapted weight;
with `--peft` also the adapters alone as an HF PEFT folder (what actor.lora.sync=adapter hands vLLM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METADATA = "mrl_convert.json"
HF_CONFIG_DIR = "hf_config"


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    first: int | None = None  # layers of the first pipeline stage (uneven split); None: even
    last: int | None = None  # layers of the last pipeline stage
    vocab_divisor: int = 1  # the training run's make_vocab_size_divisible_by: the padded rows must match

    def stage_fields(self) -> dict[str, int]:
        """The uneven split as TransformerConfig fields (those that are set)."""
        split = {"num_layers_in_first_pipeline_stage": self.first, "num_layers_in_last_pipeline_stage": self.last}
        return {k: v for k, v in split.items() if v is not None}

    def world_size(self) -> int:
        """Fewest processes that hold this layout: PP stages of lcm(TP, EP × expert-TP) ranks (the rest is DP)."""
        return self.pp * math.lcm(self.tp, self.ep * (self.etp or self.tp))


@dataclass(frozen=True)
class ToMegatron:
    hf: str
    out: str
    layout: Layout = field(default_factory=Layout)
    dtype: str | None = None  # None: the HF config's dtype


@dataclass(frozen=True)
class ToHF:
    checkpoint: str
    out: str
    layout: Layout = field(default_factory=Layout)
    hf_config: str | None = None  # None: <checkpoint>/hf_config
    dtype: str | None = None  # None: the recorded dtype, else the HF config's
    peft: str | None = None  # a LoRA run's checkpoint: also write its adapters as an HF PEFT folder here


def _torch_dtype(name: str | None, hf_config: Any) -> Any:
    import torch

    if name is None:
        name = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")
    return getattr(torch, name.removeprefix("torch."))


def _build(hf_folder: str, layout: Layout, dtype_name: str | None) -> tuple[Any, list[Any], Any]:
    """(bridge, model chunks of this rank, dtype) under `layout`, with the engine's layer spec."""
    from bridges import bridge_from_hf
    from mrl.engine.megatron.engine import build_chunks
    from mrl.engine.megatron.model import runtime_config
    from mrl.engine.megatron.parallel import ParallelLayout, initialize_model_parallel

    parallel = ParallelLayout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, etp=layout.etp)
    initialize_model_parallel(parallel)
    bridge = bridge_from_hf(hf_folder)
    dtype = _torch_dtype(dtype_name, bridge.hf_config)
    fields = runtime_config(parallel, params_dtype=dtype, **layout.stage_fields())
    chunks = build_chunks(bridge.transformer_config(**fields), bridge.model_kwargs(), layout.vocab_divisor)
    return bridge, chunks, dtype


def to_megatron(step: ToMegatron) -> None:
    import torch.distributed as dist

    from bridges.hf_io import copy_hf_metadata
    from mrl.engine.megatron import checkpoint

    bridge, chunks, dtype = _build(step.hf, step.layout, step.dtype)
    bridge.load_hf(chunks, step.hf)
    checkpoint.save(step.out, chunks)
    if dist.get_rank() == 0:
        copy_hf_metadata(step.hf, Path(step.out) / HF_CONFIG_DIR)
        meta = {"layout": asdict(step.layout), "dtype": str(dtype).removeprefix("torch."),
                "architecture": type(bridge).__name__, "source": os.path.abspath(step.hf)}
        (Path(step.out) / METADATA).write_text(json.dumps(meta, indent=2) + "\n")


def to_hf(step: ToHF) -> None:
    from mrl.engine.megatron import checkpoint, lora

    hf_config = step.hf_config or str(Path(step.checkpoint) / HF_CONFIG_DIR)
    if not (Path(hf_config) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_config}: pass --hf-config (the run's HF model folder)")
    recorded = read_metadata(step.checkpoint).get("dtype")
    bridge, chunks, dtype = _build(hf_config, step.layout, step.dtype or recorded)
    settings = lora.read_settings(step.checkpoint)
    if settings is not None:  # a LoRA run's checkpoint: load its adapters too; the export merges them
        lora.apply(chunks, settings)
    checkpoint.load(step.checkpoint, chunks)
    bridge.save_hf(chunks, step.out, source=hf_config, dtype=dtype)
    if step.peft and settings is not None:  # check_steps refuses --peft without adapters
        from mrl.engine.megatron import lora_peft

        tensors = lora_peft.gather_tensors(bridge, chunks)
        if tensors:  # rank 0
            lora_peft.write_folder(step.peft, tensors, settings, os.path.abspath(hf_config))


def run_steps(rank: int, world_size: int, steps: list[ToMegatron | ToHF]) -> None:
    """Rank body: join the world, run each step under its own layout (the world stays up between steps)."""
    import torch.distributed as dist

    from mrl.engine.megatron.parallel import init_distributed, teardown

    init_distributed()
    try:
        for step in steps:
            (to_megatron if isinstance(step, ToMegatron) else to_hf)(step)
            dist.barrier()
    finally:
        teardown()


def read_metadata(checkpoint_dir: str) -> dict[str, Any]:
    path = Path(checkpoint_dir) / METADATA
    return json.loads(path.read_text()) if path.is_file() else {}


def execute(steps: list[ToMegatron | ToHF], *, timeout_s: float = 24 * 3600.0) -> None:
    """Run the steps in a world big enough for every layout: spawned locally, or in place under torchrun."""
    from mrl.utils.distributed import launch

    if "TORCHELASTIC_RUN_ID" in os.environ:
        run_steps(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), steps)
    else:
        launch(run_steps, math.lcm(*(s.layout.world_size() for s in steps)), steps, timeout_s=timeout_s)


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=None, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: TP)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument("--first", type=int, default=None, help="layers of the first pipeline stage (uneven split)")
    parser.add_argument("--last", type=int, default=None, help="layers of the last pipeline stage (uneven split)")
    parser.add_argument("--vocab-divisor", type=int, default=None,
                        help="the run's make_vocab_size_divisible_by (vocabulary padded to a multiple of it × TP)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    parser.add_argument("--timeout-s", type=float, default=24 * 3600.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    mcore = sub.add_parser("to-megatron", help="HF folder -> Megatron dist-checkpoint")
    mcore.add_argument("hf", help="HF model folder (config.json + safetensors)")
    mcore.add_argument("out", help="empty output folder")
    _layout_args(mcore)
    hf = sub.add_parser("to-hf", help="Megatron dist-checkpoint (converted or an RL run's) -> HF folder")
    hf.add_argument("checkpoint", help="dist-checkpoint folder")
    hf.add_argument("out", help="output HF folder")
    hf.add_argument("--hf-config", default=None, help="HF folder with the model's config.json and tokenizer")
    hf.add_argument("--peft", default=None, help="also write a LoRA run's adapters as a PEFT folder here")
    _layout_args(hf)


def steps_from_args(args: argparse.Namespace) -> list[ToMegatron | ToHF]:
    recorded = read_metadata(args.checkpoint).get("layout", {}) if args.direction == "to-hf" else {}
    given = {k: getattr(args, k) for k in ("tp", "pp", "ep", "etp", "vpp", "first", "last", "vocab_divisor")
             if getattr(args, k) is not None}
    if "pp" in given:  # a new pipeline size: the recorded uneven split was the old one's
        recorded = {k: v for k, v in recorded.items() if k not in ("first", "last")}
    layout = Layout(**{**recorded, **given})
    if args.direction == "to-megatron":
        return [ToMegatron(args.hf, args.out, layout, args.dtype)]
    return [ToHF(args.checkpoint, args.out, layout, args.hf_config, args.dtype, args.peft)]


def check_steps(steps: list[ToMegatron | ToHF]) -> None:
    """Every mistake a step's arguments can hold, before any process starts: one `ConfigError` naming each
    argument (a folder without config.json, a layout size below 1 or one the model's shape does not split into,
    an unknown dtype)."""
    from mrl.config import ConfigError, Violation
    from mrl.config.model_shape import layout_shape_problems

    flags = {"tensor_model_parallel_size": "--tp", "pipeline_model_parallel_size": "--pp",
             "expert_model_parallel_size": "--ep"}
    problems = []
    for step in steps:
        source, where = (("hf", step.hf) if isinstance(step, ToMegatron)
                         else ("--hf-config", step.hf_config or str(Path(step.checkpoint) / HF_CONFIG_DIR)))
        if isinstance(step, ToHF) and not Path(step.checkpoint).is_dir():
            problems.append(Violation("checkpoint", step.checkpoint, "no such folder"))
        elif isinstance(step, ToHF) and step.peft and not (Path(step.checkpoint) / "lora.json").is_file():
            problems.append(Violation("--peft", step.peft, "the checkpoint has no lora.json: only a LoRA run's "
                                                           "checkpoint holds adapters"))
        config = Path(where) / "config.json"
        if not config.is_file():
            problems.append(Violation(source, where, "no config.json there: pass the run's HF model folder"
                                      + (" with --hf-config" if source != "hf" else "")))
        if step.dtype is not None and step.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(Violation("--dtype", step.dtype, "must be one of float32, bfloat16, float16"))
        sizes = {f"--{k.replace('_', '-')}": getattr(step.layout, k)
                 for k in ("tp", "pp", "ep", "etp", "vpp", "first", "last", "vocab_divisor")}
        problems += [Violation(flag, n, "must be >= 1") for flag, n in sizes.items() if n is not None and n < 1]
        if config.is_file() and not problems:
            lay = step.layout
            for knob, why in layout_shape_problems(json.loads(config.read_text()), lay.tp, lay.pp, lay.vpp, lay.ep,
                                                   lay.stage_fields(), vocab_divisor=lay.vocab_divisor):
                problems.append(Violation(flags[knob], getattr(lay, flags[knob][2:]), why))
    if problems:
        raise ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    steps = steps_from_args(args)
    check_steps(steps)
    execute(steps, timeout_s=args.timeout_s)
    print(f"wrote {steps[0].out}")
    return 0


if __name__ == "__main__":  # `torchrun ... -m mrl.tools.convert to-megatron ...`
    _parser = argparse.ArgumentParser(prog="mrl convert")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
