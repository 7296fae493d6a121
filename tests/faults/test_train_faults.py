"""``neocomm train`` as a user runs it: real jobs through ``neocomm run`` with a hard timeout.

A clean run reports its outputs; bad configurations exit 2 and bad data or
checkpoints exit 1 on every rank with a message naming the file and key,
line or record; a rank killed mid-step ends the job non-zero; a job killed
in the middle of writing a checkpoint leaves the previous one to resume
from. A hang would show up as exit 124.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _jobs import KILLER, no_mounts, run_job, small_filesystem
from embedding.checkpoint import latest_checkpoint, list_checkpoints
from embedding.train.metrics import read_metrics

JOB_TIMEOUT = 150  # seconds; a hang shows up as exit 124

CONFIG = """
[tables]
rows = [50, 70, 30, 200]
[model]
embedding_dim = 8
bottom_mlp = [16, 8]
top_mlp = [16, 1]
[data]
records = 4800
eval_records = 96
[train]
steps = 6
batch_size = 48
eval_every = 3
log_every = 2
[checkpoint]
every = 2
"""


def _run(tmp_path, args, n: int = 2, env: dict | None = None, wrap=None):
    """The job's result, after checking it left no process or /dev/shm file and did not hang."""
    return run_job(args, n=n, cwd=tmp_path, env=env, timeout=JOB_TIMEOUT,
                   wrap=wrap).check_clean()


def _script(tmp_path, body: str, n: int = 2):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return _run(tmp_path, [sys.executable, str(script)], n)


