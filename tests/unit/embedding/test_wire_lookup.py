"""The NumPy kernels with a communication wire: the lookup writes its rows encoded, the
backward reads received gradients as they are.

``pooled_lookup(..., wire=w)`` must give exactly the bytes of
``w.encode(pooled_lookup(...))`` (fp16 and bf16 rounding, int8 FUSED8BIT rows), and
``aggregate_grads`` / ``backward_update`` with ``wire=w`` on the received buffer exactly
what they give on ``w.decode`` of it, for sum, mean and max pooling, weighted ids, empty
bags, float32, float64 and half tables; the stores that wrap ``FusedTables`` (tiered,
dynamic) take the wire too. The device kernels run the same cases in
``tests/gpu/test_wire_kernels.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables, cpu
from embedding.kernels.dynamic import DynamicTables
from embedding.kernels.tiered import TieredTables
from embedding.precision import compute_dtype
from embedding.sharding.qcomm import CommPrecision, Wire
from embedding.types import Eviction, OptimizerConfig, OptimizerKind, TableMemory, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from gpu_cases import assert_same_bytes, wire_case  # noqa: E402

FP16, BF16, INT8 = CommPrecision.FP16, CommPrecision.BF16, CommPrecision.INT8
TABLE_DTYPES = ("float32", "float64", "float16", "bfloat16")
#: ``(int8 row, table dims)``: every dim a multiple of the row
INT8_CASES = ((4, (16, 64, 1024, 4, 100, 8)), (12, (12, 36, 24, 132, 60, 12)),
              (32, (32, 64, 96, 32, 160, 32)), (48, (48, 96, 144, 48, 48, 96)),
              (3, (3, 9, 33, 6, 3, 12)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("scale", [None, 256.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("precision", [FP16, BF16], ids=lambda p: p.value)
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_lookup_writes_the_half_wire_bytes(dtype, precision, scale, weighted, threads):
    layout, bags, weights, _ = wire_case(dtype, seed=1, weighted=weighted)
    cdt = compute_dtype(weights.dtype)
    wire = Wire(precision, np, cdt, scale=scale)
    want = wire.encode(cpu.pooled_lookup(layout, weights, bags).reshape(-1))
    got = cpu.pooled_lookup(layout, weights, bags, wire=wire, threads=threads)
    assert got.shape == (bags.out_rows, bags.out_dim) and got.dtype == wire.dtype
    assert_same_bytes(got, want, f"{dtype} -> {precision.value}")


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("row, dims", INT8_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_lookup_writes_the_int8_wire_rows(dtype, row, dims, weighted):
    layout, bags, weights, _ = wire_case(dtype, seed=2, dims=dims, weighted=weighted)
    wire = Wire(INT8, np, compute_dtype(weights.dtype), row=row)
    want = wire.encode(cpu.pooled_lookup(layout, weights, bags).reshape(-1))
    got = cpu.pooled_lookup(layout, weights, bags, wire=wire, threads=2)
    assert got.shape == (bags.out_rows, bags.out_dim // row * (row + 8))
    assert got.dtype == np.uint8
    assert_same_bytes(got, want, f"{dtype} -> int8 rows of {row}")


def test_uncovered_columns_are_encoded_zeros():
    """Columns no slot covers come out as the encoding of zeros (all zero bytes)."""
    layout, bags, weights, _ = wire_case("float32", seed=3, rows=(4, 3), dims=(8, 40),
                                         slot_table=(1, 0), slot_mean=(True, False))
    bags = Bags(bags.indices, bags.offsets, bags.slot_table, (0, 48), bags.slot_mean,
                bags.batch_size, 64, bags.num_groups, bags.weights)
    pooled = cpu.pooled_lookup(layout, weights, bags)
    for wire in (Wire(FP16, np, np.float32), Wire(BF16, np, np.float32),
                 Wire(INT8, np, np.float32, row=8)):
        want = wire.encode(pooled.reshape(-1))
        out = np.full(wire.count(bags.out_rows * 64), 0x7F, wire.dtype).reshape(
            bags.out_rows, -1)
        got = cpu.pooled_lookup(layout, weights, bags, out=out, wire=wire)
        assert got is out
        assert_same_bytes(got, want, wire.precision.value)


def test_fp32_wire_changes_nothing():
    layout, bags, weights, _ = wire_case("float32", seed=4)
    plain = cpu.pooled_lookup(layout, weights, bags)
    got = cpu.pooled_lookup(layout, weights, bags, wire=Wire(CommPrecision.FP32, np,
                                                             np.float32))
    assert_same_bytes(got, plain, "fp32")


def test_int8_rows_must_tile_every_slot():
    layout, bags, weights, _ = wire_case("float32", seed=5, dims=(16, 64, 48, 32, 96, 8))
    with pytest.raises(ValueError, match=r"wire.row: int8 rows of 16 values must divide"):
        cpu.pooled_lookup(layout, weights, bags, wire=Wire(INT8, np, np.float32, row=16))
    grad = np.zeros((bags.out_rows, bags.out_dim), np.uint8)
    with pytest.raises(ValueError, match="gradients travel in fp32, fp16 or bf16, not int8"):
        cpu.aggregate_grads(layout, bags, grad, weights=weights,
                            wire=Wire(INT8, np, np.float32, row=8))


@pytest.mark.parametrize("precision, scale", [(FP16, None), (FP16, 1024.0), (BF16, None)],
                         ids=["fp16", "fp16-scaled", "bf16"])
@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_backward_reads_the_wire_as_received(dtype, precision, scale):
    """aggregate_grads and backward_update (every optimizer, two steps) on the received
    buffer: the same bits as on its decoded copy."""
    layout, bags, weights, grad = wire_case(dtype, seed=6)
    cdt = compute_dtype(weights.dtype)
    wire = Wire(precision, np, cdt, scale=scale)
    recv = wire.encode(grad.astype(cdt).reshape(-1)).reshape(grad.shape)
    decoded = wire.decode(recv.reshape(-1)).reshape(grad.shape)
    want = cpu.aggregate_grads(layout, bags, decoded, weights=weights)
    got = cpu.aggregate_grads(layout, bags, recv, weights=weights, wire=wire, threads=2)
    for (wr, wg), (gr, gg) in zip(want, got):
        np.testing.assert_array_equal(gr, wr)
        assert gg.dtype == wg.dtype
        assert_same_bytes(gg, wg, "aggregated gradients")
    config = [OptimizerConfig(k, lr=0.05) for k in
              (OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM) * 2]
    fused, plain = (FusedTables(layout.rows, layout.dims, config, dtype=dtype) for _ in "ab")
    for store in (fused, plain):
        store.weights[:] = weights
    for _ in range(2):
        fused.backward_update(bags, recv, wire=wire)
        plain.backward_update(bags, decoded)
    assert_same_bytes(fused.weights, plain.weights, "weights")
    for name, arr in plain.state.items():
        assert_same_bytes(fused.state[name], arr, f"state {name}")


# --------------------------------------------------------------------------- stores

ROWS, DIMS = (40, 7, 25), (8, 8, 16)


def _bags(rng, batch=5, groups=2):
    slot_table = (0, 1, 2, 0)
    cols = tuple(int(c) for c in np.cumsum([0] + [DIMS[t] for t in slot_table[:-1]]))
    lens = rng.integers(0, 4, groups * len(slot_table) * batch)
    ids = np.concatenate([rng.integers(0, ROWS[slot_table[(i // batch) % 4]], n)
                          for i, n in enumerate(lens)]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Bags(ids, offsets, slot_table, cols, (False, True, False, False), batch,
                sum(DIMS[t] for t in slot_table), groups)


def _stores():
    opt = OptimizerConfig(OptimizerKind.ADAM, lr=0.05)
    memory = [TableMemory(Tier.HOST), TableMemory(Tier.CACHED, cache_rows=4),
              TableMemory(Tier.CACHED, cache_rows=30)]
    return {"fused": FusedTables(ROWS, DIMS, opt),
            "tiered": TieredTables(ROWS, DIMS, opt, memory),
            "dynamic": DynamicTables(ROWS, DIMS, opt, [Eviction.COUNT] * 3)}


@pytest.mark.parametrize("precision", [FP16, BF16, INT8], ids=lambda p: p.value)
def test_every_store_takes_the_wire(precision):
    """Tiered and dynamic stores pass the wire to the tables they wrap: three steps of
    lookup and backward give the bytes and weights of FusedTables with the same wire."""
    rng = np.random.default_rng(8)
    stores = _stores()
    init = [rng.standard_normal((r, d)).astype(np.float32) for r, d in zip(ROWS, DIMS)]
    for store in stores.values():
        ids = [np.arange(r) for r in ROWS]
        if isinstance(store, DynamicTables):
            store.gather(list(enumerate(ids)))  # ids 0..rows-1 take rows 0..rows-1
        for t in range(len(ROWS)):
            store.weight(t)[...] = init[t]
    fwd = Wire(precision, np, np.float32, row=8)
    bwd = Wire(BF16 if precision is INT8 else precision, np, np.float32)
    for step in range(3):
        bags = _bags(rng)
        outs = {}
        for name, store in stores.items():
            outs[name] = store.lookup(bags, wire=fwd)
            grad = np.sin(np.arange(bags.out_rows * bags.out_dim) * (step + 1.0))
            store.backward_update(bags, bwd.encode(grad.astype(np.float32)).reshape(
                bags.out_rows, bags.out_dim), wire=bwd)
        for name in ("tiered", "dynamic"):
            assert_same_bytes(outs[name], outs["fused"], f"{name} lookup, step {step}")
    stores["tiered"].flush()
    for t in range(len(ROWS)):
        for name in ("tiered", "dynamic"):
            assert_same_bytes(np.asarray(stores[name].weight(t)), stores["fused"].weight(t),
                              f"{name} table {t}")


def test_a_store_that_cannot_fuse_encodes_after_the_lookup():
    """A wire whose values are not the tables' compute dtype: the store encodes the pooled
    rows itself (and decodes gradients before its backward), with the same bytes."""
    layout, bags, weights, grad = wire_case("float32", seed=9)
    store = FusedTables(layout.rows, layout.dims, OptimizerConfig(OptimizerKind.SGD, lr=0.1))
    store.weights[:] = weights
    wire = Wire(FP16, np, np.float64)
    assert not store._fuses(wire)
    want = wire.encode(store.lookup(bags).astype(np.float64).reshape(-1))
    assert_same_bytes(store.lookup(bags, wire=wire), want, "encoded after the lookup")
