"""The device kernels with a communication wire, against the codec on NumPy.

``pooled_lookup`` built for a wire format writes the pooled rows as fp16 or bf16
bits or int8 FUSED8BIT rows (a warp reduces each wire row's minimum and maximum
with shuffles); ``segment_update`` reads fp16 or bf16 gradients as received. The
bytes must be those of ``Wire.encode`` of the NumPy lookup, and the backward's
results those of the NumPy backward on the decoded gradients: sum, mean and max
pooling, weighted ids, empty bags, float32, float64 and half tables, int8 rows
that do and do not divide a warp. On the stand-in the kernels run on PoCL, and
a few cases under Oclgrind (races, out-of-bounds and uninitialized accesses,
shuffles every lane reaches); on a GPU, on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp
from embedding.kernels import Bags, FusedTables, cpu, cuda
from embedding.kernels.cuda_src import MAX_DIM
from embedding.precision import compute_dtype
from embedding.sharding.qcomm import CommPrecision, Wire
from embedding.types import OptimizerConfig, OptimizerKind
from gpu_cases import assert_same_bytes, wire_case

pytestmark = pytest.mark.gpu

FP16, BF16, INT8 = CommPrecision.FP16, CommPrecision.BF16, CommPrecision.INT8
STANDIN = getattr(cp, "STANDIN", False)
TABLE_DTYPES = ("float32", "float64", "float16", "bfloat16")
#: ``(int8 row, table dims)``: rows dividing a warp (4, 32: reduced within lane groups) and
#: not (12, 48, 3: reduced over the warp), a slot of MAX_DIM columns
INT8_CASES = ((4, (16, 64, MAX_DIM, 4, 100, 8)), (12, (12, 36, 24, 132, 60, 12)),
              (32, (32, 64, 96, 32, 160, 32)), (48, (48, 96, 144, 48, 48, 96)),
              (3, (3, 9, 33, 6, 3, 12)))


class _On:
    """Launch on an OpenCL device of the stand-in ("pocl", "oclgrind") with a grid capped at
    ``max_blocks`` (grid-stride loops take several turns); nothing to switch on a GPU."""

    def __init__(self, device="pocl", max_blocks=cuda._MAX_BLOCKS):
        self.device, self.max_blocks = device, max_blocks

    def __enter__(self):
        self._saved = cuda._MAX_BLOCKS, cuda._MODULES
        cuda._MAX_BLOCKS = self.max_blocks
        if STANDIN:
            from cupy import _raw

            self._dev = _raw.OPENCL_DEVICE
            _raw.OPENCL_DEVICE = self.device
            cuda._MODULES = {}
        return self

    def __exit__(self, *exc):
        cuda._MAX_BLOCKS, cuda._MODULES = self._saved
        if STANDIN:
            from cupy import _raw

            _raw.OPENCL_DEVICE = self._dev


def _require_oclgrind():
    if not STANDIN:
        pytest.skip("Oclgrind checks the kernels on machines without a GPU (on a GPU, run "
                    "these tests under compute-sanitizer)")
    import opencl

    ok, why = opencl.available("oclgrind")
    if not ok:
        pytest.skip(f"oclgrind is not usable: {why}")


def _device_lookup(layout, weights, bags, precision, row=1, scale=None, max_blocks=None):
    wire = Wire(precision, cp, compute_dtype(weights.dtype), row=row, scale=scale)
    with _On("pocl", max_blocks or cuda._MAX_BLOCKS):
        return cuda.pooled_lookup(layout, cp.asarray(weights), bags, wire=wire)


def _host_encoded(layout, weights, bags, precision, row=1, scale=None):
    wire = Wire(precision, np, compute_dtype(weights.dtype), row=row, scale=scale)
    return wire.encode(cpu.pooled_lookup(layout, weights, bags).reshape(-1))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("scale", [None, 256.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("precision", [FP16, BF16], ids=lambda p: p.value)
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_lookup_writes_the_half_wire_bytes(dtype, precision, scale, weighted):
    layout, bags, weights, _ = wire_case(dtype, 1, weighted=weighted)
    want = _host_encoded(layout, weights, bags, precision, scale=scale)
    got = _device_lookup(layout, weights, bags, precision, scale=scale)
    assert got.shape == (bags.out_rows, bags.out_dim)
    assert_same_bytes(got, want, f"{dtype} -> {precision.value}")


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("row, dims", INT8_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_lookup_writes_the_int8_wire_rows(dtype, row, dims, weighted):
    layout, bags, weights, _ = wire_case(dtype, 2, dims=dims, weighted=weighted)
    want = _host_encoded(layout, weights, bags, INT8, row)
    got = _device_lookup(layout, weights, bags, INT8, row)
    assert got.shape == (bags.out_rows, bags.out_dim // row * (row + 8))
    assert_same_bytes(got, want, f"{dtype} -> int8 rows of {row}")
    # a grid of two blocks: each warp encodes several bags with the same registers
    small = _device_lookup(layout, weights, bags, INT8, row, max_blocks=2)
    assert_same_bytes(small, want, f"{dtype} -> int8 rows of {row} (2 blocks)")


def test_float64_rounds_once_to_fp16():
    """float64 pooled values round straight to float16 and bfloat16 (not through the
    nearest float32, which would round values just above a tie down), on the host codec and
    the device kernel alike, whichever ml_dtypes is installed."""
    ties = np.array([1 + 2.0 ** -11 + 2.0 ** -30, 1 + 2.0 ** -8 + 2.0 ** -30,
                     -(1 + 2.0 ** -11 + 2.0 ** -40), 3.0e38, 70000.0, 2.0 ** -25 + 2.0 ** -50,
                     -2.0 ** -26, 0.0, 1e-300, 1e300, -np.inf, 65520.0])
    weights = np.repeat(ties, 4)
    from embedding.kernels import TableLayout

    layout = TableLayout((ties.size,), (4,))
    bags = Bags(np.arange(ties.size, dtype=np.int64), np.arange(ties.size + 1, dtype=np.int64),
                (0,), (0,), (False,), ties.size, 4)
    for precision in (FP16, BF16):
        with np.errstate(over="ignore"):  # 1e300 and 3e38 overflow to inf, as they should
            want = _host_encoded(layout, weights, bags, precision)
        assert_same_bytes(_device_lookup(layout, weights, bags, precision), want,
                          precision.value)
    assert np.float16(ties[0]) != np.float16(np.float32(ties[0]))  # the case is a trap


# float64 values next to a tie, the tie itself and an odd tie; (float16 bits, bfloat16 bits)
# of each rounded once to nearest, ties to even
PINNED_TIES = [(1 + 2.0 ** -11 + 2.0 ** -30, 0x3C01, 0x3F80), (1 + 2.0 ** -11, 0x3C00, 0x3F80),
               (1 + 2.0 ** -8 + 2.0 ** -30, 0x3C04, 0x3F81), (1 + 2.0 ** -8, 0x3C04, 0x3F80),
               (1 + 3 * 2.0 ** -8, 0x3C0C, 0x3F82), (-(1 + 2.0 ** -8 + 2.0 ** -40), 0xBC04, 0xBF81),
               (3.4e38, 0x7C00, 0x7F80), (2.0 ** -133 + 2.0 ** -160, 0x0000, 0x0001),
               (2.0 ** -134 + 2.0 ** -160, 0x0000, 0x0001), (2.0 ** -25 + 2.0 ** -50, 0x0001, 0x3300)]


@pytest.mark.parametrize("precision", [FP16, BF16], ids=lambda p: p.value)
def test_half_wire_pins_the_ties_on_host_and_device(precision):
    """The wire's half encoding is the project's own (embedding.precision.encode_half): the
    NumPy codec and the device kernel give these bits, not whatever ml_dtypes' cast does."""
    from embedding.kernels import TableLayout

    values = np.array([v for v, _, _ in PINNED_TIES])
    want = np.array([b16 if precision is BF16 else f16 for _, f16, b16 in PINNED_TIES],
                    np.uint16)
    layout = TableLayout((values.size,), (4,))
    weights = np.repeat(values, 4)
    bags = Bags(np.arange(values.size, dtype=np.int64), np.arange(values.size + 1, dtype=np.int64),
                (0,), (0,), (False,), values.size, 4)
    with np.errstate(over="ignore"):
        host = _host_encoded(layout, weights, bags, precision)
    np.testing.assert_array_equal(np.asarray(host).view(np.uint16).reshape(-1, 4)[:, 0], want)
    device = _device_lookup(layout, weights, bags, precision)
    got = np.asarray(device.get() if hasattr(device, "get") else device)
    np.testing.assert_array_equal(got.view(np.uint16).reshape(-1, 4)[:, 0], want)


