"""A sandbox for model-written Python: one fresh process per snippet, bounded in CPU, memory, processes, file size,
wall-clock time and output, with no network, no writes outside its scratch directory, and nothing left behind.

Machines and CI run as root, where file permissions and RLIMIT_NPROC do not bind, so as root each snippet runs
in new network, mount, PID and IPC namespaces (the network has no interfaces, not even loopback; every mount but
the scratch directory is re-bound read-only; when the snippet's first process exits the kernel kills every process
it started) and as an unprivileged uid of its own pool slot (unique on the host), so RLIMIT_NPROC caps a fork bomb and
the slots cannot read each other's files. Without root the namespaces and the uid change are unavailable: the
limits still apply, the network and the file system are not closed (`SandboxPool.isolated` says which).

A small launcher (run as `python -I -S -c LAUNCHER`, so nothing is forked from the caller's threads) sets this up,
forks the snippet's process, enforces the wall clock and reports how it ended through its exit status. A pool of
`slots` bounds how many snippets run at once; each run gets a fresh process, so no state leaks between runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass

# The launcher's exit statuses that are not the snippet's own: setup failed / wall clock / killed by a signal.
SETUP_FAILED, WALL_CLOCK, SIGNALLED = 125, 124, 128

LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
limits, uid, scratch, isolate = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
expose = json.loads(sys.argv[5])
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n")
        os._exit(125)
if isolate:
    # CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
    check(libc.unshare(0x00020000 | 0x40000000 | 0x20000000 | 0x08000000) == 0, "unshare")
    MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0, "make mounts private")
    check(libc.mount(scratch.encode(), scratch.encode(), None, MS_BIND, None) == 0, "bind the scratch dir")
    # The interpreter (or the scratch dir) may live under a directory others cannot enter (e.g. /root/.pyenv):
    # cover the highest such directory with an empty tmpfs (hiding the rest of it) and bind just them back into it.
    hidden = {}
    for path in expose + [scratch]:
        parts = path.split("/")
        for i in range(2, len(parts)):
            if not os.stat("/".join(parts[:i])).st_mode & 0o001:
                hidden.setdefault("/".join(parts[:i]), []).append(path)
                break
    os.umask(0o022)
    for top, paths in hidden.items():
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in paths]
        check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=755,size=1m") == 0, "tmpfs over " + top)
        for p, fd in zip(paths, fds):
            os.makedirs(p, exist_ok=True)
            check(libc.mount(f"/proc/self/fd/{fd}".encode(), p.encode(), None, MS_BIND | MS_REC, None) == 0, p)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:  # per-mount flags (MS_BIND | MS_REMOUNT): this namespace's view only
        if point != scratch:
            libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    check(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0, "read-only root")
def status_code(status):
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
pid = os.fork()
if pid == 0:
    # PID 1 of the snippet's namespace only waits: the kernel drops signals such as SIGXCPU that would reach a
    # namespace's init without a handler, so the snippet must not be that process.
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher (and so does the namespace)
    snippet = os.fork()
    if snippet == 0:
        for name, value in (("CPU", limits["cpu_seconds"]), ("AS", limits["memory_bytes"]),
                            ("NPROC", limits["max_processes"]), ("FSIZE", limits["file_bytes"]),
                            ("NOFILE", limits["open_files"]), ("CORE", 0)):
            # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL a second later if it is caught
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value + (name == "CPU")))
        if isolate:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        for sig in (signal.SIGXCPU, signal.SIGPIPE):  # inherited as ignored from some parents: default again
            signal.signal(sig, signal.SIG_DFL)
        libc.prctl(1, signal.SIGKILL)  # again after setuid, which clears it: die with the waiting process
        os.chdir(scratch)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        os.execve(sys.executable, [sys.executable, "-I", "main.py"], env)
    os._exit(status_code(os.waitpid(snippet, 0)[1]))
timed_out = []
def on_alarm(*_):
    timed_out.append(1)
    os.kill(pid, signal.SIGKILL)  # the namespace's init: the kernel then kills every process of the namespace
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, limits["wall_seconds"])
_, status = os.waitpid(pid, 0)
signal.setitimer(signal.ITIMER_REAL, 0)
if timed_out:
    os._exit(124)
os._exit(status_code(status))
"""


_PREFIX = "mrl-sandbox-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _interpreter_dirs() -> list[str]:
    """What the snippet's interpreter reads: its install prefix (stdlib) and the environment's (site-packages)."""
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix,
                                                 os.path.dirname(os.path.realpath(sys.executable)))})


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5  # CPU time per process (RLIMIT_CPU; SIGXCPU past it)
    wall_seconds: float = 10.0  # wall clock for the whole snippet, all its processes
    memory_bytes: int = 512 << 20  # address space per process (RLIMIT_AS): a huge allocation raises MemoryError
    max_processes: int = 16  # processes and threads of the slot's uid (RLIMIT_NPROC; binds when isolated)
    file_bytes: int = 16 << 20  # largest file the snippet may write (RLIMIT_FSIZE)
    open_files: int = 64
    max_output_chars: int = 4000  # stdout and stderr together; longer output keeps its head and tail


