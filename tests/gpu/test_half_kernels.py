"""Half tables (float16, bfloat16 weights or optimizer state) on the device kernels.

The CUDA kernels take half storage as raw ``unsigned short`` bits, widen it
to float32 on load and round stores with the integer rounding of
:mod:`embedding.precision` (nearest-even, stochastic with the same
splitmix64 bits, a float32 master copy). Results are compared bit for bit
with the NumPy twin: lookups, gradient sums, the fused backward+optimizer for
SGD and Adam with every rounding, narrow optimizer state. Row-wise AdaGrad's
mean of squares is a warp-order sum on the device (a few float32 ulps from
NumPy's), so its float32 values agree within :data:`_F32_ULPS` ulps of the
value plus as many of its change, and the half values rounded from them
within one half ulp per step. On the stand-in the kernels run on PoCL (and one case under
Oclgrind); on a GPU, on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp
from embedding.kernels import Bags, FusedTables, TableLayout, cpu, cuda
from embedding.precision import Rounding, storage_dtype
from embedding.types import OptimizerConfig, OptimizerKind
from gpu_cases import bag_case

pytestmark = pytest.mark.gpu

HALVES = ("float16", "bfloat16")
KINDS = list(OptimizerKind)
STANDIN = getattr(cp, "STANDIN", False)


def _half_case(name, seed, **kw):
    """``bag_case`` with half weights (float32 gradients)."""
    layout, bags, weights, grad = bag_case("float32", seed, **kw)
    return layout, bags, weights.astype(storage_dtype(name)), grad


def _bits(arr) -> np.ndarray:
    """The raw bits of a host or device array (uint16 for half, uint32/64 otherwise)."""
    arr = cp.asnumpy(arr) if isinstance(arr, cp.ndarray) else np.asarray(arr)
    return arr.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])


def _assert_same_bits(dev, host, what):
    d, h = _bits(dev), _bits(host)
    bad = np.flatnonzero(d.ravel() != h.ravel())
    assert d.shape == h.shape and bad.size == 0, (
        f"{what}: {bad.size} of {h.size} elements differ, e.g. at {bad[:4]}: "
        f"{d.ravel()[bad[:4]]} vs {h.ravel()[bad[:4]]}")


def _pair(layout, config, name, **kw):
    """The same half tables on NumPy and on the device."""
    host = FusedTables(layout.rows, layout.dims, config, dtype=name, **kw)
    dev = FusedTables(layout.rows, layout.dims, config, dtype=name, device="cuda", **kw)
    return host, dev


#: Row-wise AdaGrad: float32 values may differ by this many ulps of the value plus as many of
#: its change over the test (warp-order sum of squares; an update's rounding difference is
#: relative to the update, not to the weight it lands on).
_F32_ULPS = 8


def _ordered(arr) -> np.ndarray:
    """Bit patterns as integers ordered like the values (adjacent values differ by 1)."""
    arr = cp.asnumpy(arr) if isinstance(arr, cp.ndarray) else np.asarray(arr)
    if arr.dtype.itemsize == 8 and arr.dtype.kind == "f":
        arr = arr.astype(np.float32)   # float64 state of float32 values
    b = _bits(arr).astype(np.int64)
    sign = np.int64(1) << (8 * arr.dtype.itemsize - 1)
    return np.where(b & sign, -(b & (sign - 1)), b)


def _assert_close(dev, host, what, steps, start=None):
    """Within ``steps`` ulps for half arrays, the :data:`_F32_ULPS` bound for float ones
    (``start``: the values before the updates, None for zeros)."""
    if host.dtype.itemsize != 2:
        if host.dtype.kind != "f":
            _assert_same_bits(dev, host, what)
            return
        h = host.astype(np.float32)
        start = np.zeros_like(h) if start is None else np.asarray(start, np.float32)
        err = np.abs(cp.asnumpy(dev).astype(np.float64) - h)
        bound = _F32_ULPS * (np.spacing(np.abs(h)) + np.spacing(np.abs(h - start)))
        bad = np.flatnonzero(err > bound)
        assert bad.size == 0, (f"{what}: {bad.size} of {h.size} elements differ by more than "
                               f"{_F32_ULPS} ulps, e.g. at {bad[:4]}")
        return
    dist = np.abs(_ordered(dev) - _ordered(host))
    bad = np.flatnonzero(dist > steps)
    assert bad.size == 0, (f"{what}: {bad.size} of {dist.size} elements differ by more than "
                           f"{steps} ulps, e.g. at {bad[:4]}: {dist[bad[:4]]} ulps")


def _assert_tables_equal(dev, host, steps=0, start=None):
    """Bit for bit (``steps`` 0), or row-wise AdaGrad's bounds after ``steps`` updates from
    weights ``start``."""
    def check(d, h, what, begin=None):
        if steps == 0:
            _assert_same_bits(d, h, what)
        else:
            _assert_close(d, h, what, steps, begin)

    check(dev.weights, host.weights, "weights", start)
    assert set(dev.state) == set(host.state)
    for key, arr in host.state.items():
        assert dev.state[key].dtype == arr.dtype
        check(dev.state[key], arr, f"state {key}")
    if host.master is not None:
        check(dev.master, host.master, "master", start)
    assert dev.step == host.step


# --------------------------------------------------------------------------- conversions

@pytest.mark.parametrize("name", HALVES)
def test_lookup_widens_every_half_bit_pattern_exactly(name):
    """All 65536 patterns (zeros, subnormals, normals, inf, NaN) widen as NumPy's astype."""
    dt = storage_dtype(name)
    layout = TableLayout((2048,), (32,))
    weights = np.arange(65536, dtype=np.uint16).view(dt)
    ids = np.arange(2048, dtype=np.int64)
    bags = Bags(ids, np.arange(2049, dtype=np.int64), (0,), (0,), (False,), 2048, 32)
    dev = cuda.pooled_lookup(layout, cp.asarray(weights), bags)
    assert dev.dtype == np.float32
    want = weights.astype(np.float32).reshape(2048, 32)
    _assert_same_bits(dev, want, f"{name} widened")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", HALVES)
