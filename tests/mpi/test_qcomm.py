"""Quantized output dists against the same collection in float32.

For every sharding mix of ``test_sharding``: the pooled output with an
fp16, bf16 or int8 forward, and the shard weights after an SGD step with an
fp16 or bf16 backward, stay within the codec's error bound of the float32
run; the bytes counted in each direction are those of the wire format
(half of float32's for fp16 and bf16). Device arrays run the same cases in
``tests/gpu/test_device_qcomm.py``.

    mpirun -n 2 python scripts/mpi_pytest.py tests/mpi/test_qcomm.py
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.kernels import FusedTables
from embedding.sharding.qcomm import QComms, Wire
from embedding.types import OptimizerConfig, OptimizerKind
from neocomm.errors import CollectiveArgumentError
from test_sharding import BATCH, global_batch, local_kjt, make_plan, make_tables, skip_if_uneven

pytestmark = pytest.mark.layouts("1x2", "1x3", "2x2", why=(
    "the codecs act where a dist exchanges: a power of two, uneven shards of three, and the "
    "shardings between nodes (one rank exchanges nothing; four adds no case)"))

MIXES = ["tw", "rw", "cw", "twrw", "twcw", "mixed", "mixed_hier", "cyc"]
REDUCING = {"rw", "twrw", "mixed", "mixed_hier", "cyc"}  # a row-wise kind among the tables
#: unit roundoff of each 16-bit format
EPS = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def _tables():
    """test_sharding's tables in float32 with SGD, dims whose column slices share a width
    of 4 (int8 rows of 4 values)."""
    sgd = OptimizerConfig(OptimizerKind.SGD, lr=0.1)
    return [dataclasses.replace(t, dtype="float32", optimizer=sgd, dim=d)
            for t, d in zip(make_tables(OptimizerKind.SGD), (12, 24, 12, 24))]


def run(world, mix, qcomms=None, *, dedup=False, steps=1, grad_scale=1.0, tables=None):
    """``(outputs per step, {table: weights after the steps}, bytes sent per direction)``."""
    group = world.world
    tables = _tables() if tables is None else tables
    plan = make_plan(tables, mix, group)
    coll = ShardedEmbeddingCollection(tables, plan, group, dedup=dedup, qcomms=qcomms)
    rng = np.random.default_rng(77)
    for t in tables:
        coll.load_table(t.name, rng.standard_normal((t.num_rows, t.dim)))
    outs = []
    coll.take_sent()
    for _ in range(steps):
        bags, _ = global_batch(rng, tables, group.size, False)
        grad = rng.standard_normal((BATCH * group.size, coll.out_dim)) * grad_scale
        outs.append(coll.forward(local_kjt(bags, None, group.rank)))
        coll.backward(grad[group.rank * BATCH:(group.rank + 1) * BATCH])
    sent = coll.take_sent()
    weights = {t.name: coll.gather_table(t.name) for t in tables}
    return outs, weights, sent


def int8_row(world, mix) -> int:
    """The width of an int8 row: the gcd of the tables' dims and their shards' widths."""
    plan = make_plan(_tables(), mix, world.world)
    return math.gcd(*[t.dim for t in _tables()],
                    *[s.num_cols for tp in plan.tables for s in tp.shards])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("mix", MIXES)
def test_forward_within_the_codec_bound(world, all_ranks, mix, precision):
    skip_if_uneven(mix, world)
    if precision == "int8" and mix in REDUCING:
        pytest.skip("int8 is refused by a reducing output dist (test_int8_refused_...)")
    if precision == "int8" and int8_row(world, mix) < 3:
        with pytest.raises(ValueError, match="int8 needs a common width of at least 3"):
            run(world, mix, QComms(forward=precision))
        return
    (want,), _, sent32 = run(world, mix)
    (got,), _, sent = run(world, mix, QComms(forward=precision))
    err = float(np.max(np.abs(got - want), initial=0))
    if precision == "int8":  # half a step of a row's range, rows within one feature
        bound = (float(want.max()) - float(want.min())) / 510 * 1.001 + 1e-6
    else:  # each partial sum rounded, then each addition (at most one per rank)
        bound = 2 * world.size * EPS[precision] * (1 + float(np.abs(want).max()))
    all_ranks(err <= bound, f"{mix}/{precision}: forward differs by {err} > {bound}")
    all_ranks(err > 0 or not sent32["forward"], f"{mix}/{precision}: nothing was rounded")
    if precision != "int8":
        all_ranks(2 * sent["forward"] == sent32["forward"],
                  f"{mix}/{precision}: sent {sent['forward']} bytes vs {sent32['forward']} "
                  f"in fp32")
    else:
        # rows of g values: g codes + 8 bytes of scale and bias for 4 g bytes in fp32
        g = int8_row(world, mix)
        all_ranks(4 * g * sent["forward"] == (g + 8) * sent32["forward"],
                  f"{mix}/int8: sent {sent['forward']} vs {sent32['forward']} in fp32")
    all_ranks(sent["backward"] == sent32["backward"], "the backward stayed fp32")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("scale", [None, 1024.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("mix", MIXES)
def test_backward_within_the_codec_bound(world, all_ranks, mix, precision, scale):
    skip_if_uneven(mix, world)
    if scale is not None and precision != "fp16":
        pytest.skip("a loss scale goes with fp16")
    q = QComms(backward=precision, backward_loss_scale=scale)
    _, w0, _ = run(world, mix, steps=0)
    _, want, sent32 = run(world, mix, steps=2)
    _, got, sent = run(world, mix, q, steps=2)
    for name in want:
        step = float(np.abs(want[name] - w0[name]).max())
        err = float(np.abs(got[name] - want[name]).max())
        bound = 8 * world.size * EPS[precision] * step + 1e-6
        all_ranks(err <= bound, f"{mix}/{precision}: table {name} differs by {err} > {bound}")
    all_ranks(2 * sent["backward"] == sent32["backward"],
              f"{mix}/{precision}: sent {sent['backward']} gradient bytes vs "
              f"{sent32['backward']} in fp32")


def _count_codec_calls(monkeypatch) -> list:
    """Record ``(method, precision)`` of every ``Wire.encode``/``decode`` of a non-empty
    buffer from now on."""
    calls = []
    encode, decode = Wire.encode, Wire.decode

    def counted_encode(self, flat):
        if flat.size:
            calls.append(("encode", self.precision.value))
        return encode(self, flat)

    def counted_decode(self, buf):
        if buf.size:
            calls.append(("decode", self.precision.value))
        return decode(self, buf)

    monkeypatch.setattr(Wire, "encode", counted_encode)
    monkeypatch.setattr(Wire, "decode", counted_decode)
    return calls


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("q", [QComms("fp16", "bf16"), QComms("bf16", "fp16", 1024.0),
                               QComms("int8", "bf16")], ids=["fp16-bf16", "bf16-fp16s",
                                                             "int8-bf16"])
@pytest.mark.parametrize("mix", MIXES)
def test_the_kernels_encode_and_decode(world, all_ranks, monkeypatch, mix, q):
    """A trained step makes no pass of its own over pooled rows or their gradients: the
    lookup kernel writes the send buffer in the forward's wire format and the backward
    kernel reads the received gradients in theirs (the two directions use different
    precisions, so each call names its direction). Only the receiving side of the forward
    (pooled rows for the dense model) and the sending side of the backward (the dense
    model's gradients) use the codec. The bytes sent, the outputs and the weights are those
    of encoding after the lookup and decoding before the backward, bit for bit."""
    skip_if_uneven(mix, world)
    fwd, bwd = q.forward.value, q.backward.value
    if fwd == "int8" and (mix in REDUCING or int8_row(world, mix) < 3):
        pytest.skip("int8 is refused there")
    calls = _count_codec_calls(monkeypatch)
    outs, weights, sent = run(world, mix, q, steps=2)
    extra = [c for c in calls if c in (("encode", fwd), ("decode", bwd))]
    all_ranks(not extra, f"{mix}: passes over pooled rows or gradients: {extra}")
    # the control: stores that do not fuse encode after the lookup, decode before the update
    monkeypatch.setattr(FusedTables, "_fuses", lambda self, wire: False)
    calls.clear()
    outs2, weights2, sent2 = run(world, mix, q, steps=2)
    passes = world.comm.allreduce(sum(c in (("encode", fwd), ("decode", bwd)) for c in calls))
    all_ranks(passes > 0, f"{mix}: the control made no pass")
    all_ranks(sent == sent2, f"{mix}: sent {sent} vs {sent2}")
    all_ranks(all(np.array_equal(a, b) for a, b in zip(outs, outs2)), f"{mix}: outputs differ")
    all_ranks(all(np.array_equal(weights[t], weights2[t]) for t in weights),
              f"{mix}: weights differ")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("q", [QComms("fp16", "bf16"), QComms("int8", "fp16")],
                         ids=["fp16-bf16", "int8-fp16"])
def test_dedup_quantized(world, all_ranks, q):
    (want,), w32, _ = run(world, "tw", dedup=True)
    (got,), w, _ = run(world, "tw", q, dedup=True)
    err = float(np.max(np.abs(got - want), initial=0))
    all_ranks(0 < err < 0.05 * (1 + float(np.abs(want).max())), f"dedup forward: {err}")


@pytest.mark.mpi(min_size=1)
def test_per_table_override(world, all_ranks):
    tables = _tables()
    (want,), _, _ = run(world, "tw")
    (got,), _, _ = run(world, "tw", {tables[1].name: QComms(forward="fp16")})
    t1 = tables[1]
    col = sum(t.dim * len(t.features) for t in tables[:1])
    inside = slice(col, col + t1.dim * len(t1.features))
    all_ranks(np.array_equal(np.delete(got, np.r_[inside], axis=1),
                             np.delete(want, np.r_[inside], axis=1)), "fp32 tables changed")
    err = float(np.abs(got[:, inside] - want[:, inside]).max())
    all_ranks(0 < err <= 2 * EPS["fp16"] * (1 + float(np.abs(want).max())), f"t1: {err}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["rw", "twrw", "cyc"])
def test_int8_refused_by_a_reduce_scatter(world, all_ranks, mix):
    skip_if_uneven(mix, world)
    with pytest.raises(ValueError) as info:
        run(world, mix, QComms(forward="int8"))
    msg = str(info.value)
    all_ranks("qcomms.forward" in msg and "'t0'" in msg and "'int8'" in msg
              and "fp32, fp16, bf16" in msg, msg)


@pytest.mark.mpi(min_size=1)
def test_int8_refused_on_narrow_rows(world, all_ranks):
    tables = [dataclasses.replace(t, dim=d) for t, d in zip(_tables(), (4, 6, 8, 5))]
    with pytest.raises(ValueError) as info:
        run(world, "tw", QComms(forward="int8"), tables=tables)
    msg = str(info.value)
    all_ranks("qcomms.forward" in msg and "1 value(s) wide" in msg and "'t1'" in msg, msg)


@pytest.mark.mpi(min_size=1)
def test_loss_scale_overflow_fails_every_rank(world, all_ranks):
    q = QComms(backward="fp16", backward_loss_scale=4096.0)
    grad_scale = 100.0 if world.rank == 0 else 1.0  # only rank 0's gradients overflow
    with pytest.raises(CollectiveArgumentError) as info:
        run(world, "tw", q, grad_scale=grad_scale)
    msg = str(info.value)
    all_ranks("backward_loss_scale" in msg and "4096" in msg and "65504" in msg, msg)


def test_qcomms_arguments_are_checked():
    with pytest.raises(ValueError, match=r"backward: 'int8' codes pooled rows only.*"
                                         r"fp32, fp16, bf16"):
        QComms(backward="int8")
    with pytest.raises(ValueError, match=r"forward: expected one of .*got 'fp8'"):
        QComms(forward="fp8")
    with pytest.raises(ValueError, match=r"backward_loss_scale: 512 scales an fp16 exchange "
                                         r"only; backward is 'bf16'"):
        QComms(backward="bf16", backward_loss_scale=512)
    with pytest.raises(ValueError, match=r"backward_loss_scale: expected a finite number > 0, "
                                         r"got -1"):
        QComms(backward="fp16", backward_loss_scale=-1)
