"""Every random generator state of a process, captured and restored as one dict (checkpoints of the driver and of
each engine rank), so a resumed run draws the numbers the interrupted one would have drawn."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, and CUDA where present) generator states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
