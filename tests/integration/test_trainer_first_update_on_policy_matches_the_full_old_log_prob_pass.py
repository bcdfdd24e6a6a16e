"""With ppo_epochs 1 and two updates per step, the first update trains on the weights π_old is computed with, so
it takes π_old from its own forward and the old log-prob pass skips its rows (actor.on_policy_first_update). Two
runs from the same seed, the skip on and off (fp32, `hf` rollout with seeded sampling per session): the pass writes
π_old for half the rows instead of all, and the runs train the same policy (same samples, same update counts,
rollout log-probs of greedy answers after two steps equal to 1e-5).
"""

from __future__ import annotations

import pytest
from trainer_fixtures import tiny_trainer

from mrl.trainer.build import shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N = 2, 1, 2  # prompts per step, prompts per update (2 updates per step), samples per prompt


class CountsOldLogProbRows(PPOTrainer):
    """Notes, per step, how many of the step's rows the old log-prob pass wrote π_old for."""

    def compute_old_log_prob(self, batch):
        metrics = super().compute_old_log_prob(batch)
        values = self.store.get(sorted(set(batch["key"])))
        self.rows_with_old = [*getattr(self, "rows_with_old", []), sum("old_log_probs" in v for v in values)]
        return metrics


def run(root, on_policy: bool) -> tuple[list[int], list[dict], list[tuple[list[int], list[float]]]]:
    trainer = tiny_trainer(CountsOldLogProbRows, "tiny/grpo", root, [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        "data.max_response_length=6", "actor.optim.lr=1e-2", f"actor.on_policy_first_update={on_policy}",
    ], list("abcd"), prompts=4)
    try:
        metrics = [trainer.step() for _ in range(2)]
        prompts = trainer.parts.train_data.rows[:2]
        out = trainer.parts.agent_loops.generate(prompts, 1, {**trainer.sampling(train=False), "temperature": 0.0})
        stored = trainer.store.get([t["key"] for t in out])
        greedy = [(s["input_ids"][t["prompt_len"]:].tolist(), s["rollout_log_probs"][t["prompt_len"]:].tolist())
                  for t, s in zip(out, stored)]
        return trainer.rows_with_old, metrics, greedy
    finally:
        shutdown(trainer)


def test_first_update_on_policy_trains_the_same_policy_with_half_the_pass(ray_cluster, tmp_path):
    rows_on, metrics_on, greedy_on = run(tmp_path / "on", True)
    rows_off, metrics_off, greedy_off = run(tmp_path / "off", False)
    assert rows_off == [B * N] * 2 and rows_on == [B * N // 2] * 2
    for on, off in zip(metrics_on, metrics_off):
        assert on["actor/updates"] == off["actor/updates"] == B // M
        assert on["response_length/mean"] == off["response_length/mean"]  # the same samples
    assert [ids for ids, _ in greedy_on] == [ids for ids, _ in greedy_off]
    for (_, lp_on), (_, lp_off) in zip(greedy_on, greedy_off):
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off)) <= 1e-5
