"""`neocomm simulate collective`: fabrics from specs, predictions from the selection's model."""
from __future__ import annotations

import json

import pytest

from collectives import cost
from collectives.select import select
from collectives.simulate import bench_request, predict, sweep
from collectives.topofabric import fabric_from_spec
from collectives.types import CollectiveOp
from neocomm.cli import main
from topology.spec import load_spec


def test_a_spec_gives_its_links_shape_and_memory_rates():
    fab = fabric_from_spec(load_spec("zionex"), 128)
    assert (fab.nodes, fab.ranks_per_node, fab.nics_per_node) == (16, 8, 8)
    assert fab.intra.bandwidth == 300e9          # [nvlink] min_bandwidth_gbs
    assert fab.inter.bandwidth == 200e9 / 8      # one 200 Gb/s RoCE port
    assert fab.copy_bandwidth == pytest.approx(1.555e12 / 2)  # A100 HBM, read + write
    h100 = fabric_from_spec(load_spec("dgx-h100"), 8)
    assert h100.nodes == 1 and h100.intra.bandwidth > fab.intra.bandwidth
    host = fabric_from_spec(load_spec("zionex"), 32, device=False)
    assert "shm" in host.source and host.intra.bandwidth < fab.intra.bandwidth
    cpu = fabric_from_spec(load_spec("cpu-host"), 4)  # no GPUs: ranks spread over the nodes
    assert (cpu.nodes, cpu.ranks_per_node) == (1, 4)


@pytest.mark.parametrize("spec, ranks, kw, match", [
    ("zionex", 256, {}, r"256 ranks at 8 per node need 32 nodes, but fabric 'zionex' has 16 "
                        r"\(128 ranks at most\)"),
    ("zionex", 12, {}, r"12 ranks do not fill nodes of 8"),
    ("zionex", 16, {"ranks_per_node": 16}, r"16 ranks per node need 16 GPUs, but a node of "
                                            r"fabric 'zionex' has 8"),
    ("cpu-host", 2, {"device": True}, r"fabric 'cpu-host' has no GPUs"),
    ("zionex", 0, {}, r"ranks: expected >= 1, got 0"),
])
def test_a_rank_count_the_fabric_cannot_hold_is_refused(spec, ranks, kw, match):
    with pytest.raises(ValueError, match=match):
        fabric_from_spec(load_spec(spec), ranks, **kw)


@pytest.mark.parametrize("op", [op for op in CollectiveOp])
def test_predictions_are_the_selections_prices(op):
    """Every row is what the selection's own model says for the bench's call of that size."""
    fab = fabric_from_spec(load_spec("zionex"), 32)
    sizes = sweep(1 << 10, 64 << 20, 16)
    table = predict(op, fab, sizes, device=True)
    assert [rows[0].size for rows in table] == [
        bench_request(op, s, 4, 32).nbytes for s in sizes]
    for size, rows in zip(sizes, table):
        req = bench_request(op, size, 4, 32, device=True)
        assert [r.algo for r in rows] == list(cost.candidates(op))
        assert [r.algo for r in rows if r.selected] == [select(req, fab).name]
        for r in rows:
            if r.time is None:
                assert r.reason and r.algbw == 0
                continue
            assert r.time == cost.algorithm_cost(op, r.algo, req, fab)
            assert r.algbw == pytest.approx(req.nbytes / r.time / 1e9)
        best = min(r.time for r in rows if r.time is not None)
        assert next(r for r in rows if r.selected).time == best


def test_more_nodes_cost_more_at_the_same_size():
    spec = load_spec("zionex")
    times = [next(r for r in predict("all_reduce", fabric_from_spec(spec, n), [16 << 20],
                                     device=True)[0] if r.selected).time
             for n in (8, 32, 128)]
    assert times[0] < times[1] < times[2]


def _simulate(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_command_prints_the_bench_table_and_writes_json_and_a_plot(tmp_path, capsys):
    js, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc, out, err = _simulate(capsys, "collective", "all_to_all", "--fabric", "zionex", "-n",
                             "16", "-b", "1K", "-e", "1M", "-f", "4", "--json", str(js),
                             "--plot", str(png))
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert len(lines) == len(sweep(1 << 10, 1 << 20, 4)) == 6
    assert "16 ranks (2 node(s) x 8) on fabric 'zionex'" in out and "busbw" in out
    data = json.loads(js.read_text())
    assert data["kind"] == "neocomm-simulate-collective" and data["ranks"] == 16
    assert len(data["rows"]) == 6 * len(cost.candidates(CollectiveOp.ALL_TO_ALL))
    chosen = [r["algo"] for r in data["rows"] if r["selected"]]
    assert [ln.split()[-1] for ln in lines] == chosen
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, match", [
    (["collective", "all_reduce", "--fabric", "zionx", "-n", "8"],
     "zionx: no such file and not a preset"),
    (["collective", "all_reduce", "--fabric", "zionex", "-n", "200"],
     "200 ranks at 8 per node need 25 nodes"),
    (["collective", "all_sum", "--fabric", "zionex", "-n", "8"], "all_sum"),
    (["collective", "all_reduce", "--fabric", "zionex", "-n", "8", "--dtype", "float7"],
     "--dtype: unknown element type 'float7'"),
    (["collective", "all_reduce", "--fabric", "zionex", "-n", "8", "-b", "1M", "-e", "1K"],
     "expected 0 < -b <= -e"),
    ([], "expected a subcommand: collective"),
])
def test_bad_input_is_named(capsys, argv, match):
    rc, _, err = _simulate(capsys, *argv)
    assert rc == 2 and match in err, err


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path, capsys):
    bad = tmp_path / "cal.json"
    bad.write_text('{"kind": "something-else"}')
    rc, _, err = _simulate(capsys, "collective", "all_reduce", "--fabric", "zionex", "-n", "8",
                           "--calibration", str(bad))
    assert rc == 2 and "is not a neocomm calibration file" in err
