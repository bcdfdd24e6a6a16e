"""The GPU tests' Ray cluster: it declares the machine's real GPUs (the suite's `ray_cluster` declares 8 logical ones
for CPU placement tests, which on a GPU host would hand out devices that do not exist)."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def gpu_ray():
    import ray

    from mrl.trainer.main import RAY_ENV

    if not ray.is_initialized():
        env = {**RAY_ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ray.init(num_cpus=16, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def vllm_spawns_its_engine_core(monkeypatch):
    """A vLLM engine started in the test process (LLM, AsyncLLM) must spawn its engine core: the session's tests
    initialise CUDA in this process, and a forked engine core cannot use it."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
