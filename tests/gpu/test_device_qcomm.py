"""Quantized output dists on device arrays, against the same collection on NumPy.

The pooled output and the shards after an SGD step of a collection with an
fp16, bf16 or int8 forward and an fp16 or bf16 backward: the device run
(CuPy encodes and decodes the wire format, NCCL or the staged backend moves it:
the stand-in when no GPU is here) must agree with the NumPy run of the same
codec to within one rounding of the codec per rank (the two sum the 16-bit
partial results of a row-wise table in other orders), and must send exactly the
bytes the NumPy run sends. A device step encodes pooled rows and decodes their
gradients in the kernels only (no codec pass of its own). The same for data-parallel
tables whose gradient AllReduce travels in fp16 or bf16 (``QComms.dense``): the device
run's replicas stay within the codec's bound of NumPy's, equal on every rank, with the
same (halved) bytes.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

import cupy as cp
from embedding.collection import ShardedEmbeddingCollection
from embedding.sharding.qcomm import QComms
from gpu_cases import load_mpi_tests

pytestmark = pytest.mark.mpi(min_size=1)

S = load_mpi_tests("test_sharding")
sys.modules.setdefault("test_sharding", S)  # test_qcomm imports it by name
Q = load_mpi_tests("test_qcomm")


def _run(world, mix, qcomms, device):
    group = world.world
    tables = Q._tables()
    plan = S.make_plan(tables, mix, group)
    coll = ShardedEmbeddingCollection(tables, plan, group, qcomms=qcomms, device=device)
    xp = cp if device == "cuda" else np
    rng = np.random.default_rng(77)
    for t in tables:
        coll.load_table(t.name, xp.asarray(rng.standard_normal((t.num_rows, t.dim))))
    coll.take_sent()
    bags, _ = S.global_batch(rng, tables, group.size, False)
    grad = rng.standard_normal((S.BATCH * group.size, coll.out_dim))
    out = coll.forward(S.local_kjt(bags, None, group.rank))
    coll.backward(xp.asarray(grad[group.rank * S.BATCH:(group.rank + 1) * S.BATCH]))
    sent = coll.take_sent()
    out = cp.asnumpy(out) if device == "cuda" else out
    return out, {t.name: coll.gather_table(t.name) for t in tables}, sent


@pytest.mark.parametrize("q", [QComms("fp16", "fp16", 1024.0), QComms("bf16", "bf16"),
                               QComms("int8", "bf16")], ids=["fp16", "bf16", "int8+bf16"])
@pytest.mark.parametrize("mix", ["tw", "cw", "rw", "mixed", "cyc"])
def test_device_qcomm_matches_numpy(world, all_ranks, device_backend, mix, q):
    S.skip_if_uneven(mix, world)
    if q.forward.value == "int8" and (mix in Q.REDUCING or Q.int8_row(world, mix) < 3):
        pytest.skip("int8 is refused there (tests/mpi/test_qcomm.py checks the refusal)")
    out_h, w_h, sent_h = _run(world, mix, q, "cpu")
    out_d, w_d, sent_d = _run(world, mix, q, "cuda")
    eps = Q.EPS["bf16" if "bf16" in (q.forward.value, q.backward.value) else "fp16"]
    bound = 2 * world.size * eps * (1 + float(np.abs(out_h).max()))
    err = float(np.max(np.abs(out_d - out_h), initial=0))
    all_ranks(err <= bound, f"{mix}: device forward differs by {err} > {bound}")
    worst = max(float(np.max(np.abs(np.asarray(w_d[t]) - w_h[t]), initial=0)) for t in w_h)
    all_ranks(worst <= bound, f"{mix}: device shards differ by {worst} > {bound}")
    all_ranks(sent_d == sent_h, f"{mix}: device sent {sent_d}, NumPy {sent_h}")
    total = world.comm.allreduce(sent_h["forward"])  # a rank may hold no table of the mix
    all_ranks(total > 0, f"{mix}: nothing was sent")


@pytest.mark.parametrize("q", [QComms(dense="fp16", dense_loss_scale=1024.0),
                               QComms(dense="bf16"), QComms("fp16", "fp16", dense="bf16")],
                         ids=["fp16", "bf16", "fp16+bf16"])
@pytest.mark.parametrize("mix", ["dp", "mixed"])
def test_device_data_parallel_qcomm_matches_numpy(world, all_ranks, device_backend, mix, q):
    _, w32, sent32 = _run(world, mix, None, "cpu")
    _, w_h, sent_h = _run(world, mix, q, "cpu")
    _, w_d, sent_d = _run(world, mix, q, "cuda")
    dp = [tp.table for tp in S.make_plan(Q._tables(), mix, world.world).tables
          if tp.sharding.value == "data_parallel"]
    eps = Q.EPS["bf16" if "bf16" in (q.dense.value, q.backward.value) else "fp16"]
    for name in dp:
        bound = 4 * world.size * eps * (1 + float(np.abs(w32[name]).max()))
        err = float(np.max(np.abs(np.asarray(w_d[name]) - w_h[name]), initial=0))
        all_ranks(err <= bound, f"{mix}: device replica of {name} differs by {err} > {bound}")
        replicas = world.comm.allgather(np.asarray(w_d[name]))
        all_ranks(all(np.array_equal(r, replicas[0]) for r in replicas),
                  f"{mix}: the device replicas of {name} differ")
    all_ranks(sent_d == sent_h, f"{mix}: device sent {sent_d}, NumPy {sent_h}")
    all_ranks(sent32["dense"] > 0 and 2 * sent_h["dense"] == sent32["dense"],
              f"{mix}: data-parallel bytes {sent_h['dense']} vs {sent32['dense']} in fp32")


@pytest.mark.parametrize("q", [QComms("fp16", "bf16"), QComms("int8", "fp16", 1024.0)],
                         ids=["fp16-bf16", "int8-fp16s"])
@pytest.mark.parametrize("mix", ["tw", "cw", "rw", "mixed", "cyc"])
def test_device_step_makes_no_codec_pass(world, all_ranks, device_backend, monkeypatch, mix,
                                         q):
    """On device arrays too, the lookup kernel writes the forward's send buffer and the
    backward kernel reads the received gradients: no ``Wire.encode`` of pooled rows and no
    ``Wire.decode`` of gradients (``tests/mpi/test_qcomm.py`` has the NumPy case)."""
    S.skip_if_uneven(mix, world)
    if q.forward.value == "int8" and (mix in Q.REDUCING or Q.int8_row(world, mix) < 3):
        pytest.skip("int8 is refused there")
    calls = Q._count_codec_calls(monkeypatch)
    _run(world, mix, q, "cuda")
    extra = [c for c in calls if c in (("encode", q.forward.value),
                                       ("decode", q.backward.value))]
    all_ranks(not extra, f"{mix}: passes over pooled rows or gradients: {extra}")
