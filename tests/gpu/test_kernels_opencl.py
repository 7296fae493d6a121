"""The CUDA kernels of :mod:`embedding.kernels.cuda_src` on CPU OpenCL, against the NumPy twins.

The CUDA source is translated mechanically to OpenCL C by
``tests/devsim/cuda_to_opencl.py`` and run by ``tests/devsim/opencl.py`` (both tested in
``test_opencl_runner.py``) on PoCL (results) and on Oclgrind (races, out-of-bounds and
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

import cupy as cp
import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables, TableLayout, cpu, cuda
from embedding.kernels.cuda_src import MAX_DIM
from embedding.types import OptimizerConfig, OptimizerKind
from gpu_cases import bag_case, require_opencl

DTYPES = ("float32", "float64")
KINDS = list(OptimizerKind)


STANDIN = getattr(cp, "STANDIN", False)


@pytest.fixture(scope="module")
def device():
    """Where :mod:`embedding.kernels.cuda` launches: PoCL on the stand-in, else the GPU."""
    if not STANDIN:
        return "cuda"
    require_opencl("pocl")
    return "pocl"


@pytest.fixture(scope="module")
def oclgrind():
    if not STANDIN:
        pytest.skip("Oclgrind checks the kernels on machines without a GPU (on a GPU, run "
                    "these tests under compute-sanitizer)")
    require_opencl("oclgrind")
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
