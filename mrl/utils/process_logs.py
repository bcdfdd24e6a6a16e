"""Where each process of a run writes its output, said on the console at start-up.

Ray redirects every worker process's stdout and stderr to files under its session's `logs/` folder and, unless
`mrl train --verbose` (Ray's `log_to_driver`), does not copy them to the console: a worker's traceback, a vLLM
engine's warning or an agent loop's print is only there. Each process reports its own files (the targets of its
file descriptors 1 and 2), so the lines name the exact file of every training worker, rollout replica and agent-loop
worker; processes those start themselves (a vLLM engine core, a backend's server) write to their parent's files
unless they are Ray workers of their own (multi-device vLLM engines), which sit in the same folder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

VERBOSE_HINT = "mrl train --verbose streams them to this console"


def own_log_files() -> list[str]:
    """The files this process's stdout and stderr go to (none when they are a terminal or a pipe)."""
    files: list[str] = []
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc (not Linux) or a closed descriptor
            continue
        if os.path.isfile(target) and target not in files:
            files.append(target)
    return files


def own_log_tail(lines: int = 30) -> str:
    """The last `lines` lines of this process's stderr file (what a child process, e.g. vLLM's engine core,
    printed before it failed), headed by the file's path; "" when stderr is not a file."""
    files = own_log_files()
    if not files:
        return ""
    path = files[-1]  # stderr's file when the two differ (Ray: worker-<id>.err)
    with open(path, errors="replace") as f:
        tail = f.readlines()[-lines:]
    return f"last {len(tail)} lines of {path}:\n" + "".join(tail)


def ray_logs_dir() -> str | None:
    """The local Ray session's log folder, or None when this process holds no Ray node."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # no public accessor in Ray 2.x
    return node.get_logs_dir_path() if node is not None else None


def _pid_and_files(_actor: Any) -> tuple[int, list[str]]:
    return os.getpid(), own_log_files()


def describe_process_logs(named_actors: Sequence[tuple[str, Any]], timeout_s: float = 30.0) -> list[str]:
    """One console line per (name, Ray actor): its pid and the files it writes to. Never fails a start-up: an
    actor that does not answer in time is named as such."""
    import ray

    refs = [actor.__ray_call__.remote(_pid_and_files) for _, actor in named_actors]
    lines = []
    for (name, _), ref in zip(named_actors, refs):
        try:
            pid, files = ray.get(ref, timeout=timeout_s)
        except Exception as err:  # a log line must not stop the run it describes
            lines.append(f"[mrl] logs of {name}: not known ({type(err).__name__})")
            continue
        lines.append(f"[mrl] logs of {name} (pid {pid}): {_joined(files)}")
    return lines


def _joined(files: list[str]) -> str:
    """Ray's pair `worker-<id>.out` / `.err` as one path, for lines a user can read."""
    if len(files) == 2 and files[0].endswith(".out") and files[1] == files[0][:-4] + ".err":
        return f"{files[0]} (and .err)"
    return ", ".join(files) or "this console"