@dataclass
class SandboxResult:
    output: str  # stdout and stderr, interleaved as written (head and tail past max_output_chars)
    exit_code: int | None  # the snippet's exit status; None when a limit or a signal ended it
    error: str | None  # why the run failed (nonzero exit, a limit, a signal), or None

    @property
    def ok(self) -> bool:
        return self.error is None


class SandboxPool:
    """Runs snippets in sandboxes, at most `slots` at once (each slot its own uid when isolated)."""

    # Slot uids are BASE_UID + (pid << 8) + k: unique across the live processes of a host (pids are at most 2^22)
    # and across the pools of one process (k counts their slots), so no two slots share a process limit or files.
    BASE_UID, SLOTS_PER_PROCESS = 1 << 20, 1 << 8
    _slots_taken = 0

    def __init__(self, slots: int = 4, limits: SandboxLimits | None = None, root: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.isolated = os.geteuid() == 0
        self.root = root  # where scratch directories are made (default: the system temp dir)
        first = SandboxPool._slots_taken
        if first + slots > self.SLOTS_PER_PROCESS:
            raise ValueError(f"at most {self.SLOTS_PER_PROCESS} sandbox slots per process")
        SandboxPool._slots_taken += slots
        self.uids = [self.BASE_UID + (os.getpid() << 8) + first + k for k in range(slots)]
        self._slots, self._queue, self._queue_loop = slots, None, None
        self._remove_orphaned_scratch()

    def _remove_orphaned_scratch(self) -> None:
        """Scratch dirs of processes that died mid-run (a killed agent-loop worker never reaches its cleanup):
        their names carry the dead pid."""
        root = self.root or tempfile.gettempdir()
        for name in os.listdir(root):
            parts = name.split("-")
            if name.startswith(_PREFIX) and len(parts) > 3 and parts[2].isdigit() and not _alive(int(parts[2])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _free_slots(self) -> asyncio.Queue[int]:
        # An asyncio.Queue belongs to one event loop; a new loop (another asyncio.run) gets a fresh one.
        loop = asyncio.get_running_loop()
        if self._queue_loop is not loop:
            self._queue, self._queue_loop = asyncio.Queue(), loop
            for slot in range(self._slots):
                self._queue.put_nowait(slot)
        assert self._queue is not None
        return self._queue

    async def run(self, code: str) -> SandboxResult:
        slots = self._free_slots()
        slot = await slots.get()
        try:
            return await self._run(code, slot)
        finally:
            slots.put_nowait(slot)

    async def _run(self, code: str, slot: int) -> SandboxResult:
        uid = self.uids[slot]
        scratch = os.path.realpath(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-{slot}-", dir=self.root))
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            if self.isolated:
                os.chown(scratch, uid, uid)
            os.chmod(scratch, 0o700)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(asdict(self.limits)), str(uid), scratch,
                "1" if self.isolated else "0", json.dumps(_interpreter_dirs()), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            try:  # the launcher enforces the wall clock; this bound only catches a launcher that hangs
                output = await asyncio.wait_for(self._read(proc), self.limits.wall_seconds + 10)
                return SandboxResult(output, *self._interpret(await proc.wait()))
            except TimeoutError:
                return SandboxResult("", None, "the sandbox did not finish (its launcher hung)")
            finally:
                if proc.returncode is None:
                    proc.kill()  # the launcher; the snippet dies with it (PR_SET_PDEATHSIG)
                    await proc.wait()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def _read(self, proc: asyncio.subprocess.Process) -> str:
        """The output, or its head and tail (max_output_chars in all) when longer: a traceback ends with its
        reason. Everything is read, so the snippet never blocks on a full pipe; only the two ends are kept."""
        half = self.limits.max_output_chars // 2
        head, tail, total = bytearray(), bytearray(), 0
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            total += len(chunk)
            room = max(4 * half - len(head), 0)
            head += chunk[:room]
            tail = (tail + chunk[room:])[-4 * half:]
        text = (head + tail).decode("utf-8", errors="replace")
        if len(text) <= 2 * half:
            return text
        cut = len(text) - 2 * half + total - len(head) - len(tail)
        return f"{text[:half]}\n... [{cut} characters cut] ...\n{text[-half:]}"

    def _interpret(self, status: int) -> tuple[int | None, str | None]:
        lim = self.limits
        if status == 0:
            return 0, None
        if status == WALL_CLOCK:
            return None, f"wall-clock limit of {lim.wall_seconds:g} s exceeded"
        if status == SETUP_FAILED:
            return None, "the sandbox could not be set up (see output)"
        if status > SIGNALLED:
            sig = status - SIGNALLED
            if sig == signal.SIGXCPU:
                return None, f"CPU time limit of {lim.cpu_seconds} s exceeded"
            if sig == signal.SIGXFSZ:
                return None, f"file size limit of {lim.file_bytes} bytes exceeded"
            return None, f"killed by signal {signal.Signals(sig).name}"
        return status, f"exit code {status}"
