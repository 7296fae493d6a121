"""Sharded embeddings against a single-process float64 dense reference.

Every strategy and mixes of them, for SGD, row-wise AdaGrad and Adam, with
heavy duplicate ids, empty bags, mean pooling, shared tables and per-id
weights: the pooled output of every rank's batch and the weights (and
optimizer state) of every local shard after two steps must equal the dense
reference. Runs at any world size and node layout:

    mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_sharding.py
    NEOCOMM_RANKS_PER_NODE=2 mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_sharding.py
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.sharding import table_wise
from embedding.jagged import KeyedJagged
from embedding.kernels.reference import bag_grads, pool_bags
from embedding.optim import dense_reference_update, state_specs
from embedding.types import (CachePolicy, OptimizerConfig, OptimizerKind, Pooling, Shard,
                             ShardingPlan, ShardingType, TableConfig, TableMemory, TablePlan,
                             Tier, cyclic_shards)

ST = ShardingType
BATCH = 5
RTOL = 1e-10


POOLS = (Pooling.SUM, Pooling.MEAN, Pooling.SUM, Pooling.MEAN)

pytestmark = pytest.mark.layouts("all", why=(
    "every sharding splits tables, rows and columns by the rank count and the nodes (table-"
    "row-wise needs nodes)"))
#: Max pooling on every table whose sharding can pool by max (t1 is row-wise in "mixed").
MAX_POOLS = (Pooling.MAX, Pooling.MEAN, Pooling.MAX, Pooling.MAX)


def make_tables(kind: OptimizerKind, pools=POOLS) -> list[TableConfig]:
    opt = OptimizerConfig(kind, lr=0.05 if kind is not OptimizerKind.SGD else 0.1)
    return [
        TableConfig("t0", 37, 4, pools[0], ("f0", "f0b"), "float64", opt),
        TableConfig("t1", 23, 6, pools[1], ("f1",), "float64", opt),
        TableConfig("t2", 41, 8, pools[2], ("f2",), "float64", opt),
        TableConfig("t3", 11, 5, pools[3], ("f3", "f3b"), "float64", opt),
    ]


# -- plans -----------------------------------------------------------------------
def _cuts(n: int, parts: int, uneven: bool) -> list[int]:
    if not uneven:
        return [int(x) for x in np.linspace(0, n, parts + 1).round()]
    w = np.arange(1, parts + 1, dtype=float)  # block k gets a share ~ k+1
    return [0] + [int(x) for x in np.cumsum(w / w.sum() * n).round()]


def _col_cuts(dim: int, parts: int) -> list[int]:
    """Uneven column slices, each at least one column wide."""
    extra = _cuts(dim - parts, parts, True)
    return [extra[k] + k for k in range(parts + 1)]


def table_plan(t: TableConfig, i: int, st: ST, size: int, nodes, uneven=False) -> TablePlan:
    if st is ST.TABLE_WISE:
        return TablePlan(t.name, st, (Shard((i * 2 + 1) % size, 0, t.num_rows, 0, t.dim),))
    if st is ST.DATA_PARALLEL:
        return TablePlan(t.name, st, tuple(Shard(r, 0, t.num_rows, 0, t.dim)
                                           for r in range(size)))
    if st is ST.ROW_WISE:
        c = _cuts(t.num_rows, size, uneven)
        order = list(range(size))[::-1] if i % 2 else list(range(size))
        return TablePlan(t.name, st, tuple(Shard(order[k], c[k], c[k + 1] - c[k], 0, t.dim)
                                           for k in range(size)))
    if st is ST.CYCLIC_ROW_WISE:
        return TablePlan(t.name, st, cyclic_shards(t.num_rows, t.dim, size))
    if st is ST.COLUMN_WISE:
        parts = min(3, t.dim)
        c = _col_cuts(t.dim, parts) if uneven else _cuts(t.dim, parts, False)
        return TablePlan(t.name, st, tuple(Shard((i + k) % size, 0, t.num_rows, c[k],
                                                 c[k + 1] - c[k]) for k in range(parts)))
    node = nodes[i % len(nodes)]
    if st is ST.TABLE_ROW_WISE:
        c = _cuts(t.num_rows, len(node), uneven or i % 2 == 1)
        return TablePlan(t.name, st, tuple(Shard(node[k], c[k], c[k + 1] - c[k], 0, t.dim)
                                           for k in range(len(node))))
    if st is ST.TABLE_COLUMN_WISE:
        parts = min(len(node) + 1, t.dim)
        c = _col_cuts(t.dim, parts)
        return TablePlan(t.name, st, tuple(Shard(node[k % len(node)], 0, t.num_rows, c[k],
                                                 c[k + 1] - c[k]) for k in range(parts)))
    raise AssertionError(st)


MIXES = {
    "tw": [ST.TABLE_WISE] * 4,
    "rw": [ST.ROW_WISE] * 4,
    "rw_uneven": [ST.ROW_WISE] * 4,
    "cw": [ST.COLUMN_WISE] * 4,
    "dp": [ST.DATA_PARALLEL] * 4,
    "twrw": [ST.TABLE_ROW_WISE] * 4,
    "twcw": [ST.TABLE_COLUMN_WISE] * 4,
    "mixed": [ST.TABLE_WISE, ST.ROW_WISE, ST.COLUMN_WISE, ST.DATA_PARALLEL],
    "mixed_hier": [ST.TABLE_ROW_WISE, ST.TABLE_COLUMN_WISE, ST.ROW_WISE, ST.TABLE_WISE],
    "cyc": [ST.CYCLIC_ROW_WISE] * 4,
    "mixed_cyc": [ST.CYCLIC_ROW_WISE, ST.ROW_WISE, ST.TABLE_WISE, ST.CYCLIC_ROW_WISE],
}


def make_plan(tables, mix: str, group) -> ShardingPlan:
    nodes = [tuple(n) for n in group.nodes]
    kinds = MIXES[mix]
    uneven = mix.endswith("uneven")
    plans = tuple(table_plan(t, i, kinds[i], group.size, nodes, uneven)
                  for i, t in enumerate(tables))
    return ShardingPlan(group.size, len(nodes[0]), plans)


def tiered_plan(plan: ShardingPlan, tables, cache, policy=CachePolicy.LRU) -> ShardingPlan:
    """Even tables cached (``cache``: rows, or "all"), odd ones host; data-parallel stays."""
    out = []
    for i, (tp, t) in enumerate(zip(plan.tables, tables)):
        if tp.sharding is ShardingType.DATA_PARALLEL:
            out.append(tp)
            continue
        if i % 2:
            mem = TableMemory(Tier.HOST)
        else:
            rows = t.num_rows if cache == "all" else cache
            mem = TableMemory(Tier.CACHED, rows, policy, admit_after=1 + i // 2)
        out.append(dataclasses.replace(tp, memory=mem))
    return dataclasses.replace(plan, tables=tuple(out))


# -- data and reference ------------------------------------------------------------
def global_batch(rng, tables, size: int, weighted: bool):
    """Bags of every feature for all ranks' samples: many duplicates, some empty bags."""
    bags, weights = {}, {}
    for t in tables:
        hot = rng.integers(0, t.num_rows, 3)
        for f in t.features:
            fb, fw = [], []
            for _ in range(BATCH * size):
                n = int(rng.integers(0, 6))
                ids = np.where(rng.random(n) < 0.6, rng.choice(hot, n),
                               rng.integers(0, t.num_rows, n))
                fb.append([int(x) for x in ids])
                fw.append([float(x) for x in rng.uniform(0.5, 1.5, n)])
            bags[f] = fb
            weights[f] = fw
    return bags, (weights if weighted else None)


