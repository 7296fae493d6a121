"""Inputs shared by the device tests: random bags with the cases that break kernels, the
cases of ``tests/mpi`` modules, which the device tests run again on device arrays, and the
CPU OpenCL runner of ``tests/devsim`` that the kernel tests launch on."""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from embedding.kernels import Bags, TableLayout
from embedding.kernels.cuda_src import MAX_DIM

__all__ = ["assert_same_bytes", "bag_case", "load_mpi_tests", "load_opencl", "require_opencl",
           "skip_unless_usable", "wire_case"]

_OPENCL = Path(__file__).resolve().parents[1] / "devsim" / "opencl.py"


def skip_unless_usable(kind: str, world) -> None:
    """Skip the test (with the reason) when device backend ``kind`` cannot run here: it is
    unavailable, or it is NCCL on a real host with fewer GPUs than ranks."""
    import cupy as cp
    import pytest

    from neocomm.backends import backend_class
    from neocomm.types import BackendKind

    ok, why = backend_class(BackendKind(kind)).availability()
    if not ok:
        pytest.skip(why)
    if kind == "nccl" and not getattr(cp, "STANDIN", False) and \
            cp.cuda.runtime.getDeviceCount() < world.local_size:
        pytest.skip("NCCL needs one GPU per rank of a host")


def load_mpi_tests(name: str):
    """The module ``tests/mpi/<name>.py``, loaded under a name of its own."""
    path = Path(__file__).resolve().parents[1] / "mpi" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_mpi_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def load_opencl():
    """``tests/devsim/opencl.py``: the module ``opencl`` when that is it, else loaded from its
    file under a name of its own (another ``opencl`` module took the name)."""
    mod = sys.modules.get("opencl")
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve() == _OPENCL:
        return mod
    name = "opencl" if mod is None else "_devsim_opencl"
    spec = importlib.util.spec_from_file_location(name, _OPENCL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_opencl(device: str) -> None:
    """Return when OpenCL ``device`` ("pocl" or "oclgrind") is usable; else fail the test with
    the reason when ``CI`` is set, and skip it with the reason elsewhere."""
    import pytest

    ok, why = load_opencl().available(device)
    if ok:
        return
    if _in_ci():
        pytest.fail(f"{device} must run in CI but is not usable: {why}")
    pytest.skip(f"{device} is not usable: {why}")


def bag_case(dtype, seed=0, weighted=True, groups=2, batch=6,
             rows=(500, 37, 1000, 1, 5, 9), dims=(16, 64, 130, 33, MAX_DIM, 1),
             slot_table=(0, 2, 0, 1, 3, 4, 5),
             slot_mean=(False, True, False, True, False, True, False), slot_max=None):
    """Random bags plus adversarial ones: per slot, bag 0 is empty, bag 1 repeats the table's
    last row, bag 2 mixes rows 0 and last; hot rows repeat across bags and slots. The
    tables include one of one row, one of dim MAX_DIM, dims that are not multiples of 32.
    ``slot_max`` defaults to max pooling on slots 2, 6, ... (table 0 is then read by a sum
    and a max slot). Rows 0 and 1 of every table are equal and bag 3 is ``[1, 0, 1, 0]`` with
    weights 1: every column ties between two rows, and the first (row 1) takes the gradient
    of a max slot."""
    if slot_max is None:
        slot_max = tuple(i % 4 == 2 and not m for i, m in enumerate(slot_mean))
    rng = np.random.default_rng(seed)
    layout = TableLayout(rows, dims)
    sdims = [layout.dims[t] for t in slot_table]
    cols = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sdims)[:-1]]))
    out_dim = int(sum(sdims))
    bags = []
    for _ in range(groups):
        for t in slot_table:
            last = layout.rows[t] - 1
            for b in range(batch):
                if b == 0:
                    ids = np.zeros(0, np.int64)
                elif b == 1:
                    ids = np.full(3, last)
                elif b == 2:
                    ids = np.array([0, last, 0, last])
                elif b == 3:
                    ids = np.array([1, 0, 1, 0]).clip(0, last)
                else:
                    n = int(rng.integers(1, 7))
                    hot = rng.choice([0, last, min(1, last)], n)
                    ids = np.where(rng.random(n) < 0.5, hot, rng.integers(0, last + 1, n))
                bags.append(np.asarray(ids, np.int64))
    lens = [len(x) for x in bags]
    ids = np.concatenate(bags)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    w = rng.uniform(0.5, 2, ids.size) if weighted else None
    if w is not None and batch > 3:
        for bag in range(3, len(lens), batch):
            w[offsets[bag]:offsets[bag + 1]] = 1
    bags = Bags(ids, offsets, slot_table, cols, slot_mean, batch, out_dim, groups, w, slot_max)
    weights = rng.standard_normal(layout.total_elements).astype(dtype)
    for t, off in enumerate(layout.weight_offsets):
        if layout.rows[t] > 1:
            d = layout.dims[t]
            weights[off + d:off + 2 * d] = weights[off:off + d]
    grad = rng.standard_normal((groups * batch, out_dim)).astype(dtype)
    return layout, bags, weights, grad


def wire_case(dtype, seed=0, **kw):
    """:func:`bag_case` (empty bags, repeated and tied rows, sum, mean and max slots) with
    tables of ``dtype`` (half tables: float32 gradients)."""
    from embedding.precision import storage_dtype

    layout, bags, weights, grad = bag_case("float32" if dtype in ("float16", "bfloat16")
                                           else dtype, seed, **kw)
    return layout, bags, weights.astype(storage_dtype(dtype)), grad


def _bytes(arr) -> np.ndarray:
    arr = np.asarray(arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray)
                     else arr)  # a device array comes to the host first
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def assert_same_bytes(got, want, what):
    """``got`` and ``want`` (host or device arrays) hold the same bytes; the message names
    ``what`` and the first bytes that differ."""
    g, w = _bytes(got), _bytes(want)
    bad = np.flatnonzero(g != w)
    assert g.size == w.size and bad.size == 0, (
        f"{what}: {bad.size} of {w.size} bytes differ, e.g. at {bad[:6]}: {g[bad[:6]]} vs "
        f"{w[bad[:6]]}")
