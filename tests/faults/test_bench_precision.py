"""scripts/bench_precision.py on data a user brings: Criteo text through a config of theirs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_precision.py"


def _criteo_text(path: Path, records: int, seed: int = 0) -> None:
    """Criteo display-advertising lines (label, 13 integers, 26 hex categoricals) whose
    clicks follow a planted model of the categoricals."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(26, 40))
    cats = rng.integers(0, 40, (records, 26))
    p = 1 / (1 + np.exp(-w[np.arange(26), cats].sum(axis=1) / 3))
    labels = (rng.random(records) < p).astype(int)
    ints = rng.integers(-1, 50, (records, 13))
    with open(path, "w", encoding="utf-8") as fh:
        for y, iv, cv in zip(labels, ints, cats):
            hexes = [f"{(int(c) * 2654435761 + f) % (1 << 32):08x}" for f, c in enumerate(cv)]
            fh.write("\t".join([str(y), *map(str, iv), *hexes]) + "\n")


def _bench(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_criteo_text_through_a_users_config_counts_the_bytes_of_each_precision(tmp_path):
    _criteo_text(tmp_path / "day.txt", 4000)
    (tmp_path / "criteo.toml").write_text(  # a relative path, read from the working directory
        '[data]\nsource = "criteo"\npath = "day.txt"\neval_records = 800\n\n'
        "[train]\nbatch_size = 256\nlog_every = 3\neval_every = 0\n")
    done = _bench(tmp_path, "--data", "criteo.toml", "--ranks", "2", "--steps", "9",
                  "--only", "4,6", "--seeds", "2", "--json", "rows.json")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["setting"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert list(rows) == ["float32", "comms fp16 (loss scale 1024)",
                          "comms int8 fwd, bf16 bwd"], list(rows)
    ref = rows["float32"]["bytes"]
    fp16 = rows["comms fp16 (loss scale 1024)"]["bytes"]
    int8 = rows["comms int8 fwd, bf16 bwd"]["bytes"]
    assert ref["emb_forward"] > 0 and ref["dense"] > 0, ref
    assert all(2 * fp16[k] == ref[k] for k in ref), (fp16, ref)  # every exchange halved
    # int8 rows of 16 values: 16 codes and a float32 scale and bias, 24 bytes for 64
    assert int8["emb_forward"] * 64 == ref["emb_forward"] * 24, (int8, ref)
    assert 2 * int8["emb_backward"] == ref["emb_backward"], (int8, ref)
    for r in rows.values():
        assert 0.0 <= r["auc"] <= 1.0 and r["step"] == 9 and r["data"] == "criteo.toml", r
        # two seeds each: the mean, its spread, and the difference to float32's mean
        assert len(r["aucs"]) == 2 and r["auc"] == sum(r["aucs"]) / 2, r
        assert r["auc_spread"] >= 0 and r["fp32_spread"] == rows["float32"]["auc_spread"], r
        assert r["auc_delta"] == r["auc"] - rows["float32"]["auc"], r
        assert r["within"] == (abs(r["auc_delta"]) <= max(0.002, r["fp32_spread"])), r
    assert "comms fp16 (loss scale 1024)" in done.stdout and "bytes/fp32" in done.stdout
    assert "--seed 1" in done.stdout and "fp32 sp" in done.stdout


def test_a_missing_data_file_is_named(tmp_path):
    done = _bench(tmp_path, "--data", "nowhere.txt")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--data nowhere.txt" in done.stderr and "no such file" in done.stderr, done.stderr
