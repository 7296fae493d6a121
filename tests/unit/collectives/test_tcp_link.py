"""The TCP link between nodes: declared in a fabric spec, priced with the transport's
fraction of the line rate, the hosts' per-byte, per-message and per-call costs, fitted by
calibrate and held by validate to the calls the measurement repeats."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from collectives.calibrate import (Measurement, fit, model_table, predicted, read_bench,
                                   read_measurements)
from collectives.topofabric import apply_model, spec_links
from collectives.types import CollectiveOp, FabricModel, LinkCost, Request
from neocomm.cli import main
from topology.spec import SpecError, load_spec, parse_spec

RECORDED = Path(__file__).parent / "data" / "bench-2cpu-host.json"

SPEC = """[fabric]
name = "two-tcp-hosts"

[cluster]
nodes = 2

[node]
gpus = 0

[tcp]
rate_gbps = {rate}
{extra}"""


def _spec(rate=1, extra="", path="<spec>"):
    return parse_spec(SPEC.format(rate=rate, extra=extra), path)


def _start(rate=1) -> FabricModel:
    return spec_links(_spec(rate), device=False)


def test_a_spec_declares_the_tcp_link_between_nodes():
    fabric = _start(1)
    assert fabric.inter.kind == "tcp" and fabric.inter.bandwidth == pytest.approx(1e9 / 8)
    assert fabric.nics_per_node == 1
    two = spec_links(_spec(25, "count = 2"), device=False)
    assert two.inter.bandwidth == pytest.approx(25e9 / 8) and two.nics_per_node == 2
    # no [tcp] and no [nic]: a 10 Gb/s port, as before
    plain = spec_links(load_spec("cpu-host"), device=False)
    assert plain.inter.kind == "tcp" and plain.inter.bandwidth == pytest.approx(10e9 / 8)
    for text, key in (("0", "[tcp] rate_gbps"), ("1\ncount = 0", "[tcp] count")):
        with pytest.raises(SpecError, match=key.replace("[", r"\[").replace("]", r"\]")):
            _spec(text)
    with pytest.raises(SpecError, match="tcp_fraction"):
        _spec(1, '[model]\nbuffers = "host"\ntcp_fraction = 1.5')


def test_the_tcp_terms_fold_into_the_link_and_are_off_by_default():
    req = Request(CollectiveOp.ALL_REDUCE, 4 << 20, group_size=2)
    start = _start(1).with_shape(1, 2)
    assert start.effective(req) is start  # line rate: the formulas see the spec's link
    tcp = replace(start, tcp_fraction=0.5, tcp_copy_bandwidth=1e9, tcp_message_overhead=20e-6)
    eff = tcp.effective(req)
    per_byte = 1 / (0.5 * 1e9 / 8) + 1 / 1e9
    assert eff.inter.bandwidth == pytest.approx(1 / per_byte)
    assert eff.inter.latency == pytest.approx(start.inter.latency + 20e-6)
    assert eff.intra == start.intra  # only the link between nodes is TCP
    assert eff.effective(req) == eff  # folded once
    # two ranks per core: the hosts' work per byte and per message shares the core
    busy = replace(tcp, ranks_per_node=4, cores_per_node=2).effective(req)
    assert busy.inter.bandwidth == pytest.approx(1 / (1 / (0.5 * 1e9 / 8) + 2 / 1e9))
    # an RDMA link ignores them
    roce = replace(tcp, inter=LinkCost(5e-6, 25e9, kind="roce"))
    assert roce.effective(req).inter == roce.inter
    with pytest.raises(ValueError, match="tcp_fraction"):
        replace(start, tcp_fraction=0.0)
    # a slower transport is a slower call, priced by the selection's own code
    m = Measurement(CollectiveOp.ALL_REDUCE, 2, 1, 4 << 20, 4, "native", 1.0)
    assert predicted(m, tcp) > 2 * predicted(m, start)


def _rows(truth: FabricModel, layouts=((2, 1), (4, 2))) -> list[Measurement]:
    rows = []
    for op in (CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_GATHER):
        for ranks, per_node in layouts:
            for size in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
                m = Measurement(op, ranks, per_node, size, 4, "native", 1.0)
                rows.append(replace(m, time=predicted(m, truth)))
    return rows


def test_calibration_fits_the_tcp_terms_and_keeps_the_declared_line_rate():
    truth = replace(_start(1), tcp_fraction=0.3, tcp_copy_bandwidth=2e9,
                    tcp_message_overhead=40e-6, call_overhead=5e-6, tcp_call_overhead=2e-3)
    rows = _rows(truth)
    line = fit(rows, _start(1), prior=0.0, iterations=0)  # the spec's line rate, unfitted
    assert line.worst_error > math.log(2)  # the line rate is more than twice too fast
    result = fit(rows, _start(1), prior=0.0)
    assert result.worst_error < 0.01
    assert {"tcp_fraction", "tcp_copy_bandwidth", "tcp_message_overhead",
            "tcp_call_overhead"} <= set(result.measured)
    assert "inter_bandwidth" not in result.measured  # the port's rate is declared
    assert result.fabric.inter.bandwidth == pytest.approx(1e9 / 8)
    pulled = fit(rows, _start(1))
    assert pulled.median_error < 0.05
    assert pulled.fabric.tcp_fraction < 0.6  # the transport reaches part of the rate
    table = model_table(pulled, buffers="host", kinds=("shm", "tcp"), measured_on="test")
    assert 0 < table["tcp_fraction"] <= 1 and table["tcp_message_overhead_us"] > 0
    back = apply_model(_start(1), table)
    assert back.tcp_fraction == pytest.approx(table["tcp_fraction"])
    assert back.tcp_copy_bandwidth == pytest.approx(table["tcp_copy_bandwidth_gbs"] * 1e9)
    # a fabric without TCP between nodes neither fits nor writes them
    shm = fit(rows[:5], replace(_start(1), inter=_start(1).intra), prior=0.0)
    assert not {"tcp_fraction", "tcp_copy_bandwidth"} & set(shm.measured)
    assert "tcp_fraction" not in model_table(shm, buffers="host", kinds=("shm", "shm"),
                                             measured_on="test")


def _bench_runs(truth: FabricModel, scale=(1.0,), jitter=None) -> list[dict]:
    """The recorded 2-rank, 2-node runs as if measured over TCP, their times the model's
    ``truth`` times each launch's ``scale`` (``jitter(row)``: a factor per row)."""
    runs = [r for r in read_measurements(str(RECORDED)) if r["ranks"] == 2
            and r["nodes"] == 2 and r["op"] in ("all_reduce", "all_to_all")]
    out = []
    for f in scale:
        for run in runs:
            run = dict(run, fabric_links={"intra": "shm", "inter": "tcp"},
                       fabric_source="topology: shm within nodes, tcp x1 between nodes")
            rows = []
            for row in run["rows"]:
                m = read_bench({**run, "rows": [row]})[0]
                j = jitter(row) if jitter else 1.0
                rows.append(dict(row, time=predicted(m, truth) * f * j))
            out.append(dict(run, rows=rows))
    return out


