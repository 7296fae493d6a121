"""The device stand-in enforces CUDA's and CuPy's rules: each rule is shown broken.

A stand-in that passed by luck would hide the bugs it exists to find, so
every rule it claims has a test that breaks it and expects the failure a
GPU would give (a wrong result, a hazard report, or CuPy's own error).
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp

pytestmark = pytest.mark.skipif(not getattr(cp, "STANDIN", False),
                                reason="checks the device stand-in itself; a real GPU is in use")


def _pinned(n, dtype=np.float32):
    mem = cp.cuda.alloc_pinned_memory(n * np.dtype(dtype).itemsize)
    return np.frombuffer(mem, dtype, n)


def test_pinned_buffer_written_before_its_copy_ran_is_a_hazard():
    host = _pinned(16)
    host[:] = 1
    dev = cp.asarray(host)          # asynchronous: the copy has not run yet
    host[:] = 2                     # the host reuses the buffer too early
    with pytest.raises(cp.HazardError, match="pinned host buffer .* written by the host"):
        dev.get()


def test_pinned_buffer_reused_after_a_synchronize_is_fine():
    host = _pinned(16)
    host[:] = 1
    dev = cp.asarray(host)
    cp.cuda.get_current_stream().synchronize()
    host[:] = 2
    np.testing.assert_array_equal(dev.get(), np.ones(16, np.float32))


def test_pageable_source_is_staged_at_once():
    host = np.ones(16, np.float32)
    dev = cp.asarray(host)
    host[:] = 2  # CuPy copied it to a transfer buffer first: no hazard
    np.testing.assert_array_equal(dev.get(), np.ones(16, np.float32))


def test_reading_an_async_device_to_host_copy_before_a_sync_sees_stale_data():
    dev = cp.arange(8, dtype=cp.float32)
    out = _pinned(8)
    out[:] = -1
    dev.get(out=out, blocking=False)
    assert (out == -1).all()        # the copy is still queued
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32))


def test_work_on_another_stream_without_an_event_is_a_race():
    host = _pinned(32)
    host[:] = 3
    a, b = cp.cuda.Stream(), cp.cuda.Stream()
    with a:
        dev = cp.asarray(host)      # pending on stream a
    with b:
        with pytest.raises(cp.HazardError, match="race between streams"):
            dev + 1
    a.synchronize()


def test_an_event_orders_two_streams():
    host = _pinned(32)
    host[:] = 3
    a, b = cp.cuda.Stream(), cp.cuda.Stream()
    with a:
        dev = cp.asarray(host)
        done = a.record()
    b.wait_event(done)
    with b:
        out = dev + 1
    b.synchronize()
    np.testing.assert_array_equal(out.get(), np.full(32, 4, np.float32))


def test_compute_is_queued_behind_pending_copies_in_stream_order():
    host = _pinned(4)
    host[:] = 5
    dev = cp.asarray(host)
    total = dev * 2                  # depends on the pending copy: queued behind it
    cp.cuda.get_current_stream().synchronize()
    host[:] = 0
    np.testing.assert_array_equal(total.get(), np.full(4, 10, np.float32))


def test_cupy_refuses_numpy_operands_and_implicit_conversion():
    dev = cp.ones(4, cp.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        dev + np.ones(4, np.float32)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(dev)
    assert isinstance(np.sum(dev), cp.ndarray)  # NumPy functions dispatch to the device


def test_fresh_device_memory_is_not_zero():
    assert np.isnan(cp.empty(8, cp.float32).get()).all()
    assert (cp.empty(8, cp.int32).get() == -1).all()


def test_a_device_pointer_is_not_host_memory():
    from cupy import _engine

    dev = cp.zeros(4, cp.float32)
    _engine.resolve(dev.data.ptr, 16, "test")
    with pytest.raises(_engine.CudaError, match="not inside one live device allocation"):
        _engine.resolve(dev.data.ptr + 8, 16, "test")
    host = np.zeros(4, np.float32)
    with pytest.raises(_engine.CudaError):
        _engine.resolve(host.ctypes.data, 16, "test")


def test_views_share_device_memory():
    dev = cp.zeros(8, cp.float32)
    dev.reshape(2, 4)[1] = 7
    np.testing.assert_array_equal(dev.get(), [0, 0, 0, 0, 7, 7, 7, 7])
    assert dev[4:].data.ptr == dev.data.ptr + 16


def test_cuda_kernels_run_through_the_opencl_device():
    kernel = cp.RawModule(code=_AXPY).get_function("axpy")
    x, y = cp.arange(100, dtype=cp.float32), cp.ones(100, cp.float32)
    kernel((4,), (32,), (x, y, np.float32(2), np.int64(100)))
    np.testing.assert_array_equal(y.get(), 2 * np.arange(100, dtype=np.float32) + 1)
    with pytest.raises(TypeError, match="Python int"):
        kernel((4,), (32,), (x, y, np.float32(2), 100))


def _read_on(stream, dev):
    """Queue a kernel on ``stream`` that reads ``dev`` (behind a pending copy, so it waits
    on the stream until something forces it); returns its output."""
    host = _pinned(dev.size)
    host[:] = 1
    with stream:
        out = cp.asarray(host)       # pending on ``stream``: the add below is queued behind
        out += dev
    return out


def test_pool_block_reused_while_another_stream_reads_it_is_a_hazard():
    a, b = cp.cuda.Stream(), cp.cuda.Stream()
    with a:
        dev = cp.full(64, 2, cp.float32)  # allocated on stream a: its block returns there
    out = _read_on(b, dev)
    del dev                           # freed while the add on stream b still reads it
    with a:
        with pytest.raises(cp.HazardError, match="memory pool reuse races with another "
                                                 "stream") as err:
            cp.empty(64, cp.float32)
    assert repr(a._state) in str(err.value) and repr(b._state) in str(err.value)
    b.synchronize()
    np.testing.assert_array_equal(out.get(), np.full(64, 3, np.float32))


def test_pool_block_reused_after_an_event_wait_is_fine():
    a, b = cp.cuda.Stream(), cp.cuda.Stream()
    with a:
        dev = cp.full(64, 2, cp.float32)
        ptr = dev.data.ptr
    out = _read_on(b, dev)
    a.wait_event(b.record())          # stream a's later work runs after the add on b
    del dev
    with a:
        again = cp.empty(64, cp.float32)
        again.fill(7)
    assert again.data.ptr == ptr      # the same block, as CuPy's pool hands it out
    np.testing.assert_array_equal(out.get(stream=b), np.full(64, 3, np.float32))
    np.testing.assert_array_equal(again.get(stream=a), np.full(64, 7, np.float32))


def test_pool_block_reused_on_its_own_stream_is_fine():
    a = cp.cuda.Stream()
    with a:
        dev = cp.full(64, 2, cp.float32)
        ptr = dev.data.ptr
    out = _read_on(a, dev)            # same stream: the reuse is ordered after the read
    del dev
    with a:
        again = cp.empty(16, cp.float32)  # smaller: the pool's best fit is the same block
    assert again.data.ptr == ptr
    np.testing.assert_array_equal(out.get(stream=a), np.full(64, 3, np.float32))


def test_float_kernels_flush_subnormals_to_zero_as_cuda_does():
    """CuPy compiles raw kernels with -ftz=true (even when options ask for -ftz=false):
    float32 operations flush subnormal inputs and results to a zero of the same sign;
    float64 ones keep them."""
    src = r'''
    extern "C" __global__ void ops(const float* __restrict__ x, float* __restrict__ y,
                                   const double* __restrict__ dx, double* __restrict__ dy) {
        int i = threadIdx.x;
        if (i < 4) {
            y[i] = __fadd_rn(x[i], 0.0f);
            y[4 + i] = __fmul_rn(x[i], 1.0f);
            y[8 + i] = __fmul_rn(x[i], 1.0e-10f);   // a normal input, a subnormal result
            dy[i] = __dadd_rn(dx[i], 0.0);
        }
    }'''
    kernel = cp.RawModule(code=src, options=("-ftz=false",)).get_function("ops")
    tiny = np.finfo(np.float32).smallest_normal
    x = cp.asarray(np.array([tiny / 3, -tiny / 3, 1e-30, 1.5], np.float32))
    y = cp.full(12, 7, cp.float32)
    dx = cp.asarray(np.array([1e-310, -1e-310, 1e-300, 1.5]))
    dy = cp.zeros(4, cp.float64)
    kernel((1,), (32,), (x, y, dx, dy))
    got = y.get()
    want = np.array([0, 0, 1e-30, 1.5, 0, 0, 1e-30, 1.5, 0, 0, 0, 0], np.float32)
    want[11] = np.float32(1.5) * np.float32(1e-10)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[5]) and not np.signbit(got[4])  # -tiny/3 * 1 flushes to -0
    np.testing.assert_array_equal(dy.get(), [1e-310, -1e-310, 1e-300, 1.5])


# -- CuPy's argument rules (each checked against the real CuPy 14 package) ------------------

_AXPY = r'''
extern "C" __global__ void axpy(const float* __restrict__ x, float* __restrict__ y,
                                const float a, const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]);
}'''


def test_raw_module_takes_its_code_by_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        cp.RawModule(_AXPY)
    with pytest.raises(TypeError, match="Argument 'code' has incorrect type"):
        cp.RawModule(code=b"not text")
    assert cp.RawModule(code=_AXPY).get_function("axpy").name == "axpy"


@pytest.mark.parametrize("grid, block", [(4, (32,)), ([4], (32,)), ((4,), 32), ((4,), [32])])
def test_a_launch_takes_grid_and_block_as_tuples(grid, block):
    kernel = cp.RawModule(code=_AXPY).get_function("axpy")
    x, y = cp.arange(100, dtype=cp.float32), cp.ones(100, cp.float32)
    with pytest.raises(TypeError, match="Argument '(grid|block)' has incorrect type "
                                        r"\(expected tuple"):
        kernel(grid, block, (x, y, np.float32(2), np.int64(100)))


def test_raw_kernel_is_built_from_source_and_a_name():
    with pytest.raises(TypeError, match="Argument 'code' has incorrect type"):
        cp.RawKernel(cp.RawModule(code=_AXPY), "axpy")  # a module is not source
    kernel = cp.RawKernel(_AXPY, "axpy")
    x, y = cp.arange(100, dtype=cp.float32), cp.ones(100, cp.float32)
    kernel((4,), (32,), (x, y, np.float32(2), np.int64(100)))
    np.testing.assert_array_equal(y.get(), 2 * np.arange(100, dtype=np.float32) + 1)


@pytest.mark.parametrize("sort", [lambda a, k: cp.sort(a, kind=k),
                                  lambda a, k: cp.argsort(a, kind=k),
                                  lambda a, k: a.sort(kind=k), lambda a, k: a.argsort(kind=k)])
def test_sorting_takes_no_kind_but_stable(sort):
    a = cp.asarray(np.array([3, 1, 2, 1], np.int32))
    for kind in ("quicksort", "mergesort", "heapsort"):
        with pytest.raises(ValueError, match="kind can only be None or 'stable'"):
            sort(a, kind)
    sort(a, "stable")
    sort(a, None)


def test_in_place_sort_sorts_the_array():
    a = cp.asarray(np.array([3, 1, 2, 1], np.int32))
    a.sort()
    np.testing.assert_array_equal(a.get(), [1, 1, 2, 3])


def test_current_stream_takes_an_integer_device():
    with pytest.raises(TypeError, match="an integer is required"):
        cp.cuda.get_current_stream(device_id=None)
    assert cp.cuda.get_current_stream(-1) == cp.cuda.get_current_stream()
    s = cp.cuda.Stream()
    with s:
        assert cp.cuda.get_current_stream(cp.cuda.Device().id) == s


def test_a_stream_of_another_device_cannot_be_made_current():
    with cp.cuda.Device(1):
        other = cp.cuda.Stream()
    with pytest.raises(RuntimeError, match=r"created on \(1\) does not match with the current "
                                           r"device \(0\)"):
        with other:
            pass
    with pytest.raises(RuntimeError, match="does not match with the current device"):
        other.use()
    with cp.cuda.Device(1), other:  # on its own device it is fine
        assert cp.cuda.get_current_stream() == other
    with cp.cuda.Stream.null:  # the null stream is the current device's
        pass


def test_pinned_memory_size_is_a_method():
    mem = cp.cuda.alloc_pinned_memory(64)
    assert mem.size() == 64
    assert np.frombuffer(mem, np.uint8, 64).nbytes == 64


def test_names_real_cupy_lacks_are_missing_not_numpy():
    with pytest.raises(AttributeError, match="has no attribute 'nanpercentile'"):
        cp.nanpercentile
    with pytest.raises(AttributeError, match="has no attribute 'insert'"):
        cp.insert
    dev = cp.arange(4, dtype=cp.float32)
    with pytest.raises(AttributeError, match="has no attribute 'setflags'"):
        dev.setflags
    with pytest.raises(TypeError, match="no implementation found"):
        np.insert(dev, 0, 1)  # CuPy has no twin, so NumPy's dispatch finds none
    assert isinstance(cp.cumsum(dev), cp.ndarray) and isinstance(dev.cumsum(), cp.ndarray)


def test_no_device_is_a_cuda_error_not_zero(monkeypatch):
    monkeypatch.setenv("DEVSIM_DEVICES", "0")
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorNoDevice"):
        cp.cuda.runtime.getDeviceCount()
    assert cp.cuda.is_available() is False
    from neocomm.backends.base import cuda_availability

    ok, why = cuda_availability()
    assert not ok and "cudaErrorNoDevice" in why


def test_nccl_unique_id_must_be_bytes_of_length_128():
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    with pytest.raises(TypeError, match=r"Argument 'commId' has incorrect type \(expected "
                                        r"bytes, got bytearray\)"):
        nccl.NcclCommunicator(1, bytearray(uid), 0)
    with pytest.raises(ValueError, match="commId length 10 != 128"):
        nccl.NcclCommunicator(1, uid[:10], 0)


def test_nccl_negative_count_is_an_overflow_error():
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    try:
        dev = cp.zeros(4, cp.float32)
        stream = cp.cuda.get_current_stream().ptr
        with pytest.raises(OverflowError, match="can't convert negative value to size_t"):
            comm.allReduce(dev.data.ptr, dev.data.ptr, -1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           stream)
        with pytest.raises(OverflowError):
            comm.send(dev.data.ptr, -4, nccl.NCCL_FLOAT32, 0, stream)
    finally:
        comm.destroy()


def test_streams_and_events_have_cupys_attributes_only():
    assert cp.cuda.Stream.null.device_id == -1  # CuPy's singleton belongs to no device
    with cp.cuda.Device(1):
        assert cp.cuda.Stream().device_id == 1
    with pytest.raises(AttributeError):
        cp.cuda.Event().query  # CuPy's events have ``done``, not ``query()``
    assert not hasattr(cp.cuda, "CudaError")  # CuPy's is cupy.cuda.runtime.CUDARuntimeError