def test_stores_round_float32_as_numpy(name, rounding):
    """SGD with lr 1 on zero rows stores ``-g`` rounded: float32 values of every magnitude
    (subnormal in float16, overflowing, inf, signed zeros) round to the same bits as
    NumPy's; NaN stays a NaN of its sign (its payload is not specified). Gradients
    subnormal in float32 are flushed to zero by the device's float32 arithmetic (CuPy
    compiles with -ftz=true), so NumPy gets them flushed."""
    rng = np.random.default_rng(1)
    n, d = 4096, 40
    x = rng.integers(0, 2 ** 32, n * d, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = (rng.standard_normal(n * d) * np.exp2(rng.integers(-40, 20, n * d))).astype(np.float32)
    g = np.where(rng.random(n * d) < 0.5, x, y)
    g[:8] = [np.inf, -np.inf, 0.0, -0.0, 65519.99, 65520.0, 2.0 ** -25, 2.0 ** -33]
    g = g.reshape(n, d)
    layout = TableLayout((n,), (d,))
    config = OptimizerConfig(OptimizerKind.SGD, lr=1.0)
    host, dev = _pair(layout, config, name, rounding=rounding, seeds=[11])
    rows = rng.permutation(n)
    flushed = np.where(np.abs(g) < np.finfo(np.float32).smallest_normal,
                       np.copysign(np.float32(0), g), g)
    assert np.count_nonzero(flushed != g) > 100  # float32 subnormals among the gradients
    with np.errstate(over="ignore", invalid="ignore"):
        host.update([(rows, flushed)])
    dev.update([(cp.asarray(rows), cp.asarray(g))])
    nan = np.isnan(host.weights.astype(np.float32))
    dw = cp.asnumpy(dev.weights)
    np.testing.assert_array_equal(np.isnan(dw.astype(np.float32)), nan)
    np.testing.assert_array_equal(np.signbit(dw.astype(np.float32)),
                                  np.signbit(host.weights.astype(np.float32)))
    _assert_same_bits(dw[~nan], host.weights[~nan], f"{name} {rounding} stores")


# --------------------------------------------------------------------------- the kernels

@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name", HALVES)
def test_half_lookup_matches_numpy_bitwise(name, weighted):
    layout, bags, weights, _ = _half_case(name, 2, weighted=weighted)
    host = cpu.pooled_lookup(layout, weights, bags)
    dev = cuda.pooled_lookup(layout, cp.asarray(weights), bags)
    assert host.dtype == dev.dtype == np.float32
    _assert_same_bits(dev, host, "pooled output")


@pytest.mark.parametrize("name", HALVES)
def test_half_aggregate_matches_numpy_bitwise(name):
    """Gradient sums in float32, max slots routed by the half rows the lookup read."""
    layout, bags, weights, grad = _half_case(name, 3)
    assert bags.any_max
    host, dev = _pair(layout, OptimizerConfig(OptimizerKind.SGD), name)
    host.weights[:] = weights
    dev.weights[:] = cp.asarray(weights)
    for (hr, hg), (dr, dg) in zip(host.aggregate(bags, grad), dev.aggregate(bags,
                                                                            cp.asarray(grad))):
        order = np.argsort(hr, kind="stable")
        np.testing.assert_array_equal(cp.asnumpy(dr), hr[order])
        _assert_same_bits(dg, hg[order], "summed gradients")


@pytest.mark.parametrize("rounding", list(Rounding), ids=lambda r: r.value)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("name", HALVES)
def test_half_backward_update_matches_numpy_bitwise(name, kind, rounding):
    """Three fused steps; the weights, the state, the master rows and the step counter
    agree to the last bit (row-wise AdaGrad: within its bounds, and without max slots,
    whose routing a one-ulp difference of two rows could flip)."""
    adagrad = kind is OptimizerKind.ROWWISE_ADAGRAD
    layout, bags, weights, grad = _half_case(name, 4, slot_max=(False,) * 7 if adagrad else None)
    config = OptimizerConfig(kind, lr=0.05)
    host, dev = _pair(layout, config, name, rounding=rounding,
                      seeds=list(range(3, 3 + layout.num_tables)))
    host.weights[:] = weights
    dev.weights[:] = cp.asarray(weights)
    host.sync_master()
    dev.sync_master()
    for step in range(3):
        g = grad * (step + 1)
        host.backward_update(bags, g)
        dev.backward_update(bags, cp.asarray(g))
    assert not np.array_equal(_bits(host.weights), _bits(weights))
    _assert_tables_equal(dev, host, 3 if adagrad else 0, weights)


@pytest.mark.parametrize("name, state", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                         ("float32", "bfloat16"), ("float16", "float64")])
@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM],
                         ids=lambda k: k.value)