def local_kjt(bags, weights, rank: int) -> KeyedJagged:
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return KeyedJagged.from_lists({f: b[sl] for f, b in bags.items()},
                                  None if weights is None else
                                  {f: w[sl] for f, w in weights.items()})


class Reference:
    """Dense float64 tables and optimizer state, stepped with plain loops."""

    def __init__(self, tables, rng):
        self.tables = tables
        self.w = {t.name: rng.standard_normal((t.num_rows, t.dim)) for t in tables}
        self.state = {}
        for t in tables:
            st = {}
            for spec in state_specs(t.optimizer.kind):
                shape = (t.num_rows,) if spec.per_row else (t.num_rows, t.dim)
                st[spec.name] = np.zeros(shape, spec.dtype or np.float64)
            self.state[t.name] = st

    def forward(self, bags, weights):
        return np.concatenate([pool_bags(self.w[t.name], bags[f], t.pooling,
                                         None if weights is None else weights[f])
                               for t in self.tables for f in t.features], axis=1)

    def step(self, bags, weights, grad):
        col = 0
        for t in self.tables:
            dense = np.zeros((t.num_rows, t.dim))
            touched = np.zeros(t.num_rows, bool)
            for f in t.features:
                d, tt = bag_grads(t.num_rows, bags[f], grad[:, col:col + t.dim], t.pooling,
                                  None if weights is None else weights[f], self.w[t.name])
                dense += d
                touched |= tt
                col += t.dim
            dense_reference_update(t.optimizer, self.w[t.name], self.state[t.name], dense,
                                   touched)


