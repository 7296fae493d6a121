"""NCCL and staged backends on CuPy buffers, against NumPy results.

One process (a 1-rank NCCL communicator), plus a 2-rank staged job launched
through ``neocomm run`` (two ranks may share one GPU over the staged path;
NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from neocomm import ReduceOp


@pytest.fixture(scope="module")
def world():
    import neocomm

    return neocomm.init()


@pytest.fixture(params=["nccl", "staged"])
def backend(world, request):
    from neocomm.backends import backend_class
    from neocomm.types import BackendKind

    ok, why = backend_class(BackendKind(request.param)).availability()
    if not ok:
        pytest.skip(why)
    return world.world.backend(kind=request.param)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
def test_collectives_on_device_buffers(backend, dtype):
    import cupy as cp

    n = backend.size
    x = cp.arange(12 * n, dtype=dtype)
    y = cp.empty_like(x)
    backend.all_to_all(x, y)
    cp.testing.assert_array_equal(y, x)  # one rank: identity
    s = x.copy()
    backend.all_reduce(s, op=ReduceOp.MAX)
    cp.testing.assert_array_equal(s, x)
    g = cp.empty(x.size * n, dtype)
    backend.all_gather(x, g).wait()
    cp.testing.assert_array_equal(g, cp.tile(x, n))
    r = cp.empty(x.size // n, dtype)
    backend.reduce_scatter(x, r)
    cp.testing.assert_array_equal(r, x[:r.size])
    v = cp.empty_like(x)
    backend.all_to_all_v(x, v, send_counts=[x.size], recv_counts=[x.size])
    cp.testing.assert_array_equal(v, x)
    b = x.copy()
    backend.broadcast(b, root=0)
    backend.barrier()
    cp.testing.assert_array_equal(b, x)


@pytest.mark.gpu
def test_group_picks_a_device_backend_for_cupy(world):
    import cupy as cp

    be = world.world.backend(cp.ones(2))
    assert be.device


@pytest.mark.gpu
def test_staged_two_ranks_match_numpy(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import cupy as cp, numpy as np, neocomm
        w = neocomm.init()
        be = w.world.backend(kind="staged")
        rng = np.random.default_rng(w.rank)
        host = rng.integers(-9, 9, 3 * (1 << 20)).astype(np.float32)
        dev = cp.asarray(host)
        be.all_reduce(dev)
        want = np.empty_like(host)
        w.comm.Allreduce(host, want)
        assert np.array_equal(cp.asnumpy(dev), want)
        a = cp.asarray(host)
        out = cp.empty_like(a)
        be.all_to_all(a, out)
        ref = np.empty_like(host)
        w.comm.Alltoall(host, ref)
        assert np.array_equal(cp.asnumpy(out), ref)
        print("staged ok", w.rank)
    """))
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", "--timeout", "300",
                          "--", sys.executable, str(script)], capture_output=True, text=True,
                         env={**__import__("os").environ, "NEOCOMM_STAGING_BYTES": "1MiB"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("staged ok") == 2