def test_calibrate_then_validate_over_tcp_holds_the_model_to_what_repeats(tmp_path, capsys):
    spec_path = tmp_path / "tcp.toml"
    spec_path.write_text(SPEC.format(rate=1, extra=""))
    truth = replace(_start(1), tcp_fraction=0.3, tcp_copy_bandwidth=3e9,
                    tcp_message_overhead=30e-6, call_overhead=6e-6, tcp_call_overhead=2e-3)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"kind": "neocomm-measurements", "runs": _bench_runs(truth)}))
    out = tmp_path / "fitted.toml"
    assert main(["simulate", "calibrate", "--fabric", str(spec_path), "--bench", str(cal),
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tcp_fraction" in text and "inter_link" in text
    model = dict(load_spec(str(out)).model)
    assert model["inter_link"] == "tcp" and model["tcp_fraction"] < 0.6
    # a later run: two launches; the 1 MiB calls differ 1.5x between them (not repeated),
    # the others agree; the model must meet those that repeat
    paths = []
    for k, f in enumerate((1.0, 1.05)):
        path = tmp_path / f"val{k}.json"
        path.write_text(json.dumps({"kind": "neocomm-measurements", "runs": _bench_runs(
            truth, (f,), jitter=lambda row, k=k: 1.5 if row["size"] == 1 << 20 and k else 1)}))
        paths += ["--bench", str(path)]
    code = main(["simulate", "validate", "--fabric", str(out), *paths, "--repeatable-only",
                 "--json", str(tmp_path / "v.json")])
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "v.json").read_text())
    assert code == 0, text
    assert "held to the calls the host repeats" in text and "the host itself" in text
    assert report["repeatable"] == report["repeatable_within"] == len(report["rows"]) - 2
    # held to what the calibration run also measured alike: all of it here; nothing when
    # that run measured every call 1.3 times slower (no call repeats: nothing passes)
    assert main(["simulate", "validate", "--fabric", str(out), *paths, "--repeatable-only",
                 "--baseline", str(cal)]) == 0
    assert "(--baseline): 14 of 16 calls within 10%" in capsys.readouterr().out  # not 1 MiB
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps({"kind": "neocomm-measurements",
                                  "runs": _bench_runs(truth, (1.3,))}))
    assert main(["simulate", "validate", "--fabric", str(out), *paths, "--repeatable-only",
                 "--baseline", str(slower)]) == 1
    assert "0 of 0 within 25%" in capsys.readouterr().out
    # a model that misses a call the host repeats fails
    bad = tmp_path / "bad.toml"
    bad.write_text(out.read_text().replace(f"tcp_fraction = {model['tcp_fraction']}",
                                           "tcp_fraction = 1.0"))
    assert main(["simulate", "validate", "--fabric", str(bad), *paths,
                 "--repeatable-only"]) == 1
    assert "off:" in capsys.readouterr().out
    # one launch: nothing repeats, nothing to hold the model to: refused, not passed
    assert main(["simulate", "validate", "--fabric", str(out), *paths[:2],
                 "--repeatable-only"]) == 2
    assert "--launches 2" in capsys.readouterr().err


