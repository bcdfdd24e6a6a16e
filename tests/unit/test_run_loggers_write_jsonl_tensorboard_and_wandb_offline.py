"""`RunLogger` with every logger of `trainer.logger`: metrics.jsonl holds each step, tensorboard events read back
with tensorboard's EventAccumulator hold the same scalars, wandb in offline mode writes its run file under the run
folder with the same history, and the console prints one progress line per step (not every metric)."""

import json
import struct

import pytest

from mrl.trainer.loggers import ConsoleLogger, make_loggers, scalars
from mrl.trainer.metrics import RunLogger

STEPS = [
    {"reward/mean": 0.25, "response_length/mean": 12.5, "timing_s/gen": 1.5, "timing_s/update_actor": 0.5,
     "timing_s/step": 2.5, "perf/tokens_per_s": 400.0, "perf/tokens_per_s_per_gpu": 200.0, "staleness/max": 0.0,
     "memory/rss_peak_gib/update_actor": 1.25, "actor/updates": 2},
    {"reward/mean": 0.75, "response_length/mean": 10.0, "timing_s/gen": 1.0, "timing_s/update_actor": 0.5,
     "timing_s/step": 1.5, "perf/tokens_per_s": 500.0, "perf/tokens_per_s_per_gpu": 250.0, "staleness/max": 0.0,
     "memory/rss_peak_gib/update_actor": 1.5, "actor/updates": 2, "val/greedy_acc": 0.5},
]


def wandb_history(run_file):
    """History rows of a .wandb file: W&B's record log (a 7-byte file header, then LevelDB-log records in 32 KiB
    blocks, each with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last), protobuf
    `Record`s inside."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, rows = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_every_logger_writes_the_steps_it_is_given(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    logger = RunLogger(run, ["console", "jsonl", "tensorboard", "wandb"], total_steps=4, project="p",
                       experiment="e", config={"trainer": {"seed": 1}})
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": i + 1, **m} for i, m in enumerate(STEPS)]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(scalars(STEPS[0])) <= tags and "val/greedy_acc" in tags
    for key in ("reward/mean", "perf/tokens_per_s_per_gpu", "memory/rss_peak_gib/update_actor"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(1, STEPS[0][key]), (2, STEPS[1][key])]
    assert [e.step for e in events.Scalars("val/greedy_acc")] == [2]

    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = [h for h in wandb_history(run_file) if "reward/mean" in h]
    assert [(h["_step"], h["reward/mean"], h["perf/tokens_per_s"]) for h in history] == [(1, 0.25, 400.0),
                                                                                        (2, 0.75, 500.0)]

    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2
    assert lines[0].startswith("step 1/4 " + "━" * 5 + "─" * 15)  # the bar reads without colour too
    assert "reward 0.250" in lines[0] and "gen 1.50s" in lines[0]
    assert "val_acc 0.500" in lines[1] and "ETA 0:03" in lines[1]  # step 2's 1.5 s × 2 steps left (step 1 warms up)
    assert "memory" not in lines[0] and "updates" not in lines[0]  # a progress line, not a dump


def test_console_line_without_a_total_and_the_final_step_has_no_eta():
    console = ConsoleLogger(total_steps=2)
    assert "ETA" not in console.line(2, {"timing_s/step": 1.0}).plain
    assert console.line(0, {"val/greedy_acc": 0.25}).plain.startswith("step 0/2")
    assert ConsoleLogger().line(3, {"reward/mean": 1.0}).plain == "step 3 │ reward 1.000"


def test_file_loggers_need_a_run_folder_and_unknown_names_are_refused():
    assert [type(x).__name__ for x in make_loggers(["console", "jsonl", "tensorboard"], None)] == ["ConsoleLogger"]
    with pytest.raises(ValueError, match=r"trainer.logger=.*unknown \['mlflow'\]"):
        make_loggers(["console", "mlflow"], None)


def test_scalars_keep_finite_numbers_only():
    assert scalars({"a": 1, "b": 2.5, "c": float("nan"), "d": True, "e": "x", "f": [1]}) == {"a": 1.0, "b": 2.5}
