"""Algorithm selection, the registry, calibration files."""
from __future__ import annotations

import json

import pytest

from collectives import cost, settings
from collectives.algorithms import names, registry
from collectives.fabric import apply_calibration, load_calibration, save_calibration
from collectives.select import SelectionError, explain, select
from collectives.types import CollectiveOp, FabricModel, Request

MiB = 1 << 20


@pytest.fixture
def env(monkeypatch):
    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(f"NEOCOMM_{k}", str(v))
        settings.reload()

    yield set_
    monkeypatch.undo()
    settings.reload()


def test_every_algorithm_is_priced():
    fab = FabricModel(ranks_per_node=2, nodes=2)
    for op, algos in registry().items():
        assert algos, op
        assert cost.candidates(op) == tuple(a.name for a in algos)
        for algo in algos:
            req = Request(op, MiB, 4, fab.size, symmetric=3)
            seconds = cost.algorithm_cost(op, algo.name, req, fab)
            assert seconds == algo.cost(req, fab) and seconds > 0, (op, algo.name)


def test_selects_the_cheapest():
    fab = FabricModel(ranks_per_node=2)
    req = Request(CollectiveOp.ALL_REDUCE, 64 * MiB, 4, 2)
    rows = {n: c for n, c, r in explain(req, fab) if r is None}
    assert select(req, fab).name == min(rows, key=rows.get)


def test_forced_algorithm(env):
    fab = FabricModel(ranks_per_node=4)
    req = Request(CollectiveOp.ALL_TO_ALL, MiB, 4, 4)
    assert select(req, fab, "bruck").name == "bruck"
    env(ALGO_ALL_TO_ALL="pairwise")
    assert select(req, fab).name == "pairwise"


def test_unknown_algorithm_lists_the_known_ones():
    fab = FabricModel(ranks_per_node=2)
    with pytest.raises(SelectionError, match="unknown algorithm 'fastest'.*pairwise"):
        select(Request(CollectiveOp.ALL_TO_ALL, MiB, 4, 2), fab, "fastest")


def test_algorithm_that_cannot_run_says_why():
    fab = FabricModel(ranks_per_node=2)
    with pytest.raises(SelectionError, match="'hierarchical' cannot run.*2 nodes"):
        select(Request(CollectiveOp.ALL_TO_ALL, MiB, 4, 2), fab, "hierarchical")
    with pytest.raises(SelectionError, match="distinct payloads"):
        select(Request(CollectiveOp.ONE_TO_MANY, MiB, 4, 2, identical=False), fab, "chain")


def test_no_candidate_lists_every_reason(monkeypatch):
    import collectives.select as sel
    from collectives.algorithms import lookup

    op = CollectiveOp.ALL_TO_ALL
    only = [lookup(op, "hierarchical"), lookup(CollectiveOp.ALL_GATHER, "doubling")]
    monkeypatch.setattr(sel, "registry", lambda: {op: only})
    sel._CACHE.clear()
    req = Request(op, 3 * MiB + 12, 4, 3)
    with pytest.raises(SelectionError) as info:
        select(req, FabricModel(ranks_per_node=3))
    text = str(info.value)
    assert "no algorithm can run this all_to_all" in text
    assert "hierarchical: needs at least 2 nodes" in text
    assert "doubling: does not implement all_to_all" in text
    sel._CACHE.clear()


def test_rabenseifner_declines_beyond_the_staging_budget(env):
    env(STAGING_BUFFERS="4")
    rows = dict((n, r) for n, _, r in explain(
        Request(CollectiveOp.REDUCE_SCATTER, 1 << 30, 4, 4), FabricModel(ranks_per_node=4)))
    assert "workspace" in rows["rabenseifner"] and rows["ring"] is None


def test_calibration_roundtrip(tmp_path, env):
    path = tmp_path / "cal.json"
    fab = FabricModel(ranks_per_node=2)
    save_calibration(str(path), fab, {"all_reduce/native": 2.5}, "a test")
    data = load_calibration(str(path))
    cal = apply_calibration(fab, data)
    assert cal.factor(CollectiveOp.ALL_REDUCE, "native") == 2.5
    assert cal.factor(CollectiveOp.ALL_REDUCE, "ring") == 1.0
    req = Request(CollectiveOp.ALL_REDUCE, 64 * MiB, 4, 2)
    assert select(req, cal).name != "native"


def test_bad_calibration_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_calibration(str(bad))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "something"}))
    with pytest.raises(ValueError, match="not a neocomm calibration"):
        load_calibration(str(other))


def test_names_are_what_select_accepts_in_tie_break_order():
    """names(op) lists, in tie-break order, exactly the algorithms select() takes by name
    for op: forced, each is selected or declines with the reason explain() gives; a name
    of another op's algorithm is unknown for this one."""
    fab = FabricModel(ranks_per_node=2, nodes=2)
    every = {a.name for algos in registry().values() for a in algos}
    for op in CollectiveOp:
        listed = list(names(op))
        algos = registry()[op]
        assert listed == [a.name for a in sorted(algos, key=lambda a: (a.order, a.name))], op
        req = Request(op, MiB, 4, fab.size, symmetric=3)
        reasons = {n: r for n, _, r in explain(req, fab)}
        assert list(reasons) == listed, op
        for name in listed:
            if reasons[name] is None:
                assert select(req, fab, name).name == name, (op, name)
            else:
                with pytest.raises(SelectionError, match=f"'{name}' cannot run"):
                    select(req, fab, name)
        for name in sorted(every - set(listed)):
            with pytest.raises(SelectionError, match=f"unknown algorithm '{name}'"):
                select(req, fab, name)


def test_size_bucketed_factors():
    fab = FabricModel(ranks_per_node=2, algorithm_factors={
        "all_reduce/native": 2.0, "all_reduce/native@20": 0.5, "all_reduce/native@26": 4.0})
    assert fab.factor(CollectiveOp.ALL_REDUCE, "native") == 2.0
    assert fab.factor(CollectiveOp.ALL_REDUCE, "native", MiB) == 0.5
    assert fab.factor(CollectiveOp.ALL_REDUCE, "native", 64 * MiB) == 4.0
    assert fab.factor(CollectiveOp.ALL_REDUCE, "native", 8 * MiB) == 0.5  # nearest: 2^20
    assert fab.factor(CollectiveOp.ALL_REDUCE, "ring", MiB) == 1.0
    small = select(Request(CollectiveOp.ALL_REDUCE, MiB, 4, 2), fab)
    large = select(Request(CollectiveOp.ALL_REDUCE, 64 * MiB, 4, 2), fab)
    assert small.name == "native" and large.name != "native"
