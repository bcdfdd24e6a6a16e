"""`mrl train`'s last line says where the run went: its folder, the log files there and the complete checkpoints
(or that none was saved), and how to plot it."""

from types import SimpleNamespace

from mrl.trainer import checkpointing
from mrl.trainer.main import closing_line


def test_closing_line_lists_files_and_complete_checkpoints(tmp_path):
    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path)))
    assert closing_line(cfg, 0, 3.0) == (f"[mrl] done: 0 steps in 3 s; run folder {tmp_path}: no logs; no checkpoint "
                                         f"(trainer.save_freq=-1); plot it with `mrl report {tmp_path}`")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "rollouts.jsonl").write_text("{}\n")
    for step in (2, 4):
        staging = checkpointing.staging_dir(str(tmp_path), step)
        checkpointing.commit(staging, checkpointing.step_dir(str(tmp_path), step))
    (tmp_path / "global_step_6").mkdir()  # incomplete: not listed
    line = closing_line(cfg, 4, 125.0)
    assert line.startswith(f"[mrl] done: 4 steps in 2 min 5 s; run folder {tmp_path}: metrics.jsonl, rollouts.jsonl;")
    assert "checkpoints global_step_2, global_step_4;" in line