def test_neocomm_train_trains_and_says_where_its_outputs_went(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    out = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config", "train.toml",
                          "--out", "run1", "--plot", "--seed", "1"])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "neocomm train: 2 rank(s), 4 tables" in text
    assert "step 6/6" in text and "step 2/6" in text  # one line every 2 steps under a launcher
    assert "trained 6 step(s) (288 samples)" in text
    assert "held-out AUC" in text and "the planted model's AUC on them" in text
    assert "metrics log  run1/metrics.jsonl" in text
    assert "checkpoint   " in text and "step-000000000006" in text
    assert "plot         " in text  # a PNG, or why there is none
    records = read_metrics(tmp_path / "run1" / "metrics.jsonl")
    events = [r["event"] for r in records]
    assert events[0] == "start" and events[-1] == "end"
    assert events.count("train") == 3 and events.count("eval") == 2
    assert events.count("checkpoint") == 3
    start = records[0]
    assert start["world_size"] == 2 and start["config"]["train"]["seed"] == 1
    train = [r for r in records if r["event"] == "train"]
    assert set(train[0]["phases_ms"]) >= {"input_dist", "lookup", "output_dist", "dense",
                                         "optimizer", "grad_sync", "emb_backward"}
    assert latest_checkpoint(tmp_path / "run1" / "checkpoints").name == "step-000000000006"
    inspect = subprocess.run([sys.executable, "-m", "neocomm.cli", "checkpoint", "inspect",
                              str(tmp_path / "run1" / "checkpoints")], capture_output=True,
                             text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stderr
    assert "step 6, world size 2" in inspect.stdout and "all files verified" in inspect.stdout


BAD_INPUTS = r"""
import io, os, sys, contextlib
import numpy as np
import neocomm
from neocomm.cli import main
from embedding.data import BinaryWriter, SyntheticConfig, SyntheticDataset, BinaryDataset

w = neocomm.init()
ROWS = [50, 70, 30, 200]
MODEL = "[model]\nembedding_dim = 8\nbottom_mlp = [16, 8]\ntop_mlp = [16, 1]\n"
TRAIN = "[train]\nsteps = 4\nbatch_size = 48\neval_every = 0\n[data]\neval_records = 48\n"

def text_line(i, label="0", fields=40):
    parts = [label] + [str(i % 7)] * 13 + [f"{(i * 2654435761 + f) % (1 << 32):08x}"
                                           for f in range(26)]
    return "\t".join(parts[:fields]) + "\n"

if w.rank == 0:
    ds = SyntheticDataset(SyntheticConfig(table_sizes=tuple(ROWS), seed=0), 480)
    with BinaryWriter("data.bin", ROWS, chunk_records=8) as bw:
        bw.write_batch(ds.read(0, 480))
    b = BinaryDataset("data.bin")
    off = b.header_bytes + 110 * b.dtype.itemsize + 6   # record 110: the batch of step 3
    with open("data.bin", "r+b") as fh:
        fh.seek(off); x = fh.read(1); fh.seek(off); fh.write(bytes([x[0] ^ 0xFF]))
    with open("cut.txt", "w") as fh:
        fh.writelines(text_line(i) for i in range(149))
        fh.write(text_line(149, fields=17))
    with open("label.txt", "w") as fh:
        fh.writelines(text_line(i, "2" if i == 9 else str(i % 2)) for i in range(200))
    files = {
        "typo.toml": "[train]\nsteps = 5\nbatch_sise = 48\n",
        "type.toml": "[model]\nembedding_dim = \"eight\"\n",
        "bin.toml": MODEL + TRAIN + "source = \"binary\"\npath = \"data.bin\"\n",
        "cut.toml": MODEL + TRAIN + "source = \"criteo\"\npath = \"cut.txt\"\n"
                    "[tables]\npreset = \"tiny\"\n",
        "label.toml": MODEL + TRAIN + "source = \"criteo\"\npath = \"label.txt\"\n"
                      "[tables]\npreset = \"tiny\"\n",
        "good.toml": MODEL + TRAIN.replace("steps = 4", "steps = 2")
                     + "records = 960\n[tables]\nrows = [50, 70, 30, 200]\n",
    }
    for name, text in files.items():
        with open(name, "w") as fh:
            fh.write(text)
w.comm.Barrier()

def case(name, *argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *argv])
    print(f"rank {w.rank} case {name} exit {code}", flush=True)
    if w.rank == 0:
        print(f"case {name} stderr: {err.getvalue().strip()}", flush=True)

case("typo", "--config", "typo.toml")
case("type", "--config", "type.toml")
case("steps", "--steps", "0")
case("missing", "--config", "nowhere.toml")
case("binary", "--config", "bin.toml", "--out", "o-bin")
case("cut", "--config", "cut.toml", "--out", "o-cut")
case("label", "--config", "label.toml", "--out", "o-label")
case("good", "--config", "good.toml", "--out", "o-good")
if w.rank == 0:
    ck = "o-good/checkpoints/step-000000000002"
    f = sorted(p for p in os.listdir(ck + "/rank-00001") if "weight" in p)[0]
    with open(f"{ck}/rank-00001/{f}", "r+b") as fh:
        fh.seek(-2, 2); x = fh.read(1); fh.seek(-2, 2); fh.write(bytes([x[0] ^ 1]))
w.comm.Barrier()
case("checksum", "--config", "good.toml", "--out", "o-good", "--resume", "--steps", "4")
case("nothing", "--config", "good.toml", "--out", "o-none", "--resume")
"""


def test_bad_configs_data_and_checkpoints_exit_nonzero_on_every_rank(tmp_path):
    out = _script(tmp_path, BAD_INPUTS)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    expect = {"typo": 2, "type": 2, "steps": 2, "missing": 2, "binary": 1, "cut": 1,
              "label": 1, "good": 0, "checksum": 1, "nothing": 1}
    for name, code in expect.items():
        for r in range(2):
            assert f"rank {r} case {name} exit {code}" in text, (name, text)
    err = {line.split(" stderr: ")[0][5:]: line.split(" stderr: ", 1)[1]
           for line in text.splitlines() if line.startswith("case ")}
    assert "typo.toml: train.batch_sise: unknown key" in err["typo"]
    assert "type.toml: model.embedding_dim: expected an int" in err["type"]
    assert "--steps" in err["steps"]
    assert "nowhere.toml" in err["missing"] and "cannot read" in err["missing"]
    assert "step 3" in err["binary"] and "data.bin, record 104" in err["binary"]
    assert "crc32" in err["binary"]
    assert "cut.txt, line 150" in err["cut"] and "truncated" in err["cut"]
    assert "label.txt, line 10" in err["label"] and "is not 0 or 1" in err["label"]
    assert "checksum" in err["checksum"] and "rank 1" in err["checksum"]
    assert "no complete checkpoint" in err["nothing"]


DIES = r"""
import os, signal, sys
import neocomm
from embedding.train import loop
from neocomm.cli import main

w = neocomm.init()
original = loop.Trainer._agree_step

def agree_step(self, step, *args):
    if step == {step} and w.rank == {rank}:
        {action}
    return original(self, step, *args)

loop.Trainer._agree_step = agree_step
sys.exit(main(["train", "--config", "train.toml", "--out", "out"]))
"""


def test_a_rank_dying_mid_step_ends_the_job(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    out = _script(tmp_path, DIES.format(step=3, rank=1,
                                        action="os.kill(os.getpid(), signal.SIGKILL)"))
    assert out.returncode not in (0, 124), out.stdout + out.stderr
    latest = latest_checkpoint(tmp_path / "out" / "checkpoints")
    assert latest is not None and latest.name == "step-000000000002"


def test_an_unexpected_error_on_one_rank_aborts_the_job(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    out = _script(tmp_path, DIES.format(step=2, rank=0,
                                        action="raise RuntimeError('a bug on rank 0')"))
    assert out.returncode not in (0, 124), out.stdout + out.stderr
    assert "a bug on rank 0" in out.stderr


KILLED_IN_CHECKPOINT = r"""
import os, signal, sys
import neocomm
from embedding.checkpoint import CheckpointWriter
from neocomm.cli import main

w = neocomm.init()
original = CheckpointWriter.commit

def commit(self, **kw):
    if self.step == 4:  # every rank wrote its part; rank 0 dies before publishing it
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, **kw)

CheckpointWriter.commit = commit
sys.exit(main(["train", "--config", "train.toml", "--out", "out"]))
"""


def test_killed_mid_checkpoint_resumes_from_the_previous_one(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    out = _script(tmp_path, KILLED_IN_CHECKPOINT)
    assert out.returncode not in (0, 124), out.stdout + out.stderr
    root = tmp_path / "out" / "checkpoints"
    assert [i.step for i in list_checkpoints(root) if i.complete] == [2]
    assert (root / ".tmp-step-000000000004").is_dir()  # the half-written one, ignored
    again = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                            "train.toml", "--out", "out", "--resume"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from" in again.stdout and "step-000000000002 at step 2" in again.stdout
    assert "trained 4 step(s)" in again.stdout
    assert latest_checkpoint(root).name == "step-000000000006"
    manifest = json.loads((latest_checkpoint(root) / "manifest.json").read_text())
    assert manifest["state"]["step"] == 6 and manifest["state"]["reader"]["batch"] == 6
    assert not (root / ".tmp-step-000000000004").exists()  # pruned once step 6 was complete
    assert Path(root / "step-000000000004").is_dir()


#: Runs `neocomm train`; the victim rank counts the calls of the step before the given one
#: and is killed at a random call of the given step (KILLER).
KILLED_IN_A_STEP = r"""
import os, signal, sys
import neocomm
from embedding.train import loop
from neocomm.cli import main

w = neocomm.init()
""" + KILLER + r"""
seed, step_at = {seed}, {step}
victim = seed % w.size
killer = _Killer(seed)
original = loop.Trainer._step

def step(self, prep, dist, n, has_next):
    if w.rank == victim and n == step_at - 1:
        killer.count()
    elif w.rank == victim and n == step_at:
        killer.arm(f"step {{n}}")
    try:
        return original(self, prep, dist, n, has_next)
    finally:
        if w.rank == victim and n == step_at:
            killer.end()
        sys.setprofile(None)

loop.Trainer._step = step
sys.exit(main(["train", "--config", "train.toml", "--out", "out"]))
"""


def _arrays(step_dir: Path) -> dict:
    import numpy as np

    return {str(p.relative_to(step_dir)): np.load(p) for p in sorted(step_dir.rglob("*.npy"))}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_rank_killed_at_a_random_point_of_a_step_resumes_bitwise(tmp_path, seed):
    """SIGKILL lands anywhere in step 5 (inside a collective, a kernel, the optimizer);
    the job ends non-zero leaving nothing, and resuming from the step-4 checkpoint ends
    bitwise equal to a run that was never interrupted."""
    (tmp_path / "train.toml").write_text(CONFIG)
    whole = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                            "train.toml", "--out", "whole"])
    assert whole.returncode == 0, whole.output
    out = _script(tmp_path, KILLED_IN_A_STEP.format(seed=seed, step=5))
    assert out.returncode not in (0, 124), out.output
    victim = seed % 2
    assert f"rank {victim}: SIGKILL at call" in out.stdout, out.output
    # the dead rank is named, whichever peer noticed first
    assert re.search(rf"rank {victim} \(pid \d+ on .*\) died of SIGKILL", out.stderr), out.stderr
    root = tmp_path / "out" / "checkpoints"
    assert latest_checkpoint(root).name == "step-000000000004"
    again = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                            "train.toml", "--out", "out", "--resume"])
    assert again.returncode == 0, again.output
    assert "step-000000000004 at step 4" in again.stdout
    want = _arrays(latest_checkpoint(tmp_path / "whole" / "checkpoints"))
    got = _arrays(latest_checkpoint(root))
    assert latest_checkpoint(root).name == "step-000000000006"
    assert sorted(got) == sorted(want) and want
    for name, array in want.items():
        assert array.dtype == got[name].dtype and array.tobytes() == got[name].tobytes(), name


