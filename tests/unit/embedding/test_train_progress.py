"""Rank 0's progress bar, the JSON-lines metrics log, the plot, the step's timers and threads."""
from __future__ import annotations

import io
import json
import os
import sys

import pytest

from embedding.train import PlotUnavailable, plot_metrics
from embedding.train.metrics import MetricsLog, phase_summary, read_metrics
from embedding.train.progress import ProgressBar, format_eta, format_rate, progress_mode
from embedding.train.step import PhaseTimer
from embedding.train.threads import default_threads, limit_blas_threads, ranks_on_host
from embedding.train.types import Phase


def test_lines_every_n_steps_and_on_the_last():
    out = io.StringIO()
    bar = ProgressBar(10, stream=out, every=4, tty=False)
    for step in range(1, 11):
        bar.update(step, loss=0.5, rate=1234.0, eta=10 - step)
    lines = out.getvalue().splitlines()
    assert [ln.split("/")[0].split()[-1] for ln in lines] == ["4", "8", "10"]
    assert "\r" not in out.getvalue()
    assert "loss 0.5000" in lines[0] and "1.2k samples/s" in lines[0]
    bar.auc = 0.7512
    bar.message("evaluated")
    bar.update(10, loss=0.4)
    assert out.getvalue().splitlines()[-2:] == ["evaluated", bar.line(10, 0.4, None, None)]
    assert "auc 0.7512" in out.getvalue().splitlines()[-1]


def test_bar_redraws_in_place_on_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(3, stream=out, tty=True, max_hz=0)
    bar.update(1, 0.7)
    bar.update(2, 0.6)
    bar.message("checkpoint written")
    bar.update(3, 0.5)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "checkpoint written\n" in text
    assert "[####################] 100%" in text


def test_disabled_and_off_are_silent(monkeypatch):
    out = io.StringIO()
    ProgressBar(3, stream=out, enabled=False).update(3, 0.1)
    monkeypatch.setenv("NEOCOMM_PROGRESS", "off")
    bar = ProgressBar(3, stream=out)
    bar.update(3, 0.1)
    bar.message("x")
    assert out.getvalue() == ""


def test_progress_mode_under_a_launcher():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_mode(Tty(), {}) == "bar"
    assert progress_mode(io.StringIO(), {}) == "lines"
    assert progress_mode(Tty(), {"OMPI_COMM_WORLD_SIZE": "4"}) == "lines"
    assert progress_mode(Tty(), {"OMPI_COMM_WORLD_SIZE": "4", "NEOCOMM_STDOUT_TTY": "1"}) == "bar"
    assert progress_mode(io.StringIO(), {"NEOCOMM_PROGRESS": "bar"}) == "bar"


def test_formats():
    assert format_rate(950) == "950" and format_rate(41234) == "41.2k"
    assert format_rate(1.31e6) == "1.31M"
    assert format_eta(65) == "1:05" and format_eta(3725) == "1:02:05"


def test_metrics_log_appends_json_lines(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("start", step=0, world_size=2, plan={"table_wise": ["a"]})
    log.write("train", step=5, loss=0.5, phases_ms={"dense": 1.0})
    log.close()
    again = MetricsLog(path)  # a resumed run appends
    again.write("eval", step=5, auc=0.75)
    again.close()
    MetricsLog(tmp_path / "other.jsonl", enabled=False).write("train", step=1)
    assert not (tmp_path / "other.jsonl").exists()
    with open(path, "a") as fh:
        fh.write("{not json\n")
    records = read_metrics(path)
    assert [r["event"] for r in records] == ["start", "train", "eval"]
    assert all("time" in r for r in records)
    assert json.loads(path.read_text().splitlines()[1])["loss"] == 0.5


def test_phase_summary_and_timer():
    assert phase_summary({"dense": 3.0, "lookup": 1.0}) == "dense 3.0 ms (75%), lookup 1.0 ms (25%)"
    t = PhaseTimer()
    with t(Phase.DENSE):
        pass
    t.add(Phase.LOOKUP, 0.5)
    got = t.reset()
    assert got[Phase.LOOKUP] == 0.5 and got[Phase.DENSE] >= 0
    assert t.reset()[Phase.LOOKUP] == 0.0


def _log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("start", step=0, planted_auc=0.8)
    for s in (5, 10):
        log.write("train", step=s, loss=0.6 - s / 100, loss_avg=0.6)
        log.write("eval", step=s, auc=0.7 + s / 100, log_loss=0.5, records=10)
    log.close()
    return path


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match="matplotlib is not installed"):
        plot_metrics(_log(tmp_path), tmp_path / "plot.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PlotUnavailable, match="no training"):
        plot_metrics(empty, tmp_path / "plot.png")


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional")
    out = plot_metrics(_log(tmp_path), tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_threads_per_rank(monkeypatch):
    import numpy  # noqa: F401 - loads OpenBLAS

    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert ranks_on_host() == 4
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    assert ranks_on_host(3) == 3
    assert default_threads(10**6) == 1
    assert default_threads(1) == len(os.sched_getaffinity(0))


def _blas_threads() -> int | None:
    """The thread count the OpenBLAS loaded into this process reports, or None."""
    import ctypes

    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        libs = sorted({line.split()[-1] for line in fh if "openblas" in line.lower()})
    for path in libs:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                     "openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    return None


def test_limit_blas_threads_sets_the_loaded_openblas():
    import numpy as np

    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    if "openblas" not in blas:
        assert limit_blas_threads(1) is False  # nothing of ours to set
        return
    np.ones((64, 64)) @ np.ones((64, 64))  # BLAS is loaded and has run
    before = _blas_threads()
    try:
        for n in (1, 2, 1):
            assert limit_blas_threads(n) is True
            assert _blas_threads() == n
    finally:
        limit_blas_threads(before)
