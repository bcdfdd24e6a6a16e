"""Logs reach the user: `mrl train --verbose` (anywhere on the line) turns on Ray's log_to_driver, so every worker's
output streams to the console; without it the start-up names the Ray logs folder and, per process (training
workers, each rollout replica's server, agent-loop workers), the file its stdout and stderr go to. No Ray here:
the plumbing is checked up to `ray.init`'s arguments and with stand-in actors."""

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from test_config_rejects_invalid_settings import DENSE

from mrl import cli
from mrl.trainer import build
from mrl.trainer import main as train_main
from mrl.utils import process_logs


@pytest.fixture
def train_args(tmp_path) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(DENSE))
    (tmp_path / "train.jsonl").write_text('{"prompt": "hi"}\n' * 16)
    return ["tiny/grpo", f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            "data.max_prompt_length=64", "data.max_response_length=16"]


@pytest.mark.parametrize(("flags", "verbose"), [([], False), (["--verbose"], True), (["-v"], True)])
def test_the_verbose_flag_reaches_ray_init_from_anywhere_on_the_line(train_args, monkeypatch, flags, verbose):
    seen: list[bool] = []

    def stop_at_ray(*_: Any, verbose: bool = False, **__: Any) -> None:
        seen.append(verbose)
        raise SystemExit(0)  # the run itself is not under test

    monkeypatch.setattr(train_main, "init_ray", stop_at_ray)
    with pytest.raises(SystemExit):
        cli.main(["train", *train_args[:2], *flags, *train_args[2:]])
    assert seen == [verbose]


@pytest.mark.parametrize("address", [None, "auto"])
@pytest.mark.parametrize("verbose", [False, True])
def test_init_ray_streams_worker_output_only_when_verbose(monkeypatch, address, verbose):
    import ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    train_main.init_ray(address, verbose=verbose)
    assert calls[0]["log_to_driver"] is verbose


def test_a_process_names_the_files_its_output_goes_to(tmp_path):
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    with out.open("w") as stdout, err.open("w") as stderr:  # as Ray redirects a worker's output
        subprocess.run([sys.executable, "-c", "import json, sys; from mrl.utils.process_logs import own_log_files; "
                        "sys.stderr.write(json.dumps(own_log_files()))"], stdout=stdout, stderr=stderr, check=True)
    assert json.loads(err.read_text()) == [str(out), str(err)]
    piped = subprocess.run([sys.executable, "-c", "from mrl.utils.process_logs import own_log_files; "
                            "print(own_log_files())"], capture_output=True, text=True, check=True)
    assert piped.stdout.strip() == "[]"  # a pipe or terminal is no file to point at


def test_a_failed_engine_start_can_quote_what_its_child_processes_printed(tmp_path):
    """A replica that fails to start quotes its stderr file's tail (vLLM's engine core prints the root cause
    there, in a child process that shares the file)."""
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    script = ("import subprocess, sys; from mrl.utils.process_logs import own_log_tail; "
              "subprocess.run([sys.executable, '-c', 'import sys; [print(f\"line {i}\", file=sys.stderr) "
              "for i in range(50)]; print(\"ValueError: root cause\", file=sys.stderr)']); "
              "print(own_log_tail(lines=3))")
    with out.open("w") as stdout, err.open("w") as stderr:
        subprocess.run([sys.executable, "-c", script], stdout=stdout, stderr=stderr, check=True)
    assert out.read_text() == f"last 3 lines of {err}:\nline 48\nline 49\nValueError: root cause\n\n"
    piped = subprocess.run([sys.executable, "-c", "from mrl.utils.process_logs import own_log_tail; "
                            "print(repr(own_log_tail()))"], capture_output=True, text=True, check=True)
    assert piped.stdout.strip() == "''"


class StandInActor:
    """Runs `__ray_call__` in this process, as Ray runs it inside the actor."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.__ray_call__ = SimpleNamespace(remote=self._call)

    def _call(self, fn: Any) -> Any:
        if self.fails:
            return TimeoutError()
        return fn(self)


def test_start_up_lines_name_every_process_and_survive_one_that_does_not_answer(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: (_ for _ in ()).throw(ref) if isinstance(
        ref, Exception) else ref)
    monkeypatch.setattr(process_logs, "own_log_files", lambda: ["/tmp/ray/session/logs/worker-1.out",
                                                                "/tmp/ray/session/logs/worker-1.err"])
    group = SimpleNamespace(workers=[StandInActor(), StandInActor()])
    rollout = SimpleNamespace(replicas={1: SimpleNamespace(server=StandInActor()),
                                        0: SimpleNamespace(server=None, members={"prefill": StandInActor(),
                                                                                 "decode0": StandInActor()})})
    agent_loops = SimpleNamespace(workers=[StandInActor(fails=True)])
    named = build.log_sources(group, None, rollout, agent_loops, "vllm")
    assert [name for name, _ in named] == [
        "training worker 0", "training worker 1", "rollout replica 0 prefill (vllm server and its engine)",
        "rollout replica 0 decode0 (vllm server and its engine)", "rollout replica 1 (vllm server and its engine)",
        "agent-loop worker 0"]
    lines = process_logs.describe_process_logs(named)
    assert lines[0].startswith("[mrl] logs of training worker 0 (pid ")
    assert lines[0].endswith("): /tmp/ray/session/logs/worker-1.out (and .err)")
    assert lines[-1] == "[mrl] logs of agent-loop worker 0: not known (TimeoutError)"
