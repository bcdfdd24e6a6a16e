"""On a CPU host the trainer's workers use all of a slot's cores when a hybrid rollout leaves them the slot during
training, one thread when an engine generates beside them, and whatever resources.cpu_threads_per_slot says; the
slot's rollout server gets the same count."""

import pytest

from mrl.config.startup import load_config
from mrl.workers import cpu_threads
from mrl.workers.cpu_threads import worker_threads

VALID = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]


def config(*overrides: str):
    return load_config("tiny/grpo", VALID + list(overrides), check_paths=False)


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "host_cores", lambda: 8)


def test_hybrid_workers_share_the_node_cores_among_slots(eight_cores):
    assert worker_threads(config(), use_gpu=False) == 8
    assert worker_threads(config("resources.n_gpus_per_node=2", "resources.max_colocate_count=2"),
                          use_gpu=False) == 4
    assert worker_threads(config("resources.n_gpus_per_node=16"), use_gpu=False) == 1  # never below one


def test_engines_beside_training_leave_one_thread_per_worker(eight_cores):
    standalone = config("rollout.mode=standalone", "trainer.mode=separate_async", "rollout.nnodes=1",
                        "rollout.n_gpus_per_node=1", "weight_sync.transport=nccl",
                        "weight_sync.parameter_sync_step=2")
    assert worker_threads(standalone, use_gpu=False) == 1


def test_the_setting_wins_on_cpu_and_gpu_hosts_keep_one_thread(eight_cores):
    assert worker_threads(config("resources.cpu_threads_per_slot=3"), use_gpu=False) == 3
    assert worker_threads(config("resources.cpu_threads_per_slot=3"), use_gpu=True) == 1
    assert worker_threads(config(), use_gpu=True) == 1


def test_the_rollout_server_gets_the_same_threads_on_cpu_hosts_only(eight_cores):
    """The hybrid engine computes while the workers wait (vLLM's in-process executor on CPU uses the server
    process's OMP_NUM_THREADS, which Ray would otherwise set to 1)."""
    from mrl.trainer.build import rollout_spec

    assert cpu_threads.engine_env(config(), use_gpu=False) == {"OMP_NUM_THREADS": "8"}
    assert cpu_threads.engine_env(config("resources.n_gpus_per_node=2", "resources.max_colocate_count=2"),
                                  use_gpu=False) == {"OMP_NUM_THREADS": "4"}
    assert cpu_threads.engine_env(config(), use_gpu=True) == {}
    spec = rollout_spec(config())
    assert spec.server_env()["OMP_NUM_THREADS"] == cpu_threads.engine_env(config(), use_gpu=False)["OMP_NUM_THREADS"]