def test_uncovered_columns_are_encoded_zeros():
    layout, bags, weights, _ = wire_case("float32", 3, rows=(4, 3), dims=(8, 40),
                                         slot_table=(1, 0), slot_mean=(True, False))
    bags = Bags(bags.indices, bags.offsets, bags.slot_table, (0, 48), bags.slot_mean,
                bags.batch_size, 64, bags.num_groups, bags.weights)
    for precision in (FP16, BF16, INT8):
        want = _host_encoded(layout, weights, bags, precision, 8)
        got = _device_lookup(layout, weights, bags, precision, 8)
        assert_same_bytes(got, want, precision.value)


# the stand-in computes each CuPy result's metadata on the memory as it is before queued work
# lands (the codec's cast of its codes then sees garbage): its warning says nothing here
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_int8_slots_wider_than_the_registers_are_encoded_after_the_launch():
    layout, bags, weights, _ = wire_case("float32", 4, rows=(6, 5), dims=(MAX_DIM + 16, 8),
                                         slot_table=(0, 1), slot_mean=(False, True))
    want = _host_encoded(layout, weights, bags, INT8, 8)
    assert_same_bytes(_device_lookup(layout, weights, bags, INT8, 8), want, "wide int8")


@pytest.mark.parametrize("precision, scale", [(FP16, None), (FP16, 1024.0), (BF16, None)],
                         ids=["fp16", "fp16-scaled", "bf16"])
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_backward_reads_the_wire_as_received(dtype, precision, scale):
    """aggregate_grads (max slots included) and SGD's backward_update on the received
    buffer: the bits NumPy gives on the decoded gradients."""
    layout, bags, weights, grad = wire_case(dtype, 5)
    cdt = compute_dtype(weights.dtype)
    host_wire = Wire(precision, np, cdt, scale=scale)
    recv = host_wire.encode(grad.astype(cdt).reshape(-1)).reshape(grad.shape)
    decoded = host_wire.decode(recv.reshape(-1)).reshape(grad.shape)
    wire = Wire(precision, cp, cdt, scale=scale)
    want = cpu.aggregate_grads(layout, bags, decoded, weights=weights)
    with _On("pocl", 3):
        got = cuda.aggregate_grads(layout, bags, cp.asarray(recv), cp.asarray(weights),
                                   wire=wire)
    for (wr, wg), (gr, gg) in zip(want, got):
        order = np.argsort(wr, kind="stable")
        np.testing.assert_array_equal(cp.asnumpy(gr), wr[order])
        assert_same_bytes(gg, wg[order], "aggregated gradients")
    config = OptimizerConfig(OptimizerKind.SGD, lr=0.05)
    host = FusedTables(layout.rows, layout.dims, config, dtype=dtype)
    dev = FusedTables(layout.rows, layout.dims, config, dtype=dtype, device="cuda")
    host.weights[:] = weights
    dev.weights[:] = cp.asarray(weights)
    with _On("pocl"):
        for _ in range(2):
            host.backward_update(bags, decoded)
            dev.backward_update(bags, cp.asarray(recv), wire=wire)
    assert_same_bytes(dev.weights, host.weights, "weights after two steps")