def compare_shards(coll, ref, all_ranks, what: str, rtol: float = RTOL):
    worst = 0.0
    for s in coll.local_shards():
        sh = s.shard
        rows, cols = sh.row_slice, sh.col_slice
        expect = ref.w[s.table][rows, cols]
        worst = max(worst, float(np.max(np.abs(s.weight - expect) / (1 + np.abs(expect)),
                                        initial=0)))
        table = next(t for t in ref.tables if t.name == s.table)
        for spec in state_specs(table.optimizer.kind):
            got = s.tables.state_view(s.index, spec.name)
            exp = ref.state[s.table][spec.name][rows]
            if not spec.per_row:
                exp = exp[:, cols]
            worst = max(worst, float(np.max(np.abs(got - exp) / (1 + np.abs(exp)), initial=0)))
    all_ranks(worst < rtol, f"{what}: shard weights/state differ from the reference by {worst}")


def run_steps(world, all_ranks, mix, kind, *, weighted=False, dedup=False, steps=2,
              pipelined=False, dtype=None, rtol=RTOL, pools=POOLS, tables=None, plan=None):
    """Steps of the sharded collection against :class:`Reference`; the collection."""
    group = world.world
    tables = tables or make_tables(kind, pools)
    plan = plan or make_plan(tables, mix, group)
    coll = ShardedEmbeddingCollection(tables, plan, group, dedup=dedup, dtype=dtype)
    rng = np.random.default_rng(1234)
    ref = Reference(tables, rng)
    for t in tables:
        coll.load_table(t.name, ref.w[t.name])
    batches = [global_batch(rng, tables, group.size, weighted) for _ in range(steps)]
    grads = [rng.standard_normal((BATCH * group.size, coll.out_dim)) for _ in range(steps)]
    sl = slice(group.rank * BATCH, (group.rank + 1) * BATCH)
    nxt = coll.input_dist(local_kjt(*batches[0], group.rank)) if pipelined else None
    for i, ((bags, weights), grad) in enumerate(zip(batches, grads)):
        expect = ref.forward(bags, weights)[sl]
        if pipelined:
            out, ctx = coll.forward_with_context(nxt)
            if i + 1 < steps:  # start the next batch's input dist before this backward
                nxt = coll.input_dist(local_kjt(*batches[i + 1], group.rank))
                if i % 2:
                    nxt.wait()  # completing it early must not change anything
        else:
            out = coll.forward(local_kjt(bags, weights, group.rank))
            ctx = None
        err = float(np.max(np.abs(out - expect) / (1 + np.abs(expect)), initial=0))
        all_ranks(out.shape == expect.shape and err < rtol,
                  f"{mix}/{kind.value} step {i}: forward differs by {err}")
        coll.backward(grad[sl], ctx)
        ref.step(bags, weights, grad)
    compare_shards(coll, ref, all_ranks, f"{mix}/{kind.value}", rtol)
    return coll


def latin_cases(first, second, rotated) -> list[tuple]:
    """Cases meeting every pair of three factors in ``len(first) * len(second)`` runs:
    each of ``first`` with each of ``second``, ``rotated`` turning one step per row and
    column (a Latin square), so each of ``first`` and of ``second`` also meets each of
    ``rotated`` when it is no longer than ``second`` and ``first``."""
    return [(a, b, rotated[(i + j) % len(rotated)]) for i, a in enumerate(first)
            for j, b in enumerate(second)]


