"""Trainer checkpoint folders: a checkpoint becomes visible only complete (marker written last, then a rename),
`auto` resumes from the latest complete `global_step_N` and never from a half-written one, an explicit folder
must be complete, and the driver's dataloader position and RNG states round-trip."""

import os
import random

import numpy as np
import pytest
import torch

from mrl.data.datasets import RLDataset
from mrl.trainer import checkpointing
from mrl.utils.rng import rng_state, set_rng_state


def write_checkpoint(root: str, step: int) -> str:
    staging = checkpointing.staging_dir(root, step)
    checkpointing.save_trainer_state(staging, {"global_steps": step})
    assert checkpointing.latest_checkpoint(root) != checkpointing.step_dir(root, step)  # not visible while staged
    final = checkpointing.step_dir(root, step)
    checkpointing.commit(staging, final)
    return final


def test_auto_picks_the_latest_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    assert checkpointing.resume_path("auto", root) is None  # nothing there: a fresh start
    write_checkpoint(root, 2)
    ten = write_checkpoint(root, 10)
    os.makedirs(checkpointing.step_dir(root, 12))  # a save killed before its marker
    os.makedirs(os.path.join(root, "global_step_x"))
    checkpointing.staging_dir(root, 14)
    assert checkpointing.resume_path("auto", root) == ten
    assert checkpointing.load_trainer_state(ten) == {"global_steps": 10}
    assert checkpointing.resume_path("disable", root) is None
    assert not os.path.exists(os.path.join(ten, "..", ".staging_global_step_10"))


def test_commit_replaces_an_older_folder_of_the_same_step(tmp_path):
    root = str(tmp_path)
    os.makedirs(checkpointing.step_dir(root, 3))
    with open(os.path.join(checkpointing.step_dir(root, 3), "stale"), "w") as f:
        f.write("old")
    final = write_checkpoint(root, 3)
    assert sorted(os.listdir(final)) == [checkpointing.COMPLETE, checkpointing.TRAINER_STATE]


def test_explicit_folder_must_be_a_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    done = write_checkpoint(root, 4)
    assert checkpointing.resume_path(done, "/elsewhere") == done
    os.makedirs(checkpointing.step_dir(root, 5))
    with pytest.raises(FileNotFoundError, match=r"trainer\.resume_mode=.*COMPLETE"):
        checkpointing.resume_path(checkpointing.step_dir(root, 5), root)


def test_dataloader_position_resumes_with_the_next_batch():
    data = RLDataset([{"prompt": f"q{i}"} for i in range(5)])
    stream = data.batches(2, seed=7)
    for _ in range(3):  # into the second epoch
        next(stream)
    state = stream.state_dict()
    expected = [[r["uid"] for r in next(stream)] for _ in range(4)]
    resumed = data.batches(2, seed=7)
    resumed.load_state_dict(state)
    assert [[r["uid"] for r in next(resumed)] for _ in range(4)] == expected and resumed.drawn == 7
    with pytest.raises(ValueError, match="same training data"):
        RLDataset([{"prompt": "q"}] * 4).batches(2).load_state_dict(state)


def test_rng_states_round_trip():
    state = rng_state()
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == drawn


def test_pruning_keeps_the_newest_complete_ones_and_never_the_one_just_written(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        write_checkpoint(root, step)
    os.makedirs(checkpointing.step_dir(root, 4))  # incomplete: not counted, not removed
    assert checkpointing.prune(root, None, checkpointing.step_dir(root, 3)) == []
    # A resumed run writes step 2 again after 3 exists: 2 is the one being written, so 1 and 3 are the older ones.
    removed = checkpointing.prune(root, 2, checkpointing.step_dir(root, 2))
    assert removed == [checkpointing.step_dir(root, 1)]
    assert [os.path.basename(p) for p in checkpointing.complete_checkpoints(root)] == ["global_step_2",
                                                                                     "global_step_3"]
    assert checkpointing.prune(root, 1, checkpointing.step_dir(root, 2)) == [checkpointing.step_dir(root, 3)]
    assert os.path.isdir(checkpointing.step_dir(root, 4))


def test_every_save_freq_steps_and_the_final_step_are_saved():
    assert [s for s in range(1, 8) if checkpointing.due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 7) if checkpointing.due(s, 3, 6)] == [3, 6]
    assert not any(checkpointing.due(s, -1, 7) for s in range(1, 8))