def test_device_store_lookup_counts_one_kernel_call():
    """FusedTables on the device: the encoded lookup is one kernel call and no Wire.encode."""
    layout, bags, weights, _ = wire_case("float32", 6)
    store = FusedTables(layout.rows, layout.dims, OptimizerConfig(OptimizerKind.SGD, lr=0.1),
                        device="cuda")
    store.weights[:] = cp.asarray(weights)
    wire = Wire(BF16, cp, np.float32)
    calls = []
    encode = Wire.encode
    Wire.encode = lambda self, flat: calls.append(flat.size) or encode(self, flat)
    try:
        with _On("pocl"):
            got = store.lookup(bags, wire=wire)
    finally:
        Wire.encode = encode
    assert store.take_kernel_calls() == 1 and calls == []
    assert_same_bytes(got, _host_encoded(layout, weights, bags, BF16), "bf16 lookup")


# --------------------------------------------------------------------------- Oclgrind

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_oclgrind_finds_no_error_in_the_wire_kernels(dtype):
    """Both int8 reductions (lane groups, whole warp), fp16 and bf16 stores, the scaled fp16
    backward with max slots, on a grid of two blocks."""
    _require_oclgrind()
    kw = dict(batch=4, rows=(9, 5, 3), slot_table=(0, 2, 1), slot_mean=(False, True, False))
    with _On("oclgrind", 2):
        for row, dims in ((4, (8, 36, 4)), (12, (12, 36, 24))):
            layout, bags, weights, _ = wire_case(dtype, 7, dims=dims, **kw)
            wire = Wire(INT8, cp, compute_dtype(weights.dtype), row=row)
            got = cuda.pooled_lookup(layout, cp.asarray(weights), bags, wire=wire)
            assert_same_bytes(got, _host_encoded(layout, weights, bags, INT8, row),
                              f"int8 rows of {row}")
        layout, bags, weights, grad = wire_case(dtype, 8, dims=(33, 8, 1), **kw)
        for precision in (FP16, BF16):
            wire = Wire(precision, cp, dtype)
            got = cuda.pooled_lookup(layout, cp.asarray(weights), bags, wire=wire)
            assert_same_bytes(got, _host_encoded(layout, weights, bags, precision),
                              precision.value)
        host_wire = Wire(FP16, np, dtype, scale=64.0)
        recv = host_wire.encode(grad.reshape(-1)).reshape(grad.shape)
        want = cpu.aggregate_grads(layout, bags, host_wire.decode(recv.reshape(-1)).reshape(
            grad.shape), weights=weights)
        got = cuda.aggregate_grads(layout, bags, cp.asarray(recv), cp.asarray(weights),
                                   wire=Wire(FP16, cp, dtype, scale=64.0))
    for (wr, wg), (gr, gg) in zip(want, got):
        order = np.argsort(wr, kind="stable")
        assert_same_bytes(gg, wg[order], "aggregated gradients")
