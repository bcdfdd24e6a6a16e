"""colocate_async end to end on one slot: a Megatron actor and a hybrid `hf` replica share it; the rollout producer
keeps one step's worth of extra groups generating.

Response lengths are made heterogeneous on purpose (every other group stops after one token, the rest run to the
length limit), so when a step's groups are ready the long ones are still generating. Proves: those are aborted
before the replica sleeps (partial rollout), continue after the sync on the new weights, and train in the next step
with min_version < max_version; the server sees abort → sleep → wake weights → update → wake KV → resume; no
trained sample is staler than the threshold; a checkpoint taken while groups generate lists their prompts, and a
trainer resumed from it re-issues them before drawing new ones.
"""

from __future__ import annotations

import pytest
from trainer_fixtures import stepped, tiny_trainer

from mrl.trainer import checkpointing
from mrl.trainer.modes import ColocateAsyncTrainer

pytestmark = pytest.mark.integration

B, M, N, STEPS, VOCAB, LONG = 2, 1, 2, 2, 512, 160


class RecordingTrainer(ColocateAsyncTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken: list[list[dict]] = []
        self.submitted: list[str] = []

    def submit_group(self, prompt, index):
        self.submitted.append(prompt["uid"].split("@")[0])
        self.sampling_overrides = (
            {"stop_token_ids": list(range(VOCAB))} if index % 2 == 0 else {"ignore_eos": True}
        )
        return super().submit_group(prompt, index)

    def sampling(self, train: bool) -> dict:
        return {**super().sampling(train), **getattr(self, "sampling_overrides", {})}

    def sample(self):
        trajectories = super().sample()
        self.taken.append(trajectories)
        return trajectories


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    trainer = tiny_trainer(RecordingTrainer, "tiny/grpo_colocate_async", tmp_path_factory.mktemp("colocate_async"), [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        f"data.max_response_length={LONG}", f"trainer.total_training_steps={STEPS}",
    ], list("abc"), vocab_size=VOCAB)
    with stepped(trainer, STEPS) as result:
        yield result


def test_long_groups_are_aborted_and_continue_on_the_new_weights(run):
    trainer, metrics, _ = run
    assert metrics[0]["partial_rollout/aborted_requests"] > 0
    first, second = trainer.taken
    assert all(t["response_len"] == 1 and t["max_version"] == 0 for t in first)  # the short groups
    spanning = [t for t in second if t["min_version"] < t["max_version"]]
    assert spanning and all((t["min_version"], t["max_version"]) == (0, 1) for t in spanning)
    assert all(t["response_len"] == LONG for t in spanning)  # nothing lost across the abort
    assert all(m["staleness/max"] <= trainer.config.weight_sync.staleness_threshold for m in metrics)


def test_server_sees_abort_sleep_update_wake_resume(run):
    _, _, events = run
    i = events.index("update_weights:1")
    assert events[:i][-3:] == ["abort_all", "sleep:2", "wake_up:weights"], events
    assert events[i:].index("wake_up:kv_cache") < events[i:].index("resume_generation"), events


def test_resume_reissues_the_prompts_in_flight_at_the_checkpoint_first(run):
    trainer, _, _ = run
    # Pause generation so the long groups started after the last sync are still unfinished when the (slow) engine
    # checkpoint is written; the resumed trainer's sync resumes the servers.
    trainer.parts.rollout.abort_all()
    path = trainer.save_checkpoint()
    saved = checkpointing.load_trainer_state(path)
    reissue = [row["uid"] for row in saved["producer"]["reissue"]]
    assert reissue
    trainer.close()
    resumed = RecordingTrainer(trainer.config, trainer.parts, trainer.logger)
    try:
        assert resumed.resume() == path and resumed.global_steps == STEPS
        assert len(resumed.buffer) == len(saved["buffer"])  # finished groups come back with the buffer
        # ... and with their tokens, saved from the sample store (the resumed trainer puts them back there)
        assert set(saved["payloads"]) == set(saved["buffer"].keys())
        resumed.step()
        assert resumed.submitted[: len(reissue)] == reissue
    finally:
        resumed.close()