def test_runs_at_several_link_rates_tell_the_transport_from_the_hosts_work():
    """At one rate a slow transport and slow hosts price alike; runs at several rates
    (each saying its ``link_rate_gbps``), each priced at its own rate, tell them apart:
    fitted at 0.5 and 5 Gbit/s, the model prices 1 Gbit/s, which it never saw."""
    truth = replace(_start(1), tcp_fraction=0.8, tcp_copy_bandwidth=0.1e9,
                    tcp_message_overhead=40e-6, tcp_call_overhead=3e-3)

    def at(gbps):
        rate = gbps * 1e9 / 8
        fab = replace(truth, inter=replace(truth.inter, bandwidth=rate))
        return [replace(m, line_rate=rate) for m in _rows(fab, layouts=((2, 1),))]

    slow, unseen, fast = at(0.5), at(1), at(5)
    # the 5 Gbit/s runs are priced at 5 Gbit/s, not at the spec's 1
    big = next(m for m in fast if m.size == 64 << 20)
    assert predicted(big, truth) == pytest.approx(big.time)
    assert predicted(replace(big, line_rate=0.0), truth) > 1.5 * big.time
    both = fit(slow + fast, _start(1), prior=0.0)
    assert both.median_error < 0.02
    assert max(abs(math.log(predicted(m, both.fabric) / m.time)) for m in unseen) < 0.05
    # fitted at one rate, the host's work and the transport's share cannot be told
    # apart, and another rate is priced far off
    one = fit(fast, _start(1), prior=0.0)
    assert one.median_error < 0.02
    assert max(abs(math.log(predicted(m, one.fabric) / m.time)) for m in slow) > math.log(1.25)
    # read from a bench run, and kept apart from runs at other rates when merged
    from collectives.calibrate import median_of_launches

    run = dict(_bench_runs(truth)[0], link_rate_gbps=5)
    assert all(m.line_rate == 5e9 / 8 for m in read_bench(run))
    assert len(median_of_launches([run, dict(run, link_rate_gbps=1)])) == 2


