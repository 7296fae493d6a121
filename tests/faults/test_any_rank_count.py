"""The README's training job and the own-data walk-through run on any number of ranks.

Real jobs through ``neocomm run``, a few steps each: ``neocomm train`` with its
built-in defaults, then ``neocomm data example`` and the config it writes
trained and used for predictions, at 1, 3 and 5 ranks (2048, the default
global batch, splits over none of 3 and 5; the 3 ranks on emulated nodes of
uneven size, 2 + 1); the PyTorch DLRM example on 3 ranks; and a checkpoint
written on 2 ranks resumed on 3.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _jobs import run_job

JOB_TIMEOUT = 240  # seconds; a hang shows up as exit 124
AUC = re.compile(r"AUC (0\.\d{4})")


def _run(cwd, args, n, launcher_args=None):
    """The finished job; no process and no /dev/shm file of it outlived it."""
    job = run_job(args, n=n, cwd=cwd, timeout=JOB_TIMEOUT,
                  launcher_args=launcher_args).check_clean()
    assert job.returncode == 0, job.output
    return job


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``neocomm data example`` (a small one): its directory, holding demo/train.toml."""
    where = tmp_path_factory.mktemp("walkthrough")
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", "data", "example", "-o", "demo",
                          "--records", "20000"], cwd=where, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (where / "demo" / "train.toml").is_file()
    return where


@pytest.mark.parametrize("n, per_node", [(1, None), (3, 2), (5, None)],
                         ids=["1", "3 on nodes of 2+1", "5"])
def test_the_readme_job_and_the_walkthrough_run_on_n_ranks(n, per_node, demo, tmp_path):
    """3 ranks run on emulated nodes of uneven size (2 + 1), as on two hosts of 2 and 1."""
    expected = 2048 // n * n
    note = "(default)" if expected == 2048 else \
        f"(default 2048 rounded down to a multiple of {n} ranks)"
    nodes = ["--ranks-per-node", str(per_node)] if per_node else None
    job = _run(tmp_path, ["neocomm", "train", "--steps", "2"], n, nodes)
    assert f"{n} rank(s)" in job.stdout and f"global batch {expected} {note}" in job.stdout, \
        job.stdout
    assert AUC.search(job.stdout), job.stdout
    assert (tmp_path / "neocomm-out" / "checkpoints" / "step-000000000002").is_dir()

    runs = tmp_path / "runs"
    job = _run(demo, ["neocomm", "train", "--config", "demo/train.toml", "--steps", "2",
                      "--out", str(runs)], n, nodes)
    assert f"global batch {expected} {note}" in job.stdout, job.stdout
    assert "test AUC" in job.stdout and AUC.search(job.stdout), job.stdout
    scores = tmp_path / "scores.parquet"
    job = _run(demo, ["neocomm", "predict", "--checkpoint", str(runs), "--data",
                      "demo/test.parquet", "--out", str(scores)], n, nodes)
    assert AUC.search(job.stdout), job.stdout
    import pyarrow.parquet as pq

    assert pq.read_metadata(scores).num_rows == 2000


def test_a_checkpoint_written_on_2_ranks_resumes_on_3(demo, tmp_path):
    """The default global batch (2048 on 2 ranks) does not split over 3: the resumed run
    goes on with 2046 from where the checkpoint's data position falls in its batches."""
    runs = str(tmp_path / "runs")
    _run(demo, ["neocomm", "train", "--config", "demo/train.toml", "--steps", "2",
                "--out", runs], 2)
    job = _run(demo, ["neocomm", "train", "--config", "demo/train.toml", "--steps", "3",
                      "--out", runs, "--resume"], 3)
    out = job.stdout
    assert "at step 2" in out and "trained 1 step(s)" in out, out
    # 2 batches of 2048 read = 4096 records: the first batch of 2046 at or after them is the 3rd
    assert "training goes on with 2046 from epoch 0, batch 3" in out, out
    assert (tmp_path / "runs" / "checkpoints" / "step-000000000003").is_dir()


def test_the_pytorch_example_runs_on_3_ranks(tmp_path):
    """``scripts/torch_dlrm.py`` (a PyTorch loop around the sharded module) on 3 ranks, with
    the default batch fitted to them."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "torch_dlrm.py"
    job = _run(tmp_path, [sys.executable, str(script), "--steps", "5"], 3)
    found = re.search(r"neocomm embeddings: 5 steps .* held-out AUC (0\.\d+)", job.stdout)
    assert found, job.output