def assert_every_pair(cases, *factors) -> None:
    """Every pair of ``factors``' values meets in one of ``cases`` (tuples in their order)."""
    for a in range(len(factors)):
        for b in range(a + 1, len(factors)):
            assert {(c[a], c[b]) for c in cases} == \
                {(x, y) for x in factors[a] for y in factors[b]}, (a, b)


def skip_if_uneven(mix: str, world) -> None:
    """Skip a table-row-wise mix on nodes of different sizes (it needs equal nodes)."""
    if ("twrw" in mix or mix == "mixed_hier") and not world.uniform:
        pytest.skip("table_row_wise needs the same number of ranks on every node")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix", list(MIXES))
def test_matches_dense_reference(world, all_ranks, mix, kind):
    skip_if_uneven(mix, world)
    run_steps(world, all_ranks, mix, kind)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("mix", ["tw", "cw"])
def test_equal_tables_dealt_in_turn(world, all_ranks, mix, kind, monkeypatch):
    """Equal tables placed in turn (table-wise) or cut into equal slices, one a rank
    (column-wise): the output is the owners' chunks dealt in turn, reassembled in one copy
    (``dealt_chunk``), and matches the reference as the column-by-column copies do. The
    backward reorders the gradient a band of rows at a time: here one row (SGD) or two of
    the five (the last band one row)."""
    size = world.world.size
    opt = OptimizerConfig(kind, lr=0.1)
    dim = 6 if mix == "tw" else 2 * size
    row_bytes = 2 * size * dim * 8
    monkeypatch.setattr(table_wise, "HOST_BAND_BYTES",
                        1 if kind is OptimizerKind.SGD else 2 * row_bytes)
    tables = [TableConfig(f"t{i}", 19 + i, dim, Pooling.SUM, (f"f{i}",), "float64", opt)
              for i in range(2 * size)]
    if mix == "tw":
        plans = [TablePlan(t.name, ST.TABLE_WISE, (Shard(i % size, 0, t.num_rows, 0, dim),))
                 for i, t in enumerate(tables)]
    else:
        plans = [TablePlan(t.name, ST.COLUMN_WISE, tuple(Shard(k, 0, t.num_rows, 2 * k, 2)
                                                         for k in range(size)))
                 for t in tables]
    plan = ShardingPlan(size, len(world.world.nodes[0]), tuple(plans))
    coll = run_steps(world, all_ranks, mix, kind, weighted=True, steps=3, tables=tables,
                     plan=plan)
    chunks = [getattr(s, "_dealt", None) for s in coll.strategies]
    # one rank holds every chunk of a row: one chunk, the whole row
    want = 2 * dim if size == 1 else (6 if mix == "tw" else 2)
    all_ranks(chunks == [want],
              f"{mix}: the output was not reassembled in one copy ({chunks})")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["tw", "rw", "cw", "dp", "twcw", "mixed", "cyc"])
def test_per_id_weights(world, all_ranks, mix):
    run_steps(world, all_ranks, mix, OptimizerKind.ROWWISE_ADAGRAD, weighted=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix", ["tw", "cw", "twcw", "mixed"])
def test_dedup_matches_reference(world, all_ranks, mix, kind):
    run_steps(world, all_ranks, mix, kind, dedup=True, weighted=mix == "mixed")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix, dedup", [("tw", False), ("cw", False), ("dp", False),
                                        ("twcw", False), ("mixed", False), ("tw", True),
                                        ("mixed", True)])
def test_max_pooling_matches_reference(world, all_ranks, mix, dedup, kind):
    """Max pooling (weighted: the maximum of weight x row) beside sum and mean features."""
    run_steps(world, all_ranks, mix, kind, weighted=True, dedup=dedup, pools=MAX_POOLS,
              steps=3, pipelined=mix == "mixed")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["rw", "twrw", "cyc"])
def test_row_wise_refuses_max_pooling(world, all_ranks, mix):
    skip_if_uneven(mix, world)
    tables = make_tables(OptimizerKind.SGD, MAX_POOLS)
    plan = make_plan(tables, mix, world.world)
    with pytest.raises(ValueError) as info:
        ShardedEmbeddingCollection(tables, plan, world.world)
    all_ranks(f"sharding of table 't0': {MIXES[mix][0].value} adds partial pools across ranks "
              "and cannot pool by max" in str(info.value), str(info.value))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["mixed", "mixed_hier", "mixed_cyc"])
