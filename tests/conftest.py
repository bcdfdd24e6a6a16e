"""Fixtures shared by the whole suite.

One Ray cluster serves every test of a run (starting one costs seconds on 2 cores; under pytest-xdist, one per
worker); GPU tests are skipped where CUDA is absent. Ray over-commits logical CPUs and declares logical GPUs so that
placement groups and fractional GPU shares behave as on a GPU cluster, with CPU bundles standing in for devices.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

TESTS_ROOT = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = [os.path.dirname(TESTS_ROOT), TESTS_ROOT, *(os.path.join(TESTS_ROOT, d) for d in ("unit", "integration"))]
RAY_LOGICAL_CPUS = 16
RAY_LOGICAL_GPUS = 8


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on loopback, shared by every test in the run."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=RAY_LOGICAL_CPUS,
            num_gpus=RAY_LOGICAL_GPUS,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            # Test modules define worker classes; Ray workers import them by module name from these folders.
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([*TEST_DIRS, os.environ.get("PYTHONPATH", "")])}},
        )
    yield ray
    ray.shutdown()
