"""Config variants side by side on one GPU: `e2e_gpu.py`'s hybrid GRPO step (one shape, random bf16 weights,
fixed-length responses, nothing offloaded) once per variant, back to back in one process, so the step times are
of the same machine and hour. Prints one table: per variant, the step's median stages, the step time relative
to the first variant, and the metrics the preset is about.

Presets (each variant is a list of overrides on top of e2e_gpu's):
- `correction`: `sync` mode at the 0.5B shape, each rollout correction of `algorithm.rollout_correction` on and
  off (mismatch KL, weight statistics, masked fractions, step time).
- `lora`: the 1.5B shape, full fine-tuning against LoRA with merged and adapter-only weight sync (optimizer
  memory, bytes per sync, sync seconds).

    python tools/bench/variants_gpu.py --preset correction --json /tmp/corr.json
    python tools/bench/variants_gpu.py --preset lora --only full,lora_adapter --batch 8
    python tools/bench/variants_gpu.py --shape 0.5b --variant off= \\
        --variant tis=algorithm.rollout_correction.rollout_is=token
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from e2e_gpu import make_task, overrides, run_mrl

RC = "algorithm.rollout_correction."
LORA = ["actor.lora.enable=true", "actor.lora.rank=16", "actor.lora.alpha=32"]
PRESETS: dict[str, dict[str, Any]] = {
    "correction": {
        "shape": "0.5b",
        "keys": ("rollout_corr/", "rollout/mismatch_kl", "rollout/logprob_mismatch"),
        "variants": {
            "off": [],
            "tis_token": [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0"],
            "tis_sequence": [f"{RC}rollout_is=sequence", f"{RC}rollout_is_threshold=2.0"],
            # Bounds tight enough to act on random weights: at 0.5B in bf16 the token weights stayed within
            # 0.95–1.07 and a sequence's geometric mean within ~1 ± 0.001 (H200, 2026-12-02).
            "rs_geometric": [f"{RC}rollout_rs=geometric", f"{RC}rollout_rs_threshold=1.0005"],
            "icepop": [f"{RC}rollout_is=token", f"{RC}rollout_rs=token", f"{RC}rollout_is_threshold=1.03",
                       f"{RC}rollout_rs_threshold=1.03"],
            "decoupled": [f"{RC}use_decoupled_loss=true", f"{RC}behav_imp_weight_cap=2.0"],
        },
    },
    "lora": {
        "shape": "1.5b",
        "keys": ("weight_sync/bytes", "weight_sync/device_bytes", "weight_sync/tensors", "memory/optimizer",
                 "memory/cuda_peak_gib/update_actor", "timing_s/update_weights", "timing_s/sync/", "actor/trainable",
                 "perf/mfu/update_actor", "timing_s/handover/"),
        "variants": {"full": [], "lora_adapter": [*LORA, "actor.lora.sync=adapter", "rollout.sleep_level=1"],
                     "lora_merged": [*LORA, "actor.lora.sync=merged"]},
    },
}
CUSTOM_KEYS = ("rollout/logprob", "rollout/mismatch", "rollout_corr/", "weight_sync/", "memory/")
STAGES = ("step", "gen", "old_log_prob", "update_actor", "update_weights")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    return name, [o for o in rest.split(",") if o]


def table(results: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> None:
    first = next(iter(results.values()))["median"]["timing_s/step"]
    names = sorted({k for r in results.values() for k in r["median"] if k.startswith(keys)})
    for label, result in results.items():
        m = result["median"]
        stages = " ".join(f"{s} {m.get(f'timing_s/{s}', float('nan')):.2f}s" for s in STAGES)
        print(f"\n== {label}: {stages} | step vs {next(iter(results))} {m['timing_s/step'] / first:.3f} | "
              f"start {result['startup_s']:.1f} s")
        for key in names:
            if key in m:
                print(f"  {key:<52} {m[key]:.5g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--variant", action="append", default=[], help="name=override,override (repeatable)")
    parser.add_argument("--only", help="comma-separated variant names: run just these, in this order")
    parser.add_argument("--shape", help="default: the preset's")
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.offload = []
    preset = PRESETS.get(args.preset, {"shape": "0.5b", "keys": CUSTOM_KEYS, "variants": {}})
    variants = dict(preset["variants"]) | dict(parse_variant(v) for v in args.variant)
    if args.only:
        names = args.only.split(",")
        if unknown := [name for name in names if name not in variants]:
            parser.error(f"--only: no variant {unknown} (known: {', '.join(variants)})")
        variants = {name: variants[name] for name in names}
    shape = args.shape or preset["shape"]

    from mrl.config.startup.loader import load_config
    from mrl.trainer.main import init_ray

    init_ray(num_cpus=16)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_task(Path(tmp) / shape, shape, seed=1)
        for label, extra in variants.items():
            cfg = load_config("tiny/grpo", [*overrides(paths, args, label, Path(tmp)), *extra])
            results[label] = run_mrl(cfg)
            print(f"[variants] {label} done: step {results[label]['median']['timing_s/step']:.2f} s", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    table(results, preset["keys"])


if __name__ == "__main__":
    main()
