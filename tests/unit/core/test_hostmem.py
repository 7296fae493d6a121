"""Host memory freed by one step is reused by the next (neocomm.hostmem): counted in page faults.

Each case runs in a process of its own (the allocator's settings are the
process's): a "step" allocates and frees six 8 MiB arrays, as a training
step's temporaries; the page faults of ten steps after two warm-up steps are
counted (``getrusage``). With glibc's defaults the freed heap is handed back
and every step faults a good part of its pages in again (about a quarter here); kept,
it faults (almost) none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEP_PAGES = 6 * (8 << 20) // 4096   # pages the step's arrays touch

CHILD = r"""
import json, resource, sys
import numpy as np

how = sys.argv[1]
if how == "direct":
    from neocomm.hostmem import keep_freed_memory
    kept = keep_freed_memory()
elif how == "fused":
    from embedding.kernels.fused import FusedTables
    from embedding.types import OptimizerConfig
    from neocomm.hostmem import keep_freed_memory
    FusedTables([10], [4], OptimizerConfig("sgd", lr=0.1))
    kept = keep_freed_memory()
elif how == "init":
    import neocomm
    from neocomm.hostmem import keep_freed_memory
    neocomm.init()
    kept = keep_freed_memory()
else:
    kept = None


def step():
    arrays = [np.ones(1 << 20) for _ in range(6)]   # 6 x 8 MiB, every page touched
    del arrays


step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _child(how: str, **env) -> dict:
    run_env = {k: v for k, v in os.environ.items() if k != "NEOCOMM_HOST_KEEP_FREED"}
    run_env.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True,
                         env=run_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _glibc(), reason="the allocator settings are glibc's")


def test_the_c_librarys_defaults_fault_every_step_in_again():
    """The case the setting exists for: without it, the freed step is handed back."""
    plain = _child("none")
    assert plain["faults"] > STEP_PAGES / 10, plain


@pytest.mark.parametrize("how", ["direct", "fused", "init"])
def test_kept_memory_serves_the_next_step_without_faults(how):
    got = _child(how)
    assert got["kept"] == 1 << 30, got
    assert got["faults"] < STEP_PAGES / 100, got


def test_the_setting_sizes_what_is_kept_and_zero_leaves_the_defaults():
    got = _child("direct", NEOCOMM_HOST_KEEP_FREED="256M")
    assert got["kept"] == 256 << 20 and got["faults"] < STEP_PAGES / 100, got
    off = _child("direct", NEOCOMM_HOST_KEEP_FREED="0")
    assert off["kept"] == 0 and off["faults"] > STEP_PAGES / 10, off


def test_a_bad_setting_names_the_variable_and_the_value():
    out = subprocess.run([sys.executable, "-c", CHILD, "direct"], capture_output=True, text=True,
                         env=dict(os.environ, NEOCOMM_HOST_KEEP_FREED="lots"), timeout=120)
    assert out.returncode != 0
    assert "NEOCOMM_HOST_KEEP_FREED='lots'" in out.stderr, out.stderr


def test_a_negative_argument_is_refused_by_name():
    from neocomm import hostmem

    saved = hostmem._applied
    hostmem._applied = None
    try:
        with pytest.raises(ValueError, match=r"keep: expected >= 0 bytes, got -1"):
            hostmem.keep_freed_memory(-1)
    finally:
        hostmem._applied = saved
