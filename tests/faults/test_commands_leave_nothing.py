"""Every ``neocomm`` command leaves /dev/shm and the temporary directory as it found them.

Each command runs alone (an MPI singleton, where it starts MPI at all) and, for
the ones that run as jobs, under ``neocomm run``. What counts is only what
that command made: the files that appear in /dev/shm while it runs (other jobs
may share the host), and anything in a temporary directory of its own
(``TMPDIR``) afterwards.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _jobs import run_job
from _shm import SHM, left_since
from neocomm import _LAUNCHED_BY

TIMEOUT = 180


def _alone(argv: list[str], cwd, tmp) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY}
    env["TMPDIR"] = str(tmp)
    before = set(os.listdir(SHM))
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", *argv], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    new = left_since(before)
    assert out.returncode == 0, f"neocomm {' '.join(argv)}:\n{out.stdout}\n{out.stderr}"
    assert new == [], f"neocomm {' '.join(argv)} left {new} in {SHM}"
    return out


def _private_tmp(where, name):
    tmp = where / f"tmp-{name}"
    tmp.mkdir()
    return tmp


def _left_in(tmp) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory with the example data set, a CSV to convert and a trained checkpoint."""
    where = tmp_path_factory.mktemp("commands")
    tmp = _private_tmp(where, "setup")
    _alone(["data", "example", "-o", "demo", "--records", "4000"], where, tmp)
    _alone(["train", "--config", "demo/train.toml", "--steps", "2", "--out", "runs"], where,
           tmp)
    (where / "clicks.csv").write_text("label,user,item\n1,a,x\n0,b,y\n1,a,z\n")
    assert _left_in(tmp) == [], f"neocomm data example / train left {_left_in(tmp)} in TMPDIR"
    return where


#: every command, with arguments that make it do its work on the files of ``work``
COMMANDS = {
    "info": ["info"],
    "info --json": ["info", "--json"],
    "topo": ["topo"],
    "topo --json": ["topo", "--json"],
    "bench": ["bench", "all_reduce", "-b", "1K", "-e", "4K", "-n", "2", "-w", "0"],
    "fabric validate": ["fabric", "validate", "cpu-host"],
    "fabric presets": ["fabric", "presets"],
    "plan": ["plan", "tiny", "-n", "3"],
    "plan --config": ["plan", "--config", "demo/train.toml", "-n", "2"],
    "simulate collective": ["simulate", "collective", "all_to_all", "--fabric", "zionex",
                            "-n", "16", "-b", "1M", "-e", "4M"],
    "simulate step": ["simulate", "step", "--config", "demo/train.toml", "--fabric", "zionex",
                      "-n", "8"],
    "data stats": ["data", "stats", "--config", "demo/train.toml"],
    "data inspect": ["data", "inspect", "--config", "demo/train.toml", "--rows", "2"],
    "data convert": ["data", "convert", "clicks.csv", "-o", "clicks.parquet"],
    "train": ["train", "--config", "demo/train.toml", "--steps", "1", "--out", "runs-again"],
    "predict": ["predict", "--checkpoint", "runs", "--data", "demo/test.parquet", "--out",
                "scores.parquet"],
    "checkpoint inspect": ["checkpoint", "inspect", "runs"],
    "checkpoint export": ["checkpoint", "export", "runs/checkpoints/step-000000000002",
                          "--out", "int8"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_run_alone_leaves_nothing(name, work):
    tmp = _private_tmp(work, name.replace(" ", "_"))
    out = _alone(COMMANDS[name], work, tmp)
    assert out.stdout.strip(), f"neocomm {name} printed nothing"
    assert _left_in(tmp) == [], f"neocomm {name} left {_left_in(tmp)} in its TMPDIR"


#: the commands that run as jobs of several ranks
JOBS = ["topo", "bench", "fabric validate", "train", "predict"]


@pytest.mark.parametrize("name", JOBS)
def test_a_command_run_as_a_job_leaves_nothing(name, work):
    tmp = _private_tmp(work, f"job-{name.replace(' ', '_')}")
    job = run_job(["neocomm", *COMMANDS[name]], n=2, cwd=work, env={"TMPDIR": str(tmp)},
                  timeout=TIMEOUT).check_clean()
    assert job.returncode == 0, job.output
    assert _left_in(tmp) == [], f"neocomm run -n 2 -- neocomm {name} left {_left_in(tmp)} " \
                                f"in its TMPDIR"