def test_a_call_over_tcp_pays_the_links_fixed_cost_and_calibration_finds_it():
    """Each collective call whose messages cross a TCP link pays the link's fixed cost of a
    call (``tcp_call_overhead``: its first messages find their peers descheduled), through
    the API and as MPI's own call alike, stretched by ranks over cores; within a node or
    over RDMA, nothing. Calibration recovers it from calls of several sizes, and a model
    without it prices the small calls of such a link far too fast."""
    from collectives.cost import call_overhead, call_seconds

    req = Request(CollectiveOp.ALL_TO_ALL, 1 << 20, group_size=2)
    base = replace(_start(1), tcp_fraction=0.5).with_shape(1, 2)
    fab = replace(base, tcp_call_overhead=3e-3)
    assert fab.tcp_call_seconds == 3e-3 and base.tcp_call_seconds == 0.0
    for api in (True, False):
        extra = call_seconds(CollectiveOp.ALL_TO_ALL, "native", req, fab, api=api) - \
            call_seconds(CollectiveOp.ALL_TO_ALL, "native", req, base, api=api)
        assert extra == pytest.approx(3e-3)
    # the step prices each collective call with call_overhead: it pays it there too
    assert call_overhead(req, fab) - call_overhead(req, base) == pytest.approx(3e-3)
    assert replace(fab, nodes=1).tcp_call_seconds == 0.0  # within a node
    roce = replace(fab, inter=LinkCost(5e-6, 25e9, kind="roce"))
    assert roce.tcp_call_seconds == 0.0
    busy = replace(fab, ranks_per_node=4, cores_per_node=2)
    assert busy.tcp_call_seconds == pytest.approx(6e-3)
    with pytest.raises(ValueError, match="tcp_call_overhead"):
        replace(fab, tcp_call_overhead=-1.0)
    # fitted from MPI's own calls of several sizes (through the API, each operation's own
    # call overhead is paid by the same calls, and only the pull toward the starting
    # values splits the two), written and read back
    truth = replace(_start(1), tcp_fraction=0.6, tcp_copy_bandwidth=1e9,
                    tcp_message_overhead=20e-6, tcp_call_overhead=4e-3)
    rows = [replace(m, api=False) for m in _rows(truth)]
    rows = [replace(m, time=predicted(m, truth)) for m in rows]
    result = fit(rows, _start(1), prior=0.0)
    assert result.worst_error < 0.01
    assert result.fabric.tcp_call_overhead == pytest.approx(4e-3, rel=0.02)
    assert "tcp_call_overhead" in result.measured
    result = fit(rows, _start(1))  # pulled toward the spec, as calibrate fits
    assert result.fabric.tcp_call_overhead == pytest.approx(4e-3, rel=0.1)
    table = model_table(result, buffers="host", kinds=("shm", "tcp"), measured_on="test")
    assert table["tcp_call_overhead_us"] == pytest.approx(4000, rel=0.05)
    back = apply_model(_start(1), table)
    assert back.tcp_call_overhead == pytest.approx(table["tcp_call_overhead_us"] * 1e-6)
    # without it, the fitted model prices the small calls far off
    dropped = replace(result.fabric, tcp_call_overhead=0.0)
    small = [m for m in rows if m.size <= 1 << 20 and m.nodes > 1]
    assert max(m.time / predicted(m, dropped) for m in small) > 1.25
