"""The CUDA-to-OpenCL translator (``tests/devsim/cuda_to_opencl.py``) and the OpenCL runner
(``tests/devsim/opencl.py``) that run the CUDA kernels on PoCL and Oclgrind in
``test_kernels_opencl.py``: every construct the translation knows, the ones it refuses by
name, and the runner's argument checks and Oclgrind reports.

No GPU is needed. These tests never skip in CI: without PoCL or Oclgrind
they fail with the reason when ``CI`` is set, and skip with it elsewhere.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from embedding.kernels.cuda_src import source_for
from gpu_cases import load_opencl, require_opencl

ocl = load_opencl()
DTYPES = ("float32", "float64")


# --------------------------------------------------------------------------- the translator

_PROBE = r"""
typedef long long i64;
typedef unsigned int u32;

__device__ __forceinline__ double warp_total(double v) {
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ void put(i64* __restrict__ dst, const int k, const i64 v) {
    dst[k] = v;   // a pointer parameter of a device function
}

extern "C" __global__ void probe(
        const float* __restrict__ a, const float* __restrict__ b, const double* __restrict__ c,
        const double* __restrict__ e, i64* __restrict__ ids, float* __restrict__ f,
        double* __restrict__ d, double* __restrict__ sums, u32* __restrict__ swapped,
        int* __restrict__ counter, const i64 n) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= n) return;
    put(ids, 4 * tid, threadIdx.x);
    put(ids, 4 * tid + 1, blockIdx.x);
    put(ids, 4 * tid + 2, blockDim.x);
    put(ids, 4 * tid + 3, gridDim.x);
    const float x = a[tid], y = b[tid];
    f[5 * tid] = __fadd_rn(__fmul_rn(x, y), x);
    f[5 * tid + 1] = __fsub_rn(x, y);
    f[5 * tid + 2] = __fdiv_rn(x, y);
    f[5 * tid + 3] = __fsqrt_rn(y);
    f[5 * tid + 4] = (float)(1.0 - pow(c[tid], (double)(tid + 1)));
    const double p = c[tid], q = e[tid];
    d[4 * tid] = __dadd_rn(__dmul_rn(p, q), p);
    d[4 * tid + 1] = __dsub_rn(p, q);
    d[4 * tid + 2] = __ddiv_rn(p, q);
    d[4 * tid + 3] = __dsqrt_rn(q);
    sums[tid] = warp_total(p);
    swapped[tid] = __shfl_xor_sync(0xffffffff, (u32)threadIdx.x, 1);
    const int seen = counter[tid >> 5];
    __syncwarp();
    if ((threadIdx.x & 31) == 0) counter[tid >> 5] = seen + 1;
}
"""


def _probe_args(grid, block):
    n = grid * block
    rng = np.random.default_rng(10)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.uniform(0.1, 3, n).astype(np.float32)
    c = rng.uniform(0.1, 0.999, n)
    e = rng.uniform(0.1, 3, n)
    return (a, b, c, e, np.zeros(4 * n, np.int64), np.zeros(5 * n, np.float32),
            np.zeros(4 * n, np.float64), np.zeros(n, np.float64), np.zeros(n, np.uint32),
            np.arange(n // 32, dtype=np.int32), np.int64(n))


def _check_probe(args, grid, block):
    a, b, c, e, ids, f, d, sums, swapped, counter, n = args
    tid = np.arange(int(n))
    np.testing.assert_array_equal(ids.reshape(-1, 4),
                                  np.stack([tid % block, tid // block,
                                            np.full_like(tid, block), np.full_like(tid, grid)], 1))
    f = f.reshape(-1, 5)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(f[:, 0], a * b + a)      # one rounding per operation
        np.testing.assert_array_equal(f[:, 1], a - b)
        np.testing.assert_array_equal(f[:, 2], a / b)
        np.testing.assert_array_equal(f[:, 3], np.sqrt(b))
        np.testing.assert_allclose(f[:, 4], (1.0 - c ** (tid + 1.0)).astype(np.float32),
                                   rtol=2e-7, atol=1e-30)
        d = d.reshape(-1, 4)
        np.testing.assert_array_equal(d[:, 0], c * e + c)
        np.testing.assert_array_equal(d[:, 1], c - e)
        np.testing.assert_array_equal(d[:, 2], c / e)
        np.testing.assert_array_equal(d[:, 3], np.sqrt(e))
    np.testing.assert_allclose(sums, np.repeat(c.reshape(-1, 32).sum(1), 32), rtol=1e-14)
    np.testing.assert_array_equal(swapped, (tid % block) ^ 1)
    np.testing.assert_array_equal(counter, np.arange(int(n) // 32) + 1)


@pytest.mark.parametrize("grid, block", [(3, 64), (2, 128), (1, 32)])
def test_translated_probe_runs_every_construct_on_pocl(grid, block):
    require_opencl("pocl")
    prog = ocl.Program(_PROBE, "pocl")
    args = _probe_args(grid, block)
    prog.launch("probe", (grid,), (block,), args)
    _check_probe(args, grid, block)


def test_translated_probe_is_clean_under_oclgrind():
    require_opencl("oclgrind")
    args = _probe_args(2, 64)
    ocl.Program(_PROBE, "oclgrind").launch("probe", (2,), (64,), args)
    _check_probe(args, 2, 64)


def test_translated_bit_casts_run_on_pocl():
    """``__float_as_uint`` / ``__uint_as_float`` (half storage) keep every bit, NaN included."""
    require_opencl("pocl")
    prog = ocl.Program('extern "C" __global__ void k(const float* a, unsigned int* bits, '
                       'float* back) { const int i = blockIdx.x * blockDim.x + threadIdx.x; '
                       'bits[i] = __float_as_uint(a[i]); '
                       'back[i] = __uint_as_float(bits[i] ^ 0x80000000u); }', "pocl")
    a = np.random.default_rng(12).integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    a[:4] = [0x7FC00001, 0xFF800000, 0x00000001, 0x80000000]
    bits, back = np.zeros(64, np.uint32), np.zeros(64, np.float32)
    prog.launch("k", (2,), (32,), (a.view(np.float32), bits, back))
    np.testing.assert_array_equal(bits, a)
    np.testing.assert_array_equal(back.view(np.uint32), a ^ np.uint32(0x80000000))


def test_translation_of_the_kernels_is_mechanical():
    for dtype in DTYPES:
        tr = ocl.translate(source_for(dtype))
        assert set(tr.kernels) == {"pooled_lookup", "occurrence_keys", "segment_update"}
        body = tr.source.split("---- translated source ---- */", 1)[1]
        assert "__global__" not in body and "__device__" not in body and "long long" not in body
        assert body.count("__kernel void") == 3
        assert "static inline T warp_sum(__local ulong* __nc_shfl, T v)" in body
        assert "warp_sum(__nc_shfl, sumsq)" in body
        assert "#pragma OPENCL FP_CONTRACT OFF" in tr.source
        # every pointer (kernel and device function parameters, locals) is a __global one
        pointers = re.findall(r"(__global\s+)?(?:const\s+)?\b(?:T|i64|int|double)\s*\*", body)
        assert len(pointers) > 50 and all(pointers), pointers
        params = {p.name: p for p in tr.kernels["segment_update"]}
        assert params["weights"].dtype == np.dtype(dtype) and not params["weights"].const
        assert params["betas"].dtype == np.float64 and params["betas"].const
        assert params["num_segments"].dtype == np.int64 and not params["num_segments"].pointer
        assert params["step"].dtype == np.int64


_KERNEL = 'extern "C" __global__ void k(float* out) {{ {} }}'


@pytest.mark.parametrize("code, construct", [
    ("__shared__ float s[32]; out[0] = s[0];", "__shared__"),
    ("__syncthreads();", "__syncthreads"),
    ("atomicAdd(out, 1.0f);", "atomicAdd"),
    ("out[threadIdx.y] = 1;", "threadIdx.y"),
    ("out[0] = __shfl_xor_sync(0xffffu, out[0], 1);", "__shfl_xor_sync mask 0xffffu"),
    ("out[0] = __shfl_xor_sync(0xffffffff, out[0], 1, 16);", "__shfl_xor_sync width 16"),
    ("__syncwarp(0x1);", "__syncwarp mask 0x1"),
    ("out[0] = __ldg(out + 1);", "__ldg"),
    ("out[0] = warpSize;", "warpSize"),
    ("out[0] = __expf(1.0f);", "__expf"),
    ("\n#pragma unroll\n for (int i = 0; i < 2; ++i) out[i] = 0;", "#pragma"),
])
def test_unknown_constructs_are_refused_by_name(code, construct):
    with pytest.raises(ocl.TranslationError) as info:
        ocl.translate(_KERNEL.format(code))
    assert info.value.construct == construct
    assert construct in str(info.value)


@pytest.mark.parametrize("source, construct", [
    ('#include <cuda_fp16.h>\n' + _KERNEL.format(""), "#include"),
    ("__global__ void k(float* out) {}", "__global__"),
    ('__device__ int counter;\n' + _KERNEL.format(""), "__device__ int counter"),
    ('extern "C" __global__ void k(bool flag) {}', "bool flag"),
    ('extern "C" __global__ void k(float** p) {}', "float** p"),
    ('template <typename T> __device__ T f(T x) { return x; }', "template"),
    ('extern "C" __global__ __launch_bounds__(128) void k(float* o) {}', "__launch_bounds__"),
])
def test_unsupported_declarations_are_refused_by_name(source, construct):
    with pytest.raises(ocl.TranslationError) as info:
        ocl.translate(source)
    assert info.value.construct == construct


# --------------------------------------------------------------------------- the runner

_RACY = {
    "race": ('extern "C" __global__ void k(int* out) { out[0] = threadIdx.x; }',
             "data race"),
    "out_of_bounds": ('extern "C" __global__ void k(int* out) '
                      '{ out[blockIdx.x * blockDim.x + threadIdx.x + 1] = 1; }', "Invalid write"),
    "uninitialized": ('extern "C" __global__ void k(int* out) { int x[2]; x[0] = 1; '
                      'out[blockIdx.x * blockDim.x + threadIdx.x] = x[threadIdx.x & 1]; }',
                      "Uninitialized"),
    "divergent_shuffle": ('extern "C" __global__ void k(int* out) { int v = threadIdx.x; '
                          'if (threadIdx.x < 8) v = __shfl_xor_sync(0xffffffffu, v, 1); '
                          'out[blockIdx.x * blockDim.x + threadIdx.x] = v; }', "divergence"),
    "missing_syncwarp": ('extern "C" __global__ void k(int* out) { const int seen = out[0]; '
                         'if (threadIdx.x == 0) out[0] = seen + 1; }', "data race"),
}


@pytest.mark.parametrize("case", sorted(_RACY))
def test_oclgrind_runner_reports_errors(case):
    require_opencl("oclgrind")
    source, expected = _RACY[case]
    out = np.zeros(32, np.int32)
    with pytest.raises(ocl.OclgrindError) as info:
        ocl.Program(source, "oclgrind").launch("k", (1,), (32,), (out,))
    assert expected in info.value.report, info.value.report
    assert info.value.kernel == "k"


def test_oclgrind_runner_passes_a_clean_kernel():
    require_opencl("oclgrind")
    prog = ocl.Program('extern "C" __global__ void k(int* out) { const int seen = out[0]; '
                       '__syncwarp(); if (threadIdx.x == 0) out[0] = seen + 1; }', "oclgrind")
    out = np.zeros(1, np.int32)
    for _ in range(2):
        prog.launch("k", (1,), (32,), (out,))
    assert out[0] == 2


def test_runner_checks_arguments():
    require_opencl("pocl")
    prog = ocl.Program('extern "C" __global__ void k(const double* a, float* out, const int n) '
                       '{ const int i = blockIdx.x * blockDim.x + threadIdx.x; '
                       'if (i < n) out[i] = (float)a[i]; }', "pocl")
    a, out = np.arange(40.0), np.zeros(40, np.float32)
    prog.launch("k", (2,), (32,), (a, out, np.int32(40)))
    np.testing.assert_array_equal(out, a)
    with pytest.raises(TypeError, match=r"args\[0\] \(a of kernel k\): expected dtype float64"):
        prog.launch("k", (2,), (32,), (a.astype(np.float32), out, np.int32(40)))
    with pytest.raises(TypeError, match="n of kernel k.*NumPy scalar of type int32"):
        prog.launch("k", (2,), (32,), (a, out, 40))
    with pytest.raises(TypeError, match="n of kernel k.*int32"):
        prog.launch("k", (2,), (32,), (a, out, np.int64(40)))
    with pytest.raises(ValueError, match="at least one element"):
        prog.launch("k", (2,), (32,), (a[:0], out, np.int32(0)))
    with pytest.raises(ValueError, match="C-contiguous"):
        prog.launch("k", (2,), (32,), (a[::2], out, np.int32(20)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        prog.launch("k", (2,), (32,), (a, out))
    with pytest.raises(ValueError, match="block: expected a multiple of 32"):
        prog.launch("k", (2,), (48,), (a, out, np.int32(40)))
    with pytest.raises(ValueError, match="grid: expected"):
        prog.launch("k", (2, 2), (32,), (a, out, np.int32(40)))
    with pytest.raises(ValueError, match="name: expected one of the kernels"):
        prog.launch("nope", (1,), (32,), (a, out, np.int32(40)))
    frozen = np.zeros(40, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        prog.launch("k", (2,), (32,), (a, frozen, np.int32(40)))


def test_runner_shares_one_buffer_for_one_array_and_refuses_overlaps():
    require_opencl("pocl")
    prog = ocl.Program('extern "C" __global__ void k(const int* a, int* b) '
                       '{ const int i = threadIdx.x; b[i] = a[i] + 1; }', "pocl")
    x = np.arange(32, dtype=np.int32)
    prog.launch("k", (1,), (32,), (x, x))   # in place, as CUDA would see it
    np.testing.assert_array_equal(x, np.arange(32) + 1)
    y = np.arange(64, dtype=np.int32)
    with pytest.raises(ValueError, match="overlaps"):
        prog.launch("k", (1,), (32,), (y[:32], y[16:48]))
    src = np.arange(32, dtype=np.int32)
    dst = np.zeros(32, np.int32)
    prog.launch("k", (1,), (32,), (src, dst))
    np.testing.assert_array_equal(src, np.arange(32))   # const parameter: not copied back
    np.testing.assert_array_equal(dst, np.arange(32) + 1)


@pytest.mark.parametrize("device", ["pocl", "oclgrind"])
def test_available_names_its_devices(device):
    """A device said to be available runs a double-precision kernel; one that is not says
    why, naming the device or what is missing."""
    with pytest.raises(ValueError, match="device: expected one of"):
        ocl.available("cuda")
    ok, why = ocl.available(device)
    if not ok:
        assert why and (ocl.DEVICES[device] in why or "pyopencl" in why or "fp64" in why), why
        return
    assert why is None
    prog = ocl.Program('extern "C" __global__ void k(double* out) '
                       '{ const int i = blockIdx.x * blockDim.x + threadIdx.x; '
                       'out[i] = __dadd_rn(out[i], 0.25 * i); }', device)
    out = np.full(64, 1.0)
    prog.launch("k", (2,), (32,), (out,))
    np.testing.assert_array_equal(out, 1.0 + 0.25 * np.arange(64))
