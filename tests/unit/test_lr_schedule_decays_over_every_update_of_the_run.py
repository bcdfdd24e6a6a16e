"""The LR schedule's decay length is the number of optimizer updates the run makes: total_training_steps ×
train_batch_size / ppo_mini_batch_size × ppo_epochs for the actor (each epoch repeats the step's updates), so a
decaying LR reaches its minimum at the end of the run, not after 1/ppo_epochs of it. The critic trains one pass
per step."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import mrl.engine.megatron.engine as engine_module
import mrl.workers.critic as critic_module
from mrl.config.startup.loader import load_config
from mrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from mrl.workers.critic import CriticWorker


class RecordsTotalSteps:
    """Stands in for the Megatron engine: keeps the schedule length it was built with, builds nothing."""

    def __init__(self, *args, total_steps: int = 1, **kwargs) -> None:
        self.total_steps = total_steps

    @classmethod
    def from_critic_config(cls, *args, total_steps: int = 1, **kwargs) -> "RecordsTotalSteps":
        return cls(total_steps=total_steps)

    def initialize(self) -> None:
        pass

    def mesh(self) -> dict:
        return {}


def config(epochs: int):
    return OmegaConf.to_object(load_config("tiny/grpo", [
        "model.path=unused", "trainer.total_training_steps=5", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=2", f"actor.ppo_epochs={epochs}", "critic.ppo_mini_batch_size=4",
    ], check_paths=False))


@pytest.mark.parametrize("epochs", [1, 3])
def test_actor_schedule_spans_every_update_of_every_epoch(monkeypatch, epochs):
    monkeypatch.setattr(engine_module, "MegatronEngine", RecordsTotalSteps)
    engine = ActorRolloutRefWorker._engine(SimpleNamespace(config=config(epochs)), "actor")
    assert engine.total_steps == 5 * (8 // 2) * epochs


def test_critic_schedule_spans_its_updates(monkeypatch):
    monkeypatch.setattr(critic_module, "MegatronCritic", RecordsTotalSteps)
    worker = SimpleNamespace(config=config(3), register_mesh=lambda *a: None)
    CriticWorker.init_model(worker)
    assert worker.critic.engine.total_steps == 5 * (8 // 4)  # one pass per step, whatever the actor's epochs