def test_pipelined_input_dist(world, all_ranks, mix):
    """input_dist of batch i+1 started before the backward of batch i gives the same result."""
    skip_if_uneven(mix, world)
    run_steps(world, all_ranks, mix, OptimizerKind.ADAM, steps=3, pipelined=True)


@pytest.mark.mpi(min_size=3)
def test_table_row_wise_rejects_uneven_nodes(world, all_ranks):
    """On a group whose nodes differ in size, table_row_wise raises on every member."""
    first = [r for r in range(world.size) if world.node_of(r) == 0]
    if world.num_nodes < 2 or len(first) < 2:
        pytest.skip("needs emulated nodes of 2+ ranks (NEOCOMM_RANKS_PER_NODE=2)")
    ranks = first + [r for r in range(world.size) if world.node_of(r) == 1][:len(first) - 1]
    sub = world.world.split(ranks)
    raised = True
    if sub is not None:
        tables = make_tables(OptimizerKind.SGD)
        try:
            ShardedEmbeddingCollection(tables, make_plan(tables, "twrw", sub), sub)
            raised = False
        except ValueError as exc:
            raised = "same number of ranks" in str(exc)
    all_ranks(raised, "table_row_wise on uneven nodes must raise ValueError")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
def test_float32_tables_track_the_reference(world, all_ranks, kind):
    mix = "mixed_hier" if world.uniform else "mixed"
    run_steps(world, all_ranks, mix, kind, dtype="float32", rtol=1e-4, weighted=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
def test_cyclic_row_wise_matches_table_wise(world, all_ranks, kind):
    """The same tables cyclic row-wise and table-wise, fed the same weighted batches: the
    pooled output of every step, and the tables and optimizer state after several steps,
    agree with each other and with the dense reference."""
    group = world.world
    tables = make_tables(kind)
    colls = {mix: ShardedEmbeddingCollection(tables, make_plan(tables, mix, group), group)
             for mix in ("cyc", "tw")}
    rng = np.random.default_rng(4321)
    ref = Reference(tables, rng)
    for coll in colls.values():
        for t in tables:
            coll.load_table(t.name, ref.w[t.name])
    sl = slice(group.rank * BATCH, (group.rank + 1) * BATCH)
    for i in range(4):
        bags, weights = global_batch(rng, tables, group.size, weighted=True)
        grad = rng.standard_normal((BATCH * group.size, colls["tw"].out_dim))
        expect = ref.forward(bags, weights)[sl]
        out = {mix: coll.forward(local_kjt(bags, weights, group.rank))
               for mix, coll in colls.items()}
        err = max(float(np.max(np.abs(o - expect) / (1 + np.abs(expect)), initial=0))
                  for o in out.values())
        gap = float(np.max(np.abs(out["cyc"] - out["tw"]), initial=0))
        all_ranks(err < RTOL and gap < RTOL, f"{kind.value} step {i}: forward off the "
                  f"reference by {err}, cyclic vs table-wise by {gap}")
        for coll in colls.values():
            coll.backward(grad[sl])
        ref.step(bags, weights, grad)
    for mix, coll in colls.items():
        compare_shards(coll, ref, all_ranks, f"{mix}/{kind.value}")
    for t in tables:
        a, b = colls["cyc"].gather_table(t.name), colls["tw"].gather_table(t.name)
        gap = float(np.max(np.abs(a - b), initial=0))
        all_ranks(gap < RTOL, f"table {t.name}: cyclic and table-wise differ by {gap}")


@pytest.mark.mpi(min_size=1)
def test_initial_weights_do_not_depend_on_the_plan(world, all_ranks):
    """init_weights hashes the table element, so cyclic, row-wise, table-wise and mixed
    plans start from the very same tables."""
    group = world.world
    tables = make_tables(OptimizerKind.ADAM, POOLS)
    got = {}
    for mix in ("tw", "rw_uneven", "cyc", "mixed_cyc", "cw"):
        coll = ShardedEmbeddingCollection(tables, make_plan(tables, mix, group), group, seed=7)
        got[mix] = [coll.gather_table(t.name) for t in tables]
    same = all(np.array_equal(a, b) for mix in got for a, b in zip(got[mix], got["tw"]))
    all_ranks(same, "initial tables differ between plans")
