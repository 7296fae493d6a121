"""The CUDA kernels of :mod:`embedding.kernels.cuda_src` on CPU OpenCL, against the NumPy twins.

The CUDA source is translated mechanically to OpenCL C by ``tests/devsim/opencl.py``
and run on PoCL (results) and on Oclgrind (races, out-of-bounds and
uninitialized accesses, barrier divergence), launched by
:mod:`embedding.kernels.cuda` itself on the device stand-in's CuPy, so every
step around the launches (occurrence keys, stable argsort, segment starts,
optimizer arguments) is the code a GPU runs. Lookups, gradient sums and SGD
agree to the last bit; row-wise AdaGrad (a warp reduction of the squares)
and Adam (device ``pow``) to a few ulps, as ``test_embedding_kernels.py``
states for the CUDA device.

No GPU is needed. These tests never skip in CI: without PoCL or Oclgrind
they fail with the reason when ``CI`` is set, and skip with it elsewhere.
On a machine with a real GPU, ``test_embedding_kernels.py`` runs the same
module on the device instead.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import re
import sys
from pathlib import Path

import cupy as cp
import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables, TableLayout, cpu, cuda
from embedding.kernels.cuda_src import MAX_DIM, source_for
from embedding.types import OptimizerConfig, OptimizerKind
from gpu_cases import bag_case

_DEVSIM = Path(__file__).resolve().parents[1] / "devsim" / "opencl.py"


def _load_devsim():
    mod = sys.modules.get("opencl")
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve() == _DEVSIM:
        return mod
    name = "opencl" if mod is None else "_devsim_opencl"
    spec = importlib.util.spec_from_file_location(name, _DEVSIM)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ocl = _load_devsim()
DTYPES = ("float32", "float64")
KINDS = list(OptimizerKind)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _require(device: str) -> None:
    ok, why = ocl.available(device)
    if ok:
        return
    if _in_ci():
        pytest.fail(f"{device} must run in CI but is not usable: {why}")
    pytest.skip(f"{device} is not usable: {why}")


STANDIN = getattr(cp, "STANDIN", False)


@pytest.fixture(scope="module")
def device():
    """Where :mod:`embedding.kernels.cuda` launches: PoCL on the stand-in, else the GPU."""
    if not STANDIN:
        return "cuda"
    _require("pocl")
    return "pocl"


@pytest.fixture(scope="module")
def oclgrind():
    if not STANDIN:
        pytest.skip("Oclgrind checks the kernels on machines without a GPU (on a GPU, run "
                    "these tests under compute-sanitizer)")
    _require("oclgrind")
    return "oclgrind"


# --------------------------------------------------------------------------- the device path

class _DeviceTwin:
    """:mod:`embedding.kernels.cuda` itself, on the device stand-in's CuPy or a GPU.

    On the stand-in its ``RawModule`` launches the kernels on the OpenCL
    ``device`` ("pocl" or "oclgrind"); NumPy inputs go to the device and results come back, and
    the weights and optimizer state given are updated in place as the
    device's are. ``max_blocks`` caps the grid like ``cuda._MAX_BLOCKS``; a
    small cap makes the kernels' grid-stride loops take several turns.
    """

    _modules: dict = {}  # per OpenCL device: cuda.py's compiled-module cache

    def __init__(self, device: str, max_blocks: int = cuda._MAX_BLOCKS):
        self.device, self.max_blocks = device, max_blocks

    def _call(self, fn, *args, **kwargs):
        saved = cuda._MAX_BLOCKS, cuda._MODULES
        cuda._MAX_BLOCKS = self.max_blocks
        cuda._MODULES = self._modules.setdefault(self.device, {})
        if STANDIN:
            from cupy import _raw

            saved_device, _raw.OPENCL_DEVICE = _raw.OPENCL_DEVICE, self.device
        try:
            return fn(*args, **kwargs)
        finally:
            cuda._MAX_BLOCKS, cuda._MODULES = saved
            if STANDIN:
                _raw.OPENCL_DEVICE = saved_device

    @staticmethod
    def _host(obj):
        if isinstance(obj, cp.ndarray):
            return obj.get()
        if isinstance(obj, (list, tuple)):
            return type(obj)(_DeviceTwin._host(o) for o in obj)
        return obj

    def _with_tables(self, fn, layout, config, weights, state, *rest):
        dw = cp.asarray(weights)
        ds = {k: cp.asarray(v) for k, v in state.items()}
        self._call(fn, layout, config, dw, ds, *rest)
        weights[...] = dw.get()
        for k, v in ds.items():
            state[k][...] = v.get()

    def pooled_lookup(self, layout, weights, bags, out=None):
        dout = None if out is None else cp.asarray(out)
        res = self._call(cuda.pooled_lookup, layout, cp.asarray(weights), bags, dout).get()
        if out is not None:
            out[...] = res
        return res

    def aggregate_grads(self, layout, bags, grad_out, weights=None):
        return self._host(self._call(cuda.aggregate_grads, layout, bags, cp.asarray(grad_out),
                                     None if weights is None else cp.asarray(weights)))

    def aggregate_rows(self, rows, grads, num_rows):
        return self._host(self._call(cuda.aggregate_rows, rows, cp.asarray(grads), num_rows))

    def _bag_source(self, layout, bags, grad_out, weights=None):
        return self._host(self._call(cuda._bag_source, layout, bags, cp.asarray(grad_out),
                                     None if weights is None else cp.asarray(weights)))

    def backward_update(self, layout, config, weights, state, bags, grad_out):
        self._with_tables(cuda.backward_update, layout, config, weights, state, bags,
                          cp.asarray(grad_out))

    def apply_updates(self, layout, config, weights, state, sparse, row_terms=None):
        self._with_tables(cuda.apply_updates, layout, config, weights, state, sparse, True,
                          row_terms)


# --------------------------------------------------------------------------- inputs

#: AdaGrad (warp-order sum of squares) and Adam (device ``pow``) may differ from NumPy by this
#: many ulps of a value plus as many ulps of its change over the test (the rounding
#: difference of an update is relative to the update, not to the weight it lands on).
_ULPS = 8


def _assert_agree(kind, dev, host, start=None):
    """Bit-exact for SGD and integer state; within :data:`_ULPS` ulps otherwise."""
    if kind is OptimizerKind.SGD or host.dtype.kind != "f":
        np.testing.assert_array_equal(dev, host)
        return
    start = np.zeros_like(host) if start is None else start
    err = np.abs(dev.astype(np.float64) - host)
    bound = _ULPS * (np.spacing(np.abs(host)) + np.spacing(np.abs(host - start)))
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, (f"{bad.size} of {host.size} elements differ by more than {_ULPS} "
                           f"ulps, e.g. at {bad[:4]}: {dev[bad[:4]]} vs {host[bad[:4]]}")


def _assert_tables_agree(kind, dev_w, dev_state, host, start):
    _assert_agree(kind, dev_w, host.weights, start)
    assert set(dev_state) == set(host.state)
    for name, arr in host.state.items():
        _assert_agree(kind, dev_state[name], arr)


def _assert_sparse_equal(dev, host):
    """Per table ``(rows, grads)``: device rows come sorted, host rows in any order."""
    assert len(dev) == len(host)
    for (dr, dg), (hr, hg) in zip(dev, host):
        order = np.argsort(hr, kind="stable")
        np.testing.assert_array_equal(dr, hr[order])
        np.testing.assert_array_equal(dg, hg[order])


# --------------------------------------------------------------------------- PoCL vs NumPy

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_lookup_matches_numpy_bitwise(device, dtype, weighted):
    layout, bags, weights, _ = bag_case(dtype, seed=1, weighted=weighted)
    host = cpu.pooled_lookup(layout, weights, bags)
    dev = _DeviceTwin(device).pooled_lookup(layout, weights.copy(), bags)
    np.testing.assert_array_equal(dev, host)
    # a grid smaller than the bags: the grid-stride loop takes several turns
    small = _DeviceTwin(device, max_blocks=2).pooled_lookup(layout, weights.copy(), bags)
    np.testing.assert_array_equal(small, host)


def test_lookup_zeroes_columns_no_slot_covers(device):
    layout, bags, weights, _ = bag_case("float32", seed=2, rows=(4, 3), dims=(5, 40),
                                     slot_table=(1, 0), slot_mean=(True, False))
    bags = Bags(bags.indices, bags.offsets, bags.slot_table, (0, 47), bags.slot_mean,
                bags.batch_size, 52, bags.num_groups, bags.weights)
    out = np.full((bags.out_rows, 52), np.nan, np.float32)
    dev = _DeviceTwin(device).pooled_lookup(layout, weights, bags, out)
    np.testing.assert_array_equal(dev, cpu.pooled_lookup(layout, weights, bags))
    assert not np.isnan(dev).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_aggregate_from_bags_matches_numpy_bitwise(device, dtype):
    """segment_update mode 0 (write sums), gradients from the bags (from_bags 1); max slots
    route each column's gradient to the bag's first maximum as NumPy does."""
    layout, bags, weights, grad = bag_case(dtype, seed=3)
    assert bags.any_max
    host = cpu.aggregate_grads(layout, bags, grad, weights=weights)
    _assert_sparse_equal(_DeviceTwin(device).aggregate_grads(layout, bags, grad, weights), host)
    _assert_sparse_equal(_DeviceTwin(device, max_blocks=1).aggregate_grads(layout, bags, grad,
                                                                           weights), host)


@pytest.mark.parametrize("dtype", DTYPES)
def test_occurrence_keys_are_global_rows_and_bags(device, dtype):
    layout, bags, weights, grad = bag_case(dtype, seed=4)
    keys, source = _DeviceTwin(device, max_blocks=1)._bag_source(layout, bags, grad, weights)
    lengths = np.diff(bags.offsets)
    bag_of = np.repeat(np.arange(bags.num_bags), lengths)
    slot = (bag_of // bags.batch_size) % bags.num_slots
    base = np.asarray(layout.row_base)[np.asarray(bags.slot_table)[slot]]
    np.testing.assert_array_equal(keys, base + bags.indices)
    np.testing.assert_array_equal(source[4], bag_of)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS + ["mixed"], ids=lambda k: getattr(k, "value", k))
def test_backward_update_matches_numpy(device, kind, dtype):
    """segment_update mode 1 (optimizer step), gradients from the bags; three steps."""
    layout, bags, weights, grad = bag_case(dtype, seed=5)
    if kind == "mixed":
        config = [OptimizerConfig(KINDS[t % 3], lr=0.05) for t in range(layout.num_tables)]
    else:
        config = OptimizerConfig(kind, lr=0.05)
    host = FusedTables(layout.rows, layout.dims, config, dtype=dtype)
    host.weights[:] = weights
    dev_w, dev_state = host.weights.copy(), copy.deepcopy(host.state)
    twin = _DeviceTwin(device, max_blocks=3)
    for step in range(3):
        g = grad * (step + 1)
        host.backward_update(bags, g)
        twin.backward_update(layout, host.optimizers, dev_w, dev_state, bags, g)
    _assert_tables_agree(OptimizerKind.ADAM if kind == "mixed" else kind, dev_w, dev_state,
                         host, weights)
    if kind is OptimizerKind.SGD or kind is OptimizerKind.ADAM:
        assert not np.array_equal(dev_w, weights)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_sparse_rows_update_matches_numpy(device, kind, dtype):
    """segment_update mode 1, gradients from flat rows (from_bags 0), duplicate rows summed."""
    rng = np.random.default_rng(6)
    layout = TableLayout((50, 20, 1, 4), (8, 33, 3, MAX_DIM))
    config = OptimizerConfig(kind, lr=0.1)
    host = FusedTables(layout.rows, layout.dims, config, dtype=dtype)
    host.weights[:] = rng.standard_normal(layout.total_elements)
    start = host.weights.copy()
    dev_w, dev_state = host.weights.copy(), copy.deepcopy(host.state)
    sparse = []
    for r, d in zip(layout.rows, layout.dims):
        rows = np.concatenate([[r - 1, r - 1, 0], rng.integers(0, r, 9)])
        sparse.append((rows, rng.standard_normal((rows.size, d)).astype(dtype)))
    sparse[1] = (sparse[1][0][:0], sparse[1][1][:0])   # a table without updates
    for _ in range(2):
        host.update(sparse, unique=False)
        _DeviceTwin(device, max_blocks=1).apply_updates(layout, host.optimizers, dev_w, dev_state,
                                                     sparse)
    _assert_tables_agree(kind, dev_w, dev_state, host, start)


def _row_termsbag_case(dtype, terms_of_second):
    layout = TableLayout((10, 3), (4, 40))
    config = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    host = FusedTables(layout.rows, layout.dims, config, dtype=dtype)
    rng = np.random.default_rng(7)
    host.weights[:] = rng.standard_normal(layout.total_elements)
    dev = (host.weights.copy(), copy.deepcopy(host.state))
    sparse = [(np.array([1, 4, 9]), np.arange(12.0, dtype=dtype).reshape(3, 4)),
              (np.array([2, 0]), rng.standard_normal((2, 40)).astype(dtype))]
    terms = [np.array([0.5, 2.0, 3.0], dtype), terms_of_second]
    host.update(sparse, row_terms=terms)
    return layout, host, dev, sparse, terms


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_terms_replace_mean_of_squares(device, dtype):
    """has_row_term 1: row-wise AdaGrad adds the given term instead of mean(g*g)."""
    layout, host, (dev_w, dev_state), sparse, terms = _row_termsbag_case(
        dtype, np.array([0.25, 4.0], dtype))
    start = dev_w.copy()
    _DeviceTwin(device).apply_updates(layout, host.optimizers, dev_w, dev_state, sparse, terms)
    np.testing.assert_array_equal(dev_state["momentum"][[1, 4, 9, 12, 10]],
                                  [0.5, 2.0, 3.0, 0.25, 4.0])
    _assert_tables_agree(OptimizerKind.ROWWISE_ADAGRAD, dev_w, dev_state, host, start)


def test_row_terms_of_none_keep_mean_of_squares(device):
    """A table without terms next to one with terms: its rows add mean(g*g) as on NumPy."""
    layout, host, (dev_w, dev_state), sparse, terms = _row_termsbag_case("float64", None)
    _DeviceTwin(device).apply_updates(layout, host.optimizers, dev_w, dev_state, sparse, terms)
    np.testing.assert_allclose(dev_state["momentum"], host.state["momentum"], rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 33, MAX_DIM])
def test_aggregate_rows_matches_numpy_bitwise(device, dtype, dim):
    """segment_update mode 0 with gradients from flat rows (from_bags 0)."""
    rng = np.random.default_rng(8)
    rows = np.concatenate([[6, 6, 0], rng.integers(0, 7, 20)])
    grads = rng.standard_normal((rows.size, dim)).astype(dtype)
    hr, hg = cpu.aggregate_rows(rows, grads, 7)
    dr, dg = _DeviceTwin(device, max_blocks=1).aggregate_rows(rows, grads, 7)
    _assert_sparse_equal([(dr, dg)], [(hr, hg)])


# --------------------------------------------------------------------------- Oclgrind
# Oclgrind simulates every work-item and checks each access: smaller batches, and a grid
# capped at two blocks so that the grid-stride loops take several turns.

@pytest.mark.parametrize("dtype", DTYPES)
def test_oclgrind_finds_no_error_in_lookup_and_keys(oclgrind, dtype):
    layout, bags, weights, grad = bag_case(dtype, seed=9, batch=4)
    twin = _DeviceTwin(oclgrind, max_blocks=2)
    np.testing.assert_array_equal(twin.pooled_lookup(layout, weights, bags),
                                  cpu.pooled_lookup(layout, weights, bags))
    keys, source = twin._bag_source(layout, bags, grad, weights)
    assert keys.size == source[4].size == bags.indices.size


@pytest.mark.parametrize("dtype", DTYPES)
def test_oclgrind_finds_no_error_in_segment_update(oclgrind, dtype):
    """Every branch: mode 0 and 1, from_bags 1 and 0, SGD, row-wise AdaGrad (warp_sum,
    __syncwarp), Adam (__syncwarp, pow), row terms; the tables use all three optimizers."""
    layout, bags, weights, grad = bag_case(dtype, seed=10, batch=4)
    twin = _DeviceTwin(oclgrind, max_blocks=2)
    _assert_sparse_equal(twin.aggregate_grads(layout, bags, grad, weights),
                         cpu.aggregate_grads(layout, bags, grad, weights=weights))
    config = [OptimizerConfig(KINDS[t % 3], lr=0.05) for t in range(layout.num_tables)]
    host = FusedTables(layout.rows, layout.dims, config, dtype=dtype)
    host.weights[:] = weights
    dev_w, dev_state = host.weights.copy(), copy.deepcopy(host.state)
    for step in range(2):
        host.backward_update(bags, grad)
        twin.backward_update(layout, host.optimizers, dev_w, dev_state, bags, grad)
    rng = np.random.default_rng(11)
    sparse = [(np.unique(rng.integers(0, r, 3)), None) for r in layout.rows]
    sparse = [(rows, rng.standard_normal((rows.size, d)).astype(dtype))
              for (rows, _), d in zip(sparse, layout.dims)]
    terms = [rng.uniform(0, 1, rows.size).astype(dtype) for rows, _ in sparse]
    host.update(sparse, row_terms=terms)
    twin.apply_updates(layout, host.optimizers, dev_w, dev_state, sparse, terms)
    _assert_tables_agree(OptimizerKind.ADAM, dev_w, dev_state, host, weights)
    rows = np.array([6, 0, 6, 6, 3])
    grads = rng.standard_normal((rows.size, 40)).astype(dtype)
    _assert_sparse_equal([twin.aggregate_rows(rows, grads, 7)],
                         [cpu.aggregate_rows(rows, grads, 7)])


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
    _require("pocl")
    prog = ocl.Program(_PROBE, "pocl")
    args = _probe_args(grid, block)
    prog.launch("probe", (grid,), (block,), args)
    _check_probe(args, grid, block)


def test_translated_probe_is_clean_under_oclgrind():
    _require("oclgrind")
    args = _probe_args(2, 64)
    ocl.Program(_PROBE, "oclgrind").launch("probe", (2,), (64,), args)
    _check_probe(args, 2, 64)


def test_translated_bit_casts_run_on_pocl():
    """``__float_as_uint`` / ``__uint_as_float`` (half storage) keep every bit, NaN included."""
    _require("pocl")
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
    _require("oclgrind")
    source, expected = _RACY[case]
    out = np.zeros(32, np.int32)
    with pytest.raises(ocl.OclgrindError) as info:
        ocl.Program(source, "oclgrind").launch("k", (1,), (32,), (out,))
    assert expected in info.value.report, info.value.report
    assert info.value.kernel == "k"


def test_oclgrind_runner_passes_a_clean_kernel():
    _require("oclgrind")
    prog = ocl.Program('extern "C" __global__ void k(int* out) { const int seen = out[0]; '
                       '__syncwarp(); if (threadIdx.x == 0) out[0] = seen + 1; }', "oclgrind")
    out = np.zeros(1, np.int32)
    for _ in range(2):
        prog.launch("k", (1,), (32,), (out,))
    assert out[0] == 2


def test_runner_checks_arguments():
    _require("pocl")
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
    _require("pocl")
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
