"""Trainer checkpoints on disk: the folder layout, atomic commits and which checkpoint a run resumes from.

A checkpoint is `<trainer.default_local_dir>/global_step_<N>/` holding `actor/` (and `critic/`): the engines'
dist-checkpoints (model, optimizer, LR schedule, per-rank RNG), and `trainer_state.pt`: the driver's global step,
dataloader position, replay buffer and RNG states. It is written into a hidden staging folder; the `COMPLETE`
marker is written last and the folder is then renamed into place, so a run killed mid-save leaves only a staging
folder (or a folder without the marker), which `latest_checkpoint` never picks. Workers and driver must see the
same filesystem (one machine, or a shared mount on a cluster).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
RESUME_KEYWORDS = ("disable", "auto")


def due(step: int, save_freq: int, total_steps: int | None) -> bool:
    """Whether step `step` saves: every `save_freq` steps (-1: never) and the run's final step."""
    return save_freq > 0 and (step % save_freq == 0 or step == total_steps)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def complete_checkpoints(root: str) -> list[str]:
    """The complete `global_step_N` folders under `root`, oldest (smallest N) first."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name)))
    return [os.path.join(root, name) for _, name in steps if is_complete(os.path.join(root, name))]


def latest_checkpoint(root: str) -> str | None:
    """The complete `global_step_N` folder with the largest N under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: str, keep: int | None, current: str) -> list[str]:
    """Remove the oldest complete checkpoints beyond `keep` (None: keep all), never `current` (the one just
    written); incomplete folders are left to `staging_dir` and the next save. Returns the folders removed."""
    if keep is None:
        return []
    older = [p for p in complete_checkpoints(root) if os.path.abspath(p) != os.path.abspath(current)]
    doomed = older[: max(len(older) - (keep - 1), 0)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def resume_path(resume_mode: str, root: str) -> str | None:
    """The checkpoint a run starts from: none (`disable`), the latest complete one under `root` (`auto`; none
    there means a fresh start), or the folder `resume_mode` names, which must be a complete checkpoint."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_checkpoint(root)
    if not is_complete(resume_mode):
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode!r}: not a complete checkpoint folder (no "
                                f"{COMPLETE} marker); use disable, auto or a global_step_N folder")
    return resume_mode


def staging_dir(root: str, step: int) -> str:
    """An empty hidden folder beside the final one (same filesystem, so the commit is a rename)."""
    path = os.path.join(root, f".staging_global_step_{step}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def commit(staging: str, final: str) -> None:
    """Mark `staging` complete, then rename it to `final` (replacing an older folder of the same step)."""
    with open(os.path.join(staging, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(staging, final)


def save_trainer_state(path: str, state: dict[str, Any]) -> None:
    torch.save(state, os.path.join(path, TRAINER_STATE))


def load_trainer_state(path: str) -> dict[str, Any]:
    # The file holds Python objects (RNG tuples, the replay buffer's trajectories) that only this run wrote.
    return torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)
