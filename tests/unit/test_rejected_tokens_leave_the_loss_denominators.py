"""Rollout-correction rejection (rollout_rs, the veto) removes rejected tokens from the response mask, as verl does:
the old log-prob pass, where π_old and π_rollout first meet, writes the rejected mask to the store, so every term
of the update (policy gradient, entropy, KL) and the step-global denominators the engine counts from that mask
before any forward leave them out. Rows the first update would train on-policy have no π_old before the update, so
under rejection the pass computes every row."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from mrl.algo.aggregation import LossNormalizer
from mrl.config.startup import load_config
from mrl.controller.mesh import DeviceMesh
from mrl.data.jagged import JaggedTensor
from mrl.data.samples import light_batch, payload
from mrl.workers.actor_rollout_ref import ActorRolloutRefWorker, actor_loss_config, make_actor_loss_fn

PROMPT = [1, 2]
RESPONSES = {"a": [3, 4, 5], "b": [6, 7]}
# ρ = π_old / π_rollout per response token; rollout_rs=token keeps [0.5, 2]: a's second and b's first are rejected
RHO = {"a": [1.0, 3.0, 1.0], "b": [0.25, 1.0]}
ADVANTAGE = {"a": 1.0, "b": 3.0}


def old_log_probs(ids: torch.Tensor) -> torch.Tensor:
    """The trainer's π_old per token (any fixed function of the token will do)."""
    return -0.1 * ids.float()


class DictStore:
    """The sample store's jagged interface, in memory."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def get_jagged(self, keys, fields):
        return {f: JaggedTensor.from_list([self.values[k][f] for k in keys]) for f in fields}

    def update_jagged(self, keys, columns):
        for i, k in enumerate(keys):
            self.values[k].update({f: j[i].clone() for f, j in columns.items()})


class Engine:
    def __init__(self) -> None:
        self.rows = 0

    def infer_batch(self, batch, routing=False):
        self.rows += len(batch.offsets) - 1
        return {"log_probs": old_log_probs(batch.token_fields["input_ids"])}


def worker_and_store():
    cfg = OmegaConf.to_object(load_config("tiny/grpo", [
        "model.path=unused", "algorithm.rollout_correction.rollout_rs=token", "actor.loss_agg_mode=token-mean",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=1"], check_paths=False))
    values = {}
    for key, response in RESPONSES.items():
        ids = torch.tensor(PROMPT + response)
        rollout = old_log_probs(ids)[len(PROMPT):] - torch.log(torch.tensor(RHO[key]))
        values[key] = payload(PROMPT, response, [1] * len(response), rollout.tolist())
    worker = object.__new__(ActorRolloutRefWorker)  # the worker's state without its engines and process group
    loss_config = actor_loss_config(cfg)
    worker.__dict__.update(config=cfg, correction=loss_config.rollout_correction, actor=Engine(),
                           store=DictStore(values), loss_fn=make_actor_loss_fn(loss_config),
                           _meshes={"actor": DeviceMesh.create({"dp": 1}, rank=0)})
    return worker, values


def test_old_log_prob_pass_removes_rejected_tokens_from_the_stored_mask():
    worker, values = worker_and_store()
    batch = light_batch([{"key": k, "uid": k, "score": 0.0, "prompt_len": 2, "response_len": len(r)}
                         for k, r in RESPONSES.items()])
    worker.compute_log_prob(batch, num_updates=2)
    assert worker.actor.rows == 2  # no row left to an on-policy first update: its π_old would come too late
    assert values["a"]["response_mask"].tolist() == [0, 0, 1, 0, 1]
    assert values["b"]["response_mask"].tolist() == [0, 0, 0, 1]


def test_update_loss_divides_by_the_kept_tokens_only():
    worker, values = worker_and_store()
    batch = light_batch([{"key": k, "uid": k, "score": 0.0, "prompt_len": 2, "response_len": len(r)}
                         for k, r in RESPONSES.items()])
    worker.compute_log_prob(batch, num_updates=1)
    # The update's micro-batch as the engine builds it from the store; the denominators come from its mask.
    rows = [values[k] for k in RESPONSES]
    padded = {f: JaggedTensor.from_list([r[f] for r in rows]).to_padded()[0]
              for f in ("input_ids", "response_mask", "old_log_probs", "rollout_log_probs")}
    mask = padded["response_mask"]
    advantages = torch.tensor([[ADVANTAGE[k]] for k in RESPONSES]) * mask
    entropy = torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape)
    outputs = {"log_probs": padded["old_log_probs"], "entropy": entropy}  # ratio 1: the token loss is −A
    loss, metrics = worker.loss_fn(outputs, {**padded, "advantages": advantages}, LossNormalizer.from_mask(mask))
    kept = [("a", 0), ("a", 2), ("b", 1)]
    assert float(loss) == pytest.approx(-sum(ADVANTAGE[k] for k, _ in kept) / len(kept))
    assert float(metrics["actor/entropy"]) == pytest.approx(float(entropy[mask.bool()].mean()))
    assert math.isclose(float(mask.sum()), len(kept))
