"""Shared engines and references for the rollout integration tests (import the fixtures into a test module).

Starting a vLLM engine costs 30-75 s on 2 cores, so one standalone replica per backend serves every rollout test
of the run: the managers live in a process-wide cache (pytest would otherwise build a session fixture once per
importing module). Tests that change weights restore the seed-0 weights before they return, and tests read the
current version from the server instead of assuming one. The model ties its output layer to the embedding, as the
small Qwen2.5 models do: an update must reach the logits through the shared weight (vLLM-CPU's tied lm_head keeps
a GEMM handle of its own; the trainer tests' untied models cover the other layout).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
import torch

from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model
from mrl.rollout.manager import LLMServerManager
from mrl.rollout.replica import Footprint, ReplicaSpec

BACKENDS = ("hf", "vllm")
FAMILY = "qwen2"
TIED = {"tie_word_embeddings": True}
MAX_MODEL_LEN = 1024
PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]

__all__ = ["hf_models", "manager", "rollout_managers", "tiny_model_dir"]  # the fixtures

_MANAGERS: dict[str, LLMServerManager] = {}
_MODEL_DIR: list = []
_versions = itertools.count(100)


def next_version() -> int:
    """Fresh, increasing versions across tests (they share servers)."""
    return next(_versions)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    if not _MODEL_DIR:
        _MODEL_DIR.append(str(make_tiny_hf_model(FAMILY, tmp_path_factory.mktemp("rollout_tiny") / FAMILY, seed=0,
                                                  **TIED)))
    return _MODEL_DIR[0]


@pytest.fixture(scope="session")
def hf_models() -> dict[int, torch.nn.Module]:
    """Reference HF models by seed (0: the weights on disk, 1: the update)."""
    torch.set_num_threads(1)
    return {seed: build_tiny_hf_model(FAMILY, seed=seed, **TIED) for seed in (0, 1)}


def exported(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF-named tensors a bridge export streams for `model`: a tied output layer is not sent (it is the
    embedding), as a tied checkpoint does not store it."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def replica_spec(backend: str, model_dir: str) -> ReplicaSpec:
    return ReplicaSpec(backend=backend, model_path=model_dir, footprint=Footprint(), max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def rollout_managers(ray_cluster, tiny_model_dir) -> Iterator[dict[str, LLMServerManager]]:
    yield _MANAGERS
    for backend in list(_MANAGERS):
        _MANAGERS.pop(backend).shutdown()


@pytest.fixture(params=BACKENDS)
def manager(request, rollout_managers, tiny_model_dir) -> LLMServerManager:
    """The shared one-replica standalone manager of a backend: started on first use, shut down after the last
    selected test that uses it (not at session end: later integration tests should not share the CPU and memory
    with an idle engine)."""
    backend = request.param
    if backend not in rollout_managers:
        rollout_managers[backend] = LLMServerManager.create(
            replica_spec(backend, tiny_model_dir), "standalone", num_devices=1
        )
    users = [
        item
        for item in request.session.items
        if getattr(item, "callspec", None) is not None and item.callspec.params.get("manager") == backend
    ]
    if users and users[-1] is request.node:
        request.addfinalizer(lambda: rollout_managers.pop(backend).shutdown())
    return rollout_managers[backend]


def hf_token_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """log p(token_t | prefix) under softmax(z / T) (renormalised over the top_k largest when top_k > 0) from one
    full forward pass: the logits at position t-1 score token t."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    scaled = logits[len(prompt_ids) - 1 : -1] / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k, dim=-1).values[:, -1:], float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def max_logprob_error(
    model: torch.nn.Module, prompt_ids: list[int], out, temperature: float = 1.0, top_k: int = 0
) -> float:
    ref = hf_token_logprobs(model, prompt_ids, out.token_ids, temperature, top_k)
    return float((ref - torch.tensor(out.log_probs)).abs().max())


def restore_seed0(manager: LLMServerManager, hf_models) -> None:
    manager.update_weights(exported(hf_models[0]).items(), next_version())


def run(coro):
    return asyncio.run(coro)


def current_versions(manager: LLMServerManager) -> list[int]:
    return [h["version"] for h in manager.health().values()]


async def wait_for(replica, key: str, count: int, timeout_s: float = 60.0) -> None:
    """Poll a server's health until `key` (in_flight: running, waiting: parked at the closed gate) is `count`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await replica.health())[key] != count:
        assert asyncio.get_running_loop().time() < deadline, f"server never had {key} == {count}"
        await asyncio.sleep(0.05)
