"""An algorithm is one module: a module dropped into the package is found, priced,
ordered and selected (or declined, with its reason) with nothing else edited."""
from __future__ import annotations

import sys
import textwrap

import pytest

import collectives.algorithms as algorithms
from collectives import cost
from collectives.select import SelectionError, explain, select
from collectives.types import CollectiveOp, FabricModel, Request

MiB = 1 << 20
OP = CollectiveOp.ALL_REDUCE

_TEMPLATE = '''
"""A test plug-in: AllReduce in a fixed time, on one node only."""
from collectives.algorithms import Algorithm
from collectives.types import CollectiveOp


class Teleport(Algorithm):
    name = "teleport"
    ops = frozenset({{CollectiveOp.ALL_REDUCE}})
    order = {order}

    def shape_reason(self, op, fabric, group_size=None):
        if fabric.nodes > 1:
            return "teleports within one node only"
        return None

    def formula(self, request, fabric):
        return {seconds!r}

    def run(self, call):
        call.recvbuf[...] = call.sendbuf
        yield from ()


ALGORITHMS = (Teleport(),)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``plugin(module_name, text)`` writes a module into an extra directory of the
    algorithms package; the registry is rediscovered, and restored afterwards."""
    names = []

    def add(module_name: str, text: str) -> None:
        (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(text))
        names.append(f"collectives.algorithms.{module_name}")
        sys.modules.pop(names[-1], None)  # a rewritten module is imported afresh
        algorithms.refresh()

    monkeypatch.setattr(algorithms, "__path__", [*algorithms.__path__, str(tmp_path)])
    yield add
    monkeypatch.undo()
    for name in names:
        sys.modules.pop(name, None)
    algorithms.refresh()


def teleport(seconds: float, order: int = 15) -> str:
    return _TEMPLATE.format(seconds=seconds, order=order)


def test_a_new_module_is_selected_when_it_is_cheapest(plugin):
    fab = FabricModel(ranks_per_node=4)
    req = Request(OP, 64 * MiB, 4, 4)
    before = select(req, fab)
    assert before.name != "teleport" and "teleport" not in cost.candidates(OP)

    plugin("teleport_fast", teleport(1e-9))
    assert select(req, fab).name == "teleport"  # the selection cache saw the new registry
    # its place among the candidates comes from its order (native 10 < 15 < ring 20)
    assert cost.candidates(OP)[:3] == ("native", "teleport", "ring")
    assert cost.costs(OP, 64 * MiB, fab)["teleport"] == 1e-9
    assert cost.estimate(OP, 64 * MiB, fab) == 1e-9
    calibrated = FabricModel(ranks_per_node=4, algorithm_factors={"all_reduce/teleport": 3.0})
    assert cost.algorithm_cost(OP, "teleport", req, calibrated) == 1e-9 * 3.0
    # a one-rank group costs a local copy, as for every algorithm
    one = FabricModel()
    assert cost.algorithm_cost(OP, "teleport", req, one) == cost.algorithm_cost(
        OP, "ring", req, one)


def test_a_new_module_that_costs_more_is_not_selected(plugin):
    fab = FabricModel(ranks_per_node=4)
    req = Request(OP, MiB, 4, 4)
    plugin("teleport_slow", teleport(10.0))
    assert select(req, fab).name != "teleport"
    assert select(req, fab, "teleport").name == "teleport"  # forcing still works
    rows = {name: (seconds, reason) for name, seconds, reason in explain(req, fab)}
    assert rows["teleport"] == (10.0, None)


def test_ties_go_to_the_lower_order(plugin):
    fab = FabricModel(ranks_per_node=4)
    req = Request(OP, MiB, 4, 4)
    native = algorithms.lookup(OP, "native").cost(req, fab)
    plugin("teleport_late", teleport(native, order=11))
    assert select(req, fab).name == "native"
    plugin("teleport_late", teleport(native, order=9))
    assert cost.candidates(OP)[0] == "teleport"
    assert select(req, fab).name == "teleport"


def test_a_new_module_that_declines_says_why(plugin):
    plugin("teleport_local", teleport(1e-9))
    fab = FabricModel(ranks_per_node=2, nodes=2)
    req = Request(OP, MiB, 4, 4)
    assert select(req, fab).name != "teleport"
    rows = {name: (seconds, reason) for name, seconds, reason in explain(req, fab)}
    assert rows["teleport"] == (None, "teleports within one node only")
    assert cost.shape_reason(OP, "teleport", fab) == "teleports within one node only"
    assert "teleport" not in cost.costs(OP, MiB, fab)
    with pytest.raises(SelectionError, match="'teleport' cannot run this all_reduce: "
                                             "teleports within one node only"):
        select(req, fab, "teleport")
    # other ops do not see it
    with pytest.raises(SelectionError, match="unknown algorithm 'teleport'"):
        select(Request(CollectiveOp.ALL_GATHER, MiB, 4, 4), fab, "teleport")


def test_no_candidate_lists_the_new_modules_reason(plugin, monkeypatch):
    plugin("teleport_only", teleport(1e-9))
    reg = algorithms.registry()
    only = {op: [a for a in algos if a.name in ("teleport", "hierarchical")]
            for op, algos in reg.items()}
    monkeypatch.setattr("collectives.select.registry", lambda: only)
    req = Request(OP, MiB, 4, 3)
    with pytest.raises(SelectionError) as info:
        select(req, FabricModel(ranks_per_node=1, nodes=3))
    assert str(info.value) == ("no algorithm can run this all_reduce: "
                               "teleport: teleports within one node only; "
                               "hierarchical: needs at least 2 ranks per node")


def test_two_algorithms_of_one_name_are_an_error(plugin):
    plugin("ring_again", _TEMPLATE.format(seconds=1.0, order=1).replace('"teleport"', '"ring"'))
    with pytest.raises(ValueError, match="'ring' for all_reduce is defined twice"):
        algorithms.registry()
