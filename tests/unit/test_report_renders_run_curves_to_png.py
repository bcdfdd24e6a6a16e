"""`mrl report` turns the metrics.jsonl the trainer's RunLogger writes into a PNG of reward, response length, timing
breakdown and log-prob mismatch: a valid image of non-trivial size whose pixels depend on the data, with panels
that lack data named instead of failing."""

import math

import numpy as np
from PIL import Image

from mrl.cli import main
from mrl.tools.report import MFU, THROUGHPUT, draw, load_records, render, series
from mrl.trainer.metrics import RunLogger


def _write_run(run_dir, steps=20, reward_slope=0.04):
    logger = RunLogger(run_dir, ["jsonl"])
    logger.log(0, {"val/greedy_acc": 0.1})  # validation before training: no reward, no timing
    for step in range(1, steps + 1):
        gen, old, update, sync = 2.0 + 0.1 * step, 0.5, 1.5, 0.2
        logger.log(step, {
            "reward/mean": min(1.0, 0.1 + reward_slope * step),
            "response_length/mean": 40.0 + step,
            "timing_s/gen": gen, "timing_s/old_log_prob": old, "timing_s/update_actor": update,
            "timing_s/update_weights": sync, "timing_s/step": gen + old + update + sync + 0.05,
            "rollout/logprob_mismatch": 1.0 + 1e-4 * math.sin(step), "timing_s/reward": 0.1,
            "perf/tokens_per_s_per_gpu": 300.0 + step, "perf/mfu": 0.01 * step,
            "memory/rss_peak_gib/update_actor": 1.5, "memory/rss_peak_gib/old_log_prob": 1.2,
            **({"val/greedy_acc": 0.1 + 0.02 * step} if step % 5 == 0 else {}),
        })
    return run_dir / "metrics.jsonl"


def test_report_writes_a_valid_png_of_nontrivial_size(tmp_path):
    _write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    png = tmp_path / "report.png"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width >= 1000 and img.height >= 1000
        pixels = np.asarray(img.convert("L"), dtype=np.float32)
    assert png.stat().st_size > 30_000
    assert pixels.std() > 10  # curves, bars and text, not a blank canvas


def test_different_curves_give_different_pixels(tmp_path):
    rising = load_records(_write_run(tmp_path / "rising", reward_slope=0.04))
    flat = load_records(_write_run(tmp_path / "flat", reward_slope=0.0))
    render(rising, tmp_path / "a.png")
    render(flat, tmp_path / "b.png")
    a = np.asarray(Image.open(tmp_path / "a.png").convert("L"), dtype=np.int16)
    b = np.asarray(Image.open(tmp_path / "b.png").convert("L"), dtype=np.int16)
    assert a.shape == b.shape and (a != b).sum() > 500


def test_series_skips_records_without_the_key_and_keeps_steps():
    records = [{"step": 0, "val/greedy_acc": 0.1}, {"step": 1, "reward/mean": 0.2},
               {"step": 2, "reward/mean": float("nan")}, {"step": 3, "reward/mean": 0.5}]
    assert series(records, "reward/mean") == ([1, 3], [0.2, 0.5])


def test_missing_panels_are_named_not_fatal(tmp_path):
    missing = render([{"step": 1, "reward/mean": 0.3}], tmp_path / "r.png")
    assert missing == ["response_length/mean", "timing_s/*", "rollout/logprob_mismatch", THROUGHPUT, MFU, "memory/*"]
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_a_run_without_metrics_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_every_panel_has_a_y_label_throughput_and_mfu_apart_and_step_1_does_not_squash_the_bars(tmp_path):
    records = load_records(_write_run(tmp_path))
    records[1]["timing_s/gen"] = records[1]["timing_s/step"] = 60.0  # step 1 compiles: 15x a later step
    fig, _ = draw(records)
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == 7 and all(ax.get_ylabel() for ax in panels)  # no twin axes: one curve per scale
    timing = next(ax for ax in panels if ax.get_title() == "time per step")
    later_peak = max(r["timing_s/step"] for r in records[2:])
    assert timing.get_ylim()[1] < 1.2 * later_peak  # scaled to the later steps
    assert any("warm-up" in t.get_text() for t in timing.texts)


def test_console_log_gives_back_what_its_step_lines_show_and_plots(tmp_path):
    """A run whose metrics.jsonl was lost (a device call brought back only its console output) still plots: each
    step line parses back to the metrics it shows, at its rounding; other lines are skipped."""
    import io

    from rich.console import Console

    from mrl.trainer.loggers import ConsoleLogger

    logs = []
    for name, slope in (("rising", 0.04), ("flat", 0.0)):
        out = io.StringIO()
        logger = ConsoleLogger(total_steps=30, console=Console(file=out, width=80, highlight=False))
        out.write("[mrl] rollout replicas serving (vllm) (56.6 s)\n")
        for step in range(1, 21):
            logger.log(step, {"reward/mean": 0.1 + slope * step, "response_length/mean": 264.54,
                              "rollout/logprob_mismatch": 1.000213, "perf/mfu": 0.0177, "perf/tokens_per_s": 12765.4,
                              "timing_s/gen": 6.894, "timing_s/update_weights": 1.857, "timing_s/step": 9.0,
                              **({"val/greedy_acc": 0.2 + slope * step} if step % 5 == 0 else {})})
        path = tmp_path / f"{name}.log"
        path.write_text(out.getvalue())
        logs.append(path)
    records = load_records(logs[0])
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[4] == {"step": 5, "reward/mean": 0.3, "response_length/mean": 264.5, "val/greedy_acc": 0.4,
                          "rollout/logprob_mismatch": 1.00021, "perf/tokens_per_s": 12765.0, "perf/mfu": 0.0177,
                          "timing_s/gen": 6.89, "timing_s/update_weights": 1.86}
    assert series(records, "val/greedy_acc") == ([5, 10, 15, 20], [0.4, 0.6, 0.8, 1.0])
    assert ConsoleLogger.parse("steps 3 are left") is None
    png = tmp_path / "both.png"
    assert main(["report", *map(str, logs), "--out", str(png)]) == 0
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width >= 1000