def test_narrow_state_matches_numpy_bitwise(name, state, kind):
    """Optimizer state stored apart from the weights (half, or wider): read as float32,
    written back rounded to nearest; sparse rows with duplicates, mixed roundings."""
    rng = np.random.default_rng(5)
    layout = TableLayout((50, 20, 4), (8, 33, 70))
    config = OptimizerConfig(kind, lr=0.1)
    half = name != "float32"
    rounding = ["stochastic", "master", "nearest"] if half else "nearest"
    host, dev = _pair(layout, config, name, state_dtype=state, rounding=rounding,
                      seeds=[7, 8, 9])
    w = rng.standard_normal(layout.total_elements).astype(host.dtype)
    host.weights[:] = w
    dev.weights[:] = cp.asarray(w)
    host.sync_master()
    dev.sync_master()
    for _ in range(2):
        sparse = []
        for r, d in zip(layout.rows, layout.dims):
            rows = np.concatenate([[r - 1, r - 1, 0], rng.integers(0, r, 9)])
            sparse.append((rows, rng.standard_normal((rows.size, d)).astype(np.float32)))
        host.update(sparse, unique=False)
        dev.update([(cp.asarray(r), cp.asarray(g)) for r, g in sparse], unique=False)
    adagrad = kind is OptimizerKind.ROWWISE_ADAGRAD
    assert dev.state["momentum" if adagrad else "exp_avg"].dtype == storage_dtype(state)
    _assert_tables_equal(dev, host, 2 if adagrad else 0, w)


def test_device_refuses_half_state_of_float64_tables():
    with pytest.raises(ValueError, match=r"state_dtype: .*float16 optimizer state.*float64"):
        FusedTables((4,), (8,), OptimizerConfig(OptimizerKind.ADAM), dtype="float64",
                    state_dtype="float16", device="cuda")
    from embedding.kernels.cuda_src import source_for

    with pytest.raises(ValueError, match=r"state_dtype: .*not float64"):
        source_for("float64", "bfloat16")
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got int8"):
        source_for("int8")


@pytest.mark.skipif(not STANDIN, reason="Oclgrind checks the kernels on machines without a "
                                        "GPU (on a GPU, run under compute-sanitizer)")