def test_a_symlinked_checkpoint_file_is_refused_by_resume_and_inspect(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    first = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                            "train.toml", "--out", "out"])
    assert first.returncode == 0, first.output
    latest = latest_checkpoint(tmp_path / "out" / "checkpoints")
    victim = sorted(latest.rglob("*.npy"))[0]
    outside = tmp_path / "elsewhere.npy"
    outside.write_bytes(victim.read_bytes())  # the same bytes: only the link is wrong
    victim.unlink()
    victim.symlink_to(outside)
    rel = str(victim.relative_to(latest))
    again = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                            "train.toml", "--out", "out", "--resume"])
    assert again.returncode == 1, again.output
    assert f"file {rel} of the checkpoint is a symbolic link" in again.stderr, again.stderr
    assert "ranks [0, 1]" in again.stderr or again.stderr.count("symbolic link") >= 2
    inspect = subprocess.run([sys.executable, "-m", "neocomm.cli", "checkpoint", "inspect",
                              str(latest)], capture_output=True, text=True, timeout=120)
    assert inspect.returncode != 0 and "symbolic link" in inspect.stdout + inspect.stderr


def test_a_full_output_disk_is_refused_before_anything_is_allocated(tmp_path):

    (tmp_path / "train.toml").write_text(CONFIG.replace("rows = [50, 70, 30, 200]",
                                                        "rows = [50, 70, 30, 20000]"))
    (tmp_path / "out").mkdir()
    wrap = small_filesystem(tmp_path / "out", "1m")
    if wrap is None:
        no_mounts()
    out = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                          "train.toml", "--out", "out"], wrap=wrap)
    assert out.returncode == 1, out.output
    assert "checking the output directories: out/checkpoints: 1 MiB free; a checkpoint " \
           "needs about" in out.stderr, out.stderr
    assert "(on ranks [0, 1])" in out.stderr
    assert "metrics log" not in out.stdout and "step 1" not in out.stdout
    full = small_filesystem(tmp_path / "out", "64k", fill=True)
    out = _run(tmp_path, [sys.executable, "-m", "neocomm.cli", "train", "--config",
                          "train.toml", "--out", "out"], wrap=full)
    assert out.returncode == 1, out.output
    assert "out: cannot write there (No space left on device)" in out.stderr, out.stderr
