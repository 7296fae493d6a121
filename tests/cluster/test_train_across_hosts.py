"""``neocomm train`` on ranks of real hosts: it succeeds with status 0, a rank of the other
host killed with SIGKILL in the middle of a step ends the job naming that rank and host,
and resuming from the last checkpoint ends bitwise equal to a run never interrupted; the
README's commands for running across nodes run as written."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
from conftest import explain
from testcluster import ROOT

from embedding.checkpoint import latest_checkpoint

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

#: ``neocomm train`` in which the last rank (on the second host) kills itself with
#: SIGKILL as step 5 begins, after every rank has written the step-4 checkpoint
KILLED_IN_STEP_5 = r"""
import os, signal, sys
import neocomm
from embedding.train import loop
from neocomm.cli import main

w = neocomm.init()
original = loop.Trainer._step

def step(self, prep, dist, n, has_next):
    if w.rank == w.size - 1 and n == 5:
        print(f"rank {w.rank}: SIGKILL in step 5", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, prep, dist, n, has_next)

loop.Trainer._step = step
sys.exit(main(["train", "--config", "train.toml", "--out", "out"]))
"""


def _arrays(step_dir: Path) -> dict[str, np.ndarray]:
    return {str(p.relative_to(step_dir)): np.load(p) for p in sorted(step_dir.rglob("*.npy"))}


def test_train_killed_on_a_remote_host_resumes_bitwise(two_hosts):
    c = two_hosts
    work = Path(c.workdir) / "train"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    (work / "train.toml").write_text(CONFIG)
    (work / "killed.py").write_text(KILLED_IN_STEP_5)
    hf = c.hostfile({"node-a": 2, "node-b": 1}, name="hosts-train")

    def train(*command):
        argv = ["neocomm", "run", "-n", "3", "--hostfile", hf, "--", *command]
        return c.run("node-a", argv, cwd=str(work), timeout=300)

    whole = train("neocomm", "train", "--config", "train.toml", "--out", "whole")
    assert whole.returncode == 0, explain(whole)
    assert "node-a ranks 0-1, node-b ranks 2" in whole.stdout + whole.stderr, explain(whole)
    assert "held-out AUC" in whole.stdout, explain(whole)

    killed = train("python", "killed.py")
    assert killed.returncode not in (0, 124), explain(killed)
    assert "rank 2: SIGKILL in step 5" in killed.stdout, explain(killed)
    assert re.search(r"rank 2 \(pid \d+ on node-b\) died of SIGKILL", killed.stderr), \
        explain(killed)
    c.assert_clean()
    root = work / "out" / "checkpoints"
    assert latest_checkpoint(root).name == "step-000000000004"

    again = train("neocomm", "train", "--config", "train.toml", "--out", "out", "--resume")
    assert again.returncode == 0, explain(again)
    assert "step-000000000004 at step 4" in again.stdout, explain(again)
    want = _arrays(latest_checkpoint(work / "whole" / "checkpoints"))
    got = _arrays(latest_checkpoint(root))
    assert latest_checkpoint(root).name == "step-000000000006"
    assert sorted(got) == sorted(want) and want
    for name, array in want.items():
        assert array.dtype == got[name].dtype and array.tobytes() == got[name].tobytes(), name
    c.assert_clean()


def _readme_commands() -> list[str]:
    """The ``neocomm run`` lines of the README's section on running across nodes."""
    text = Path(ROOT, "README.md").read_text()
    section = text.split("## Running across nodes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip().startswith("neocomm run ")]


def test_the_readmes_commands_for_running_across_nodes_run_as_written(two_hosts):
    """Typed on the first host, in a folder holding a hostfile named as the README's is."""
    c = two_hosts
    commands = _readme_commands()
    assert len(commands) >= 2 and all("--hostfile hosts" in cmd for cmd in commands), commands
    work = Path(c.workdir) / "readme"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    (work / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    for command in commands:
        done = c.run("node-a", ["bash", "-c", command], cwd=str(work), timeout=400)
        assert done.returncode == 0, f"{command}\n{explain(done)}"
        assert "node-a ranks 0-1, node-b ranks 2-3" in done.stdout + done.stderr, explain(done)
        c.assert_clean()
    assert os.path.isdir(work / "neocomm-out" / "checkpoints")
