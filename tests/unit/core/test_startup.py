"""What a job pays at start-up: importing the runtime and ``neocomm.init()`` load neither
``ml_dtypes`` (about half a second) nor CuPy (most of a second) until they are used, and
CuPy only where the CUDA driver reports a GPU; ``neocomm run`` and the process that watches
each rank load neither NumPy nor the other layers, nor read the installed packages'
metadata (together about half a second of every job)."""
from __future__ import annotations

import os
import subprocess
import sys

from neocomm import _LAUNCHED_BY
from neocomm.cuda_libs import driver_devices

PROBE = """
import sys
import neocomm, collectives, embedding, embedding.train, topology
neocomm.init()
print(" ".join(sorted(m for m in ("cupy", "ml_dtypes", "torch") if m in sys.modules)))
"""


def _heavy_modules(env_extra: dict | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and k not in ("DEVSIM", "PYTHONPATH")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_init_loads_no_heavy_module_it_does_not_need():
    expected = ["cupy"] if driver_devices() > 0 else []
    assert _heavy_modules() == expected


def test_bfloat16_is_there_when_asked_for():
    import numpy as np

    from neocomm import types

    assert types.bfloat16 is None or (types.bfloat16.itemsize == 2
                                      and np.dtype("float32").type(1.5).astype(
                                          types.bfloat16) == 1.5)


TRAIN = """
import sys
from neocomm.cli import main
code = main(["train", "--steps", "2", "--out", sys.argv[1]] + sys.argv[2:])
print("MODULES", " ".join(sorted(m for m in ("cupy", "ml_dtypes") if m in sys.modules)))
sys.exit(code)
"""


def test_a_float32_training_job_never_loads_ml_dtypes_and_a_bf16_one_does(tmp_path):
    """The trainer's steps in float32 (the built-in defaults) look up no bfloat16; with
    bf16 communication they do, so the probe can tell."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and k not in ("DEVSIM",)}
    bf16 = tmp_path / "bf16.toml"
    bf16.write_text('[comms]\nforward = "bf16"\nbackward = "bf16"\n')
    loaded = {}
    for name, extra in (("fp32", []), ("bf16", ["--config", str(bf16)])):
        out = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path / name), *extra],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        loaded[name] = out.stdout.rsplit("MODULES", 1)[1].split()
    gpu = ["cupy"] if driver_devices() > 0 else []
    assert loaded["fp32"] == gpu, loaded
    assert loaded["bf16"] == sorted(gpu + ["ml_dtypes"]), loaded


LAUNCHER = """
import sys
from neocomm.cli import main
code = main(["run", "-n", "2", "--", sys.executable, "-c", RANK])
print("LAUNCHER", " ".join(sorted(m for m in HEAVY if m in sys.modules)), flush=True)
sys.exit(code)
"""
#: each rank: what the rank watcher's imports load (``python -m neocomm.rankwatch``, which
#: starts every rank under ``neocomm run``, imports the same before it starts the rank)
RANK = ("import sys, neocomm.rankwatch; print('WATCHER', ' '.join(sorted("
        "m for m in {heavy} if m in sys.modules)), flush=True)")
HEAVY = ("numpy", "topology", "collectives", "embedding", "importlib.metadata", "mpi4py")


def test_the_launcher_and_the_rank_watcher_load_nothing_heavy(tmp_path):
    """A real two-rank ``neocomm run``: the launcher process, and the rank watcher's imports on
    each rank, load only the core's launching modules."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and k not in ("DEVSIM",)}
    code = f"HEAVY = {HEAVY!r}\nRANK = {RANK.format(heavy=repr(HEAVY))!r}\n" + LAUNCHER
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    watchers = [line.split()[1:] for line in lines if line.startswith("WATCHER")]
    launcher = [line.split()[1:] for line in lines if line.startswith("LAUNCHER")]
    assert watchers == [[], []] and launcher == [[]], out.stdout + out.stderr
