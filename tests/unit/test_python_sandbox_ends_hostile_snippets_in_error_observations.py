"""The Python tool's sandbox: each hostile snippet (infinite loop, sleep, fork bomb, huge allocation, writes
outside the scratch dir, a socket, an output flood, a huge file) ends in an error observation naming what stopped
it; the calling process stays healthy, no sandbox process or scratch directory is left, and the next snippet runs.
All snippets run at once through one pool (as concurrent sessions would), so the file takes a few seconds."""

import asyncio
import dataclasses
import os
import pathlib
import shutil
import socket
import tempfile

import pytest

from mrl.rollout.agent_loop import ToolError
from mrl.rollout.agent_loop.python_tool import PythonTool
from mrl.rollout.agent_loop.sandbox import SandboxLimits, SandboxPool

# A wall clock far above the CPU limit: the loop must reach its CPU second even on a loaded 2-core machine
# (at a load average of 20, 8 s were not always enough); nothing else here runs long.
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=30.0, memory_bytes=256 << 20, max_processes=4,
                       file_bytes=1 << 20, max_output_chars=500)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and the uid drop need root (as CI runs)")


@pytest.fixture(scope="module")
def listener():
    """A server on the host's loopback that the socket snippet tries to reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def results(tmp_path_factory, listener):
    root = tmp_path_factory.mktemp("sandbox")
    pool = SandboxPool(slots=len(SNIPPETS), limits=LIMITS, root=str(root))
    # A world-writable directory outside the scratch dir (as /tmp is): only the read-only mounts stop the write.
    outside_dir = tempfile.mkdtemp(prefix="mrl-outside-")
    os.chmod(outside_dir, 0o1777)
    outside = pathlib.Path(outside_dir) / "escaped.txt"
    port = listener.getsockname()[1]
    codes = {k: v.format(outside=outside, port=port) for k, v in SNIPPETS.items()}

    # The sleeper has a pool of its own with a short wall clock, so the file does not wait 30 s for it.
    sleeper = SandboxPool(slots=1, limits=dataclasses.replace(LIMITS, wall_seconds=1.5), root=str(root))

    async def run_all():
        return await asyncio.gather(*((sleeper if k == "sleep" else pool).run(c) for k, c in codes.items()))

    out = dict(zip(codes, asyncio.run(run_all())))
    yield {"results": out, "pool": pool, "sleeper": sleeper, "root": root, "outside": outside}
    shutil.rmtree(outside_dir)


SNIPPETS = {
    "infinite_loop": "while True: pass",
    "sleep": "import time; time.sleep(60)",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "huge_allocation": "x = bytearray(8 << 30)",
    "write_outside": "open('{outside}', 'w').write('escaped')",
    "write_etc": "open('/etc/mrl_sandbox_escape', 'w').write('escaped')",
    "socket": "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
    "output_flood": "print('y' * (1 << 20))",
    "huge_file": "open('big.bin', 'wb').write(b'0' * (4 << 20))",
    "scratch_use": "open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())",
}


@pytest.mark.parametrize(("snippet", "error", "output"), [
    ("infinite_loop", "CPU time limit of 1 s exceeded", None),
    ("sleep", "wall-clock limit of 1.5 s exceeded", None),
    ("huge_allocation", "exit code 1", "MemoryError"),
    ("huge_file", "exit code 1", "File too large"),  # Python ignores SIGXFSZ: the write fails instead
])
def test_limits_end_the_snippet_with_a_named_error(results, snippet, error, output):
    r = results["results"][snippet]
    assert not r.ok and r.error == error
    assert output is None or output in r.output


@ROOT_ONLY
def test_fork_bomb_is_capped_and_leaves_no_process(results):
    r = results["results"]["fork_bomb"]
    assert not r.ok and "BlockingIOError" in r.output  # RLIMIT_NPROC binds for the slot's uid
    uids = set(results["pool"].uids)
    assert len(uids) == len(SNIPPETS) and not uids & set(results["sleeper"].uids)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _uid(pid) in uids]
    assert left == []


def _uid(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


@ROOT_ONLY
def test_no_write_outside_the_scratch_dir_and_no_network(results, listener):
    r = results["results"]
    assert not r["write_outside"].ok and "Read-only file system" in r["write_outside"].output
    assert not r["write_etc"].ok and "Read-only file system" in r["write_etc"].output
    assert not results["outside"].exists() and not os.path.exists("/etc/mrl_sandbox_escape")
    assert not r["socket"].ok and "Network is unreachable" in r["socket"].output
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host's loopback


def test_output_is_truncated_and_the_scratch_dir_is_removed(results):
    r = results["results"]
    assert r["scratch_use"].ok and r["scratch_use"].output == "kept\n"
    flood = r["output_flood"]
    assert flood.ok and flood.output == f"{'y' * 250}\n... [1048077 characters cut] ...\n{'y' * 249}\n"
    assert list(results["root"].iterdir()) == []


def test_the_pool_runs_again_after_hostile_snippets_and_the_tool_reports_errors(results):
    pool = results["pool"]
    assert asyncio.run(pool.run("print(6 * 7)")).output == "42\n"
    tool = PythonTool()
    assert asyncio.run(tool.execute({"code": "print(2 ** 100)"})) == f"{2 ** 100}\n"
    with pytest.raises(ToolError, match="exit code 1") as err:
        asyncio.run(tool.execute({"code": "1 / 0"}))
    assert "ZeroDivisionError" in str(err.value)


def test_a_new_pool_removes_scratch_dirs_of_dead_processes(tmp_path):
    dead = (tmp_path / "mrl-sandbox-4194999-0-abc")  # above the kernel's pid limit: never alive
    live = (tmp_path / f"mrl-sandbox-{os.getpid()}-0-abc")
    for d in (dead, live):
        d.mkdir()
        (d / "main.py").write_text("print(1)")
    SandboxPool(slots=1, limits=LIMITS, root=str(tmp_path))
    assert not dead.exists() and live.exists()
