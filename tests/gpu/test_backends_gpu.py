"""NCCL and staged backends on CuPy buffers, against NumPy results.

Under mpirun (``-m mpi``, 2 and 4 ranks): every backend call on device buffers whose
contents differ by rank. In one process: a 2-rank staged job launched through
``neocomm run`` (two ranks may share one GPU over the staged path; NCCL refuses two
ranks on one device).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from neocomm import ReduceOp


@pytest.fixture(scope="module")
def world():
    import neocomm

    return neocomm.init()


@pytest.fixture(params=["nccl", "staged"])
def backend(world, request):
    from gpu_cases import skip_unless_usable

    skip_unless_usable(request.param, world)
    return world.world.backend(kind=request.param)


def _sentinel(cp, n, dtype):
    """An output buffer filled with a value no result has (a no-op leaves it there)."""
    return cp.full(n, 99, dtype)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
def test_collectives_on_device_buffers(world, backend, all_ranks, dtype):
    """Every collective of the NCCL and staged backends on CuPy buffers whose contents
    differ by rank, against the same operation done in NumPy on every rank's input."""
    import cupy as cp

    n, r = backend.size, backend.rank
    host = np.random.default_rng(17 + r).integers(-8, 8, 12 * n).astype(dtype)
    every = world.comm.allgather(host)  # every rank's input, for the references
    x = cp.asarray(host)
    bad = []

    def check(name, got, want):
        got = cp.asnumpy(got)
        if got.shape != want.shape or not np.array_equal(got, want):
            bad.append(name)

    y = _sentinel(cp, x.size, dtype)
    backend.all_to_all(x, y).wait()
    check("all_to_all", y, np.concatenate([e.reshape(n, -1)[r] for e in every]))
    s = x.copy()
    backend.all_reduce(s, op=ReduceOp.MAX).wait()  # in place
    check("all_reduce max", s, np.max(every, axis=0))
    t = _sentinel(cp, x.size, dtype)
    backend.all_reduce(x, t).wait()
    check("all_reduce sum", t, np.sum(every, axis=0).astype(dtype))
    g = _sentinel(cp, x.size * n, dtype)
    backend.all_gather(x, g).wait()
    check("all_gather", g, np.concatenate(every))
    block = x.size // n
    red = _sentinel(cp, block, dtype)
    backend.reduce_scatter(x, red).wait()
    check("reduce_scatter", red, np.sum(every, axis=0).astype(dtype)[r * block:(r + 1) * block])
    send = [(r + j) % 3 + 1 for j in range(n)]  # what this rank sends to rank j
    recv = [(i + r) % 3 + 1 for i in range(n)]  # what rank i sends to this rank
    v = _sentinel(cp, sum(recv), dtype)
    backend.all_to_all_v(x[:sum(send)], v, send_counts=send, recv_counts=recv).wait()
    check("all_to_all_v", v, np.concatenate(
        [e[sum((i + j) % 3 + 1 for j in range(r)):][:recv[i]] for i, e in enumerate(every)]))
    b = x.copy()
    backend.broadcast(b, root=n - 1).wait()
    backend.barrier()
    check("broadcast", b, every[n - 1])
    all_ranks(not bad, f"rank {r} ({type(backend).__name__}, {dtype}): wrong {bad}")


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_group_picks_a_device_backend_for_cupy(world, all_ranks):
    """A CuPy buffer gets a device backend that reduces device memory in place (the result
    stays a CuPy array); a NumPy buffer gets a host backend."""
    import cupy as cp

    if not getattr(cp, "STANDIN", False) and cp.cuda.runtime.getDeviceCount() < world.local_size:
        pytest.skip("a device backend for every rank needs one GPU per rank of a host")
    be = world.world.backend(cp.ones(2))
    host = np.arange(1000, dtype=np.float32) * (world.rank + 1)
    want = np.empty_like(host)
    world.comm.Allreduce(host, want)
    dev = cp.asarray(host)
    be.all_reduce(dev).wait()
    plain = world.world.backend(np.ones(2))
    h = host.copy()
    plain.all_reduce(h).wait()
    all_ranks(be.device and isinstance(dev, cp.ndarray) and np.array_equal(dev.get(), want)
              and not plain.device and np.array_equal(h, want),
              f"rank {world.rank}: {type(be).__name__} / {type(plain).__name__}")


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


def _keep_busy(cp, stream) -> None:
    """On a GPU: queue some tens of milliseconds of work on ``stream`` (on the stand-in,
    where work runs only when forced, nothing is needed)."""
    if getattr(cp, "STANDIN", False):
        return
    with stream:
        a = cp.ones((4096, 4096), cp.float32)
        for _ in range(40):
            a = a @ a * np.float32(1 / 4096)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_nccl_async_p2p_is_issued_on_the_stream_it_was_posted_on(world, all_ranks):
    """Asynchronous sends and receives posted with ``stream=S`` and flushed while another
    stream is current (kept busy) are issued on S: work queued on S after the flush sees the
    received data, and each handle's wait() synchronises S. On the stand-in, NCCL records
    the stream of every call; on a GPU, a receive queued on the busy stream would land long
    after S had read the buffer."""
    import cupy as cp
    from gpu_cases import skip_unless_usable

    skip_unless_usable("nccl", world)
    be = world.world.backend(kind="nccl")
    n, r = be.size, be.rank
    right, left = (r + 1) % n, (r - 1) % n
    s, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.full(4096, r + 1, cp.float32)
    got = cp.full(4096, -1, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    receive = be.recv(got, left, async_op=True, stream=s)
    send = be.send(x, right, async_op=True, stream=s)
    _keep_busy(cp, other)
    with other:
        be.flush()                 # issued now, with ``other`` current
        with s:
            seen = got * 2         # stream-ordered after the receive when it is on s
    streams = ({ptr for _, _, ptr in list(be._comm.issued)[-2:]}
               if getattr(cp, "STANDIN", False) else {s.ptr})
    with other:
        receive.wait()
        send.wait()
        out = got.get()            # the handle's wait() synchronised the receive's stream
    s.synchronize()
    other.synchronize()
    all_ranks(streams == {s.ptr} and (seen.get() == 2 * (left + 1)).all()
              and (out == left + 1).all(),
              f"rank {r}: calls on streams {sorted(map(hex, streams))}, posted on {s.ptr:#x}; "
              f"S saw {seen.get()[:4]}, the host {out[:4]} (want {left + 1})")
