"""scripts/bench_embedding.py cpu on a small case: the whole step, and with --lookup the pooled
lookup alone (beside FBGEMM's forward where fbgemm_gpu loads)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_embedding.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_embedding", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _run(tmp_path, capsys, *extra):
    out = tmp_path / "bench.json"
    rc = _bench().main(["cpu", "--tables", "2", "--rows", "200", "--dims", "16", "--batch", "64",
                        "--ids-per-bag", "4", "--optimizers", "sgd", "--iters", "1",
                        "--repeat", "1", "--warmup", "0", "--clock", "cpu", "--json", str(out),
                        *extra])
    assert rc in (0, None)
    return json.loads(out.read_text()), capsys.readouterr().out


def test_lookup_is_timed_alone_beside_the_whole_step(tmp_path, capsys):
    rows, printed = _run(tmp_path, capsys, "--lookup")
    assert len(rows) == 1, rows
    ms = rows[0]["ms"]
    assert ms["neocomm compiled"] > 0 and ms["neocomm lookup"] > 0, ms
    assert "neocomm lookup" in printed, printed
    if "fbgemm" in ms:   # fbgemm_gpu loads here: its forward is timed too, and the ratio shown
        assert ms["fbgemm forward"] > 0, ms
        assert rows[0]["lookup_vs_fbgemm"] == pytest.approx(ms["fbgemm forward"]
                                                            / ms["neocomm lookup"])
        assert "lookup alone" in printed, printed
    else:
        assert "fbgemm forward" not in ms and "lookup alone" not in printed, printed


def test_without_the_option_only_the_whole_step_is_timed(tmp_path, capsys):
    rows, printed = _run(tmp_path, capsys)
    assert "neocomm lookup" not in rows[0]["ms"] and "lookup alone" not in printed, printed
