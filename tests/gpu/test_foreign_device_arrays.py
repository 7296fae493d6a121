"""Collectives on other libraries' device arrays (Numba, JAX, …: ``__cuda_array_interface__``).

The array is seen through a CuPy view of the same device memory: no copy in
or out, the caller's own receive buffer comes back, and the producer's
stream is waited on before the collective reads the data. (Torch CUDA
tensors go through DLPack; they need a CUDA build of torch and a GPU.)
"""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
import cupy as cp
from neocomm import CollectiveArgumentError

pytestmark = pytest.mark.mpi(min_size=2)


class DeviceArray:
    """Another library's device array: it offers the CUDA Array Interface only."""

    def __init__(self, a, stream=None):
        self._a, self._stream = a, stream

    @property
    def __cuda_array_interface__(self):
        cai = dict(self._a.__cuda_array_interface__)
        if self._stream is not None:
            cai["stream"] = self._stream.ptr
        return cai


def _ptr(x) -> int:
    return x.__cuda_array_interface__["data"][0]


def test_collectives_fill_the_callers_device_array_in_place(world, all_ranks):
    p, r = world.size, world.rank
    mine = cp.arange(8, dtype=cp.float32) + r
    buf = DeviceArray(mine)
    res = C.all_reduce(buf)
    want = (np.arange(8, dtype=np.float32) * p + sum(range(p))).astype(np.float32)
    ok = res is buf and np.array_equal(mine.get(), want)
    send = DeviceArray(cp.full(2 * p, r, cp.int64))
    recv_mem = cp.zeros(2 * p, cp.int64)
    recv = DeviceArray(recv_mem)
    got = C.all_to_all(send, recv)
    ok = ok and got is recv and np.array_equal(recv_mem.get(), np.repeat(np.arange(p), 2))
    all_ranks(ok, f"{mine.get()} {recv_mem.get()}")


def test_results_are_views_of_the_same_device_memory(world, all_ranks):
    mine = cp.arange(6, dtype=cp.float64) + world.rank
    out = C.all_gather(DeviceArray(mine))
    want = np.stack([np.arange(6, dtype=np.float64) + q for q in range(world.size)])
    # the input was read in place: a CuPy view of it has the caller's address
    view = cp.asarray(DeviceArray(mine))
    all_ranks(isinstance(out, cp.ndarray) and np.array_equal(out.get().reshape(want.shape), want)
              and _ptr(view) == _ptr(mine), f"{out}")


def test_the_producers_stream_is_waited_on(world, all_ranks):
    """Data written on the producer's stream and not yet synchronised is what is sent."""
    n = 1 << 14
    host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)
    host[:] = world.rank + 1
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.asarray(host)  # an asynchronous copy from pinned memory on the producer's stream
    C.all_reduce(DeviceArray(a, stream))
    want = sum(range(1, world.size + 1))
    all_ranks(bool((a.get() == want).all()), f"{a[:4].get()}")


@pytest.mark.parametrize("wrap", [DeviceArray, lambda a: a], ids=["foreign", "cupy"])
def test_a_device_array_on_another_gpu_is_refused_on_every_rank(world, all_ranks, wrap):
    here = cp.cuda.Device().id
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU on this host")
    other = world.comm.bcast((here + 1) % cp.cuda.runtime.getDeviceCount())  # rank 0's
    if world.rank == 0:
        with cp.cuda.Device(other):
            buf = wrap(cp.ones(4, cp.float32))
    else:
        buf = wrap(cp.ones(4, cp.float32))
    with pytest.raises(CollectiveArgumentError) as info:
        C.all_reduce(buf)
    msg = str(info.value)
    all_ranks("sendbuf" in msg and "rank 0" in msg and f"device {other}" in msg, msg)


@pytest.mark.skipif(not getattr(cp, "STANDIN", False), reason="checks the device stand-in "
                    "itself; a real GPU is in use")
def test_the_standin_refuses_a_host_pointer_as_device_memory(world):
    host = np.ones(4, np.float32)
    cai = {"shape": (4,), "typestr": "<f4", "version": 3, "stream": 1,
           "data": (host.__array_interface__["data"][0], False)}
    fake = type("Fake", (), {"__cuda_array_interface__": cai})()
    with pytest.raises(Exception, match="not inside one live device allocation"):
        cp.asarray(fake)
