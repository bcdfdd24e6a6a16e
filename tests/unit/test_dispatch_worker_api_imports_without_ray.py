"""The worker-side controller API works where Ray is not installed (the GPU machine runs workers with torchrun):
a Worker reads its rank and rendezvous from the torchrun environment, registers meshes, and its tagged methods
run unchanged; only the Ray group classes need Ray."""

import os
import subprocess
import sys
import textwrap

import pytest

from mrl.controller.future import CollectPlan, GroupFuture

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["ray"] = None  # any `import ray` now raises ImportError
    import mrl.controller as c

    class Probe(c.Worker):
        @c.register(c.nd_compute("train"))
        def twice(self, x):
            return [2 * v for v in x]

    w = Probe()
    mesh = w.register_mesh("train", {"pp": 2, "dp": 2})
    assert (w.rank, w.world_size, w.master_addr_port) == (3, 4, ("10.0.0.7", 29511)), (w.rank, w.master_addr_port)
    assert mesh.coord == {"pp": 1, "dp": 1} and mesh.is_collect and w.twice([1, 2]) == [2, 4]
    engine_mesh = c.DeviceMesh.create({"dp": 2, "tp": 2}, coords={"dp": 1, "tp": 1})  # as an engine reports it
    assert w.register_mesh("actor", engine_mesh) is engine_mesh and w.mesh("actor").dp_rank == 1
    try:
        w.register_mesh("small", {"dp": 2}, coords={"dp": 1})
    except ValueError as err:
        assert "has 2 ranks, the group has 4" in str(err)
    else:
        raise AssertionError("a mesh smaller than the group was accepted")
    try:
        c.RayWorkerGroup
    except ImportError:
        print("OK")
    """
)


def test_worker_api_runs_without_ray_from_torchrun_environment():
    env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"


def test_non_master_rank_without_rendezvous_fails_clearly():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    code = "import mrl.controller as c; c.Worker()"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "RANK": "1"}, capture_output=True, text=True)
    assert out.returncode != 0 and "rank 1: MASTER_ADDR is not set" in out.stderr


RANK0_SCRIPT = textwrap.dedent(
    """
    import socket
    import torch.distributed as dist
    import mrl.controller as c

    w = c.Worker()
    addr, port = w.master_addr_port
    with socket.socket() as other:  # another process on the host asking for the chosen port
        try:
            other.bind((addr, port))
        except OSError:
            pass
        else:
            raise AssertionError(f"port {port} was free after rank 0 chose it")
    dist.init_process_group("gloo")  # env:// on rank 0 reuses the server the worker holds
    dist.barrier()
    print("OK", port)
    """
)


def test_rank0_holds_the_port_it_chose_until_init_process_group():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1")
    out = subprocess.run([sys.executable, "-c", RANK0_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK")


def test_nested_future_is_refused_instead_of_pickling_the_group():
    import pickle

    fut = GroupFuture([1], CollectPlan((0,), "single"), list)
    with pytest.raises(TypeError, match="top-level argument"):
        pickle.dumps([fut])