@pytest.mark.parametrize("name", HALVES)
def test_oclgrind_finds_no_error_in_half_kernels(name):
    """Lookup, and the update with every optimizer and rounding on one launch, narrow state,
    under Oclgrind (races, out-of-bounds, uninitialized reads)."""
    from cupy import _raw

    import opencl

    ok, why = opencl.available("oclgrind")
    if not ok:
        pytest.skip(f"oclgrind is not usable: {why}")
    layout, bags, weights, grad = _half_case(name, 6, batch=4, rows=(9, 5, 3), dims=(33, 8, 1),
                                             slot_table=(0, 2, 1), slot_mean=(False, True,
                                                                              False))
    config = [OptimizerConfig(k, lr=0.05) for k in KINDS]
    host, dev = _pair(layout, config, name, state_dtype=name,
                      rounding=["stochastic", "master", "nearest"], seeds=[1, 2, 3])
    host.weights[:] = weights
    dev.weights[:] = cp.asarray(weights)
    host.sync_master()
    dev.sync_master()
    saved, modules = _raw.OPENCL_DEVICE, cuda._MODULES
    _raw.OPENCL_DEVICE, cuda._MODULES = "oclgrind", {}
    try:
        _assert_same_bits(dev.lookup(bags), host.lookup(bags), "pooled output")
        host.backward_update(bags, grad)
        dev.backward_update(bags, cp.asarray(grad))
    finally:
        _raw.OPENCL_DEVICE, cuda._MODULES = saved, modules
    _assert_tables_equal(dev, host, 1, weights)


def test_bfloat16_on_device_needs_cupy_14(monkeypatch):
    """CuPy holds bfloat16 arrays (ml_dtypes') from version 14: with an older CuPy a bf16
    device table or bf16 device communication is refused up front, naming the setting;
    float16 still works. The stand-in refuses the dtype itself as CuPy 13 does."""
    from embedding.sharding.qcomm import CommPrecision, Wire

    sgd = OptimizerConfig(OptimizerKind.SGD, lr=0.1)
    monkeypatch.setattr(cp, "__version__", "13.6.0")
    with pytest.raises(ValueError, match=r"dtype of table 'users': bfloat16 on CuPy arrays "
                                         r"needs CuPy 14 or later.*CuPy 13\.6\.0 is installed"):
        FusedTables([8], [4], sgd, dtype="bfloat16", device="cuda", names=["users"])
    with pytest.raises(ValueError, match=r"state_dtype of table 'users': bfloat16"):
        FusedTables([8], [4], sgd, dtype="float16", device="cuda", names=["users"],
                    state_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"qcomms.backward = 'bf16': bfloat16 on CuPy arrays "
                                         r"needs CuPy 14"):
        Wire(CommPrecision.BF16, cp, "float32", key="qcomms.backward")
    FusedTables([8], [4], sgd, dtype="float16", device="cuda", names=["users"])
    Wire(CommPrecision.FP16, cp, "float32")
    Wire(CommPrecision.BF16, np, "float32")  # NumPy: ml_dtypes is enough
    if getattr(cp, "STANDIN", False):
        with pytest.raises(ValueError, match="Unsupported dtype bfloat16"):
            cp.zeros(4, storage_dtype("bfloat16"))
    monkeypatch.setattr(cp, "__version__", "14.0.0")
    FusedTables([8], [4], sgd, dtype="bfloat16", device="cuda", names=["users"])


def test_bfloat16_on_device_needs_numpy_2_1_2_with_cupy_14(monkeypatch):
    """CuPy 14 registers its bfloat16 kernels only with NumPy 2.1.2 or later: with an older
    NumPy a bf16 device table or bf16 device communication is refused up front, naming the
    setting and the NumPy installed; with the NumPy installed here the check agrees with
    what CuPy does (a bf16 device table trains)."""
    from embedding.sharding.qcomm import CommPrecision, Wire
    from neocomm.types import check_array_bfloat16

    sgd = OptimizerConfig(OptimizerKind.SGD, lr=0.1)
    monkeypatch.setattr(cp, "__version__", "14.0.0")
    monkeypatch.setattr(np, "__version__", "2.1.1")
    with pytest.raises(ValueError, match=r"dtype of table 'users': bfloat16 on CuPy arrays "
                                         r"needs NumPy 2\.1\.2 or later.*NumPy 2\.1\.1 is "
                                         r"installed.*pip install 'numpy>=2\.1\.2'"):
        FusedTables([8], [4], sgd, dtype="bfloat16", device="cuda", names=["users"])
    with pytest.raises(ValueError, match=r"qcomms.forward = 'bf16': .*NumPy 2\.1\.1"):
        Wire(CommPrecision.BF16, cp, "float32", key="qcomms.forward")
    FusedTables([8], [4], sgd, dtype="float16", device="cuda", names=["users"])
    monkeypatch.undo()
    try:
        check_array_bfloat16(cp, "dtype")
    except ValueError as exc:  # this host's CuPy or NumPy has no bfloat16: nothing to run
        pytest.skip(str(exc))
    table = FusedTables([8], [4], sgd, dtype="bfloat16", device="cuda", names=["users"])
    table.weight(0)[...] = cp.asarray(np.ones((8, 4), storage_dtype("bfloat16")))
    assert cp.asnumpy(table.weight(0)).astype(np.float32).sum() == 32
