"""separate_async checkpoint/resume: a NEW trainer (fresh actor, fresh standalone replica, fresh sample store, as
after a crash) resumed from a checkpoint taken while the rollout pool was still generating loses no prompt and
replays none.

Run A trains 2 steps, checkpointing each. The standalone `hf` replica keeps generating long responses beside the
actor, so at the step-2 checkpoint some groups are finished but untrained (the replay buffer: saved with their
payloads) and some are drawn but unfinished (in flight or pending: saved as prompts to re-issue). Run B resumes
with `resume_mode=auto` and trains step 3. Proves: B re-issues exactly the saved unfinished prompts before drawing
new ones; B's step 3 trains the saved buffered groups first (FIFO, their tokens from the checkpoint); no prompt
trained by A is trained again; every prompt A drew but did not train is trained by B or still tracked by B's
producer (in flight, pending, buffered).
"""

from __future__ import annotations

import pytest
from trainer_fixtures import tiny_trainer

from mrl.trainer import checkpointing
from mrl.trainer.build import shutdown
from mrl.trainer.modes import SeparateAsyncTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N = 2, 1, 2  # groups per step, groups per update, samples per group
WORDS = ["alpha", "beta", "gamma", "delta", "step", "model", "token", "answer"]


def base_uid(uid: str) -> str:
    return uid.split("@")[0]  # the producer suffixes the dataset row's uid per submission


class RecordingTrainer(SeparateAsyncTrainer):
    """Records the dataset rows it submits (in order) and the rows each step trains on; responses run to the
    length limit so the pool is still busy when a step ends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: list[str] = []
        self.trained: list[list[str]] = []

    def sampling(self, train: bool) -> dict:
        return {**super().sampling(train), "ignore_eos": True}

    def submit_group(self, prompt, index):
        self.submitted.append(base_uid(prompt["uid"]))
        return super().submit_group(prompt, index)

    def sample(self):
        trajectories = super().sample()
        self.trained.append(list(dict.fromkeys(base_uid(t["uid"]) for t in trajectories)))
        return trajectories


def make(root, resume_mode: str) -> RecordingTrainer:
    return tiny_trainer(RecordingTrainer, "tiny/grpo_separate_async", root, [
        "rollout.name=hf", f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}",
        f"weight_sync.parameter_sync_step={B // M}", f"rollout.n={N}", "data.max_response_length=96",
        "trainer.total_training_steps=3", "trainer.save_freq=1", f"trainer.resume_mode={resume_mode}",
        "data.shuffle=false",
    ], WORDS, prompts=32)


def rows_of(trainer: RecordingTrainer, state: dict, version: int) -> tuple[list[str], list[str], list[str]]:
    return producer_rows(state, version, trainer.config.weight_sync.staleness_threshold)


def producer_rows(state: dict, version: int, threshold: int) -> tuple[list[str], list[str], list[str]]:
    """Of a trainer state: (prompts to re-issue in order, buffered groups oldest first that a step at `version`
    may train, buffered groups it drops as staler than `threshold`)."""
    reissue = [r["uid"] for r in state["producer"]["reissue"]]
    groups = list(state["buffer"].groups)
    fresh = [base_uid(g[0]["uid"]) for g in groups if min(t["min_version"] for t in g) >= version - threshold]
    stale = [base_uid(g[0]["uid"]) for g in groups if min(t["min_version"] for t in g) < version - threshold]
    return reissue, fresh, stale


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("separate_async_resume")
    a = make(root, "disable")
    try:
        for _ in range(2):
            a.step()
    finally:
        shutdown(a)
    saved = checkpointing.load_trainer_state(checkpointing.step_dir(a.config.trainer.default_local_dir, 2))
    b = make(root, "auto")
    try:
        resumed_from = b.resume()
        b.step()
        after = b.trainer_state()
    finally:
        shutdown(b)
    return a, b, saved, resumed_from, after


def test_resume_reissues_unfinished_prompts_first(runs):
    _, b, saved, resumed_from, _ = runs
    assert resumed_from is not None and resumed_from.endswith("global_step_2")
    assert b.global_steps == 3
    reissue, fresh, stale = rows_of(b, saved, 2)
    assert reissue or fresh, "the checkpoint caught the pool idle: nothing in flight or buffered to test"
    assert b.submitted[: len(reissue)] == reissue
    assert b.buffer.dropped_stale >= len(stale)  # by design: too old for the resumed version


def test_resumed_step_trains_saved_groups_and_replays_none(runs):
    a, b, saved, _, after = runs
    reissue, fresh, _ = rows_of(b, saved, 2)
    trained_by_a = {uid for step in a.trained for uid in step}
    (step3,) = b.trained
    assert not trained_by_a & set(step3), (a.trained, step3)
    assert step3[: len(fresh[:B])] == fresh[:B]  # the buffer is FIFO and survives the restart
    now_reissue, now_fresh, now_stale = rows_of(b, after, 3)
    still_tracked = set(now_reissue) | set(now_fresh) | set(now_stale)
    assert set(reissue) | set(fresh) <= set(step3) | still_tracked
