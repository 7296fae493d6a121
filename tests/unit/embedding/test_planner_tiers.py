"""The tier-aware planner: host memory with a device cache, its costs, the reference
plans (they fit: tiers chosen, every rank's device and every node's host bytes within
budget), plans that fit nowhere, bad input, and a tiered plan file that trains."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from embedding.planner import (Hardware, PlanDoesNotFitError, TableConstraints, Workload,
                               evaluate_plan, plan_sharding)
from embedding.planner.hardware import hardware_for, load_target
from embedding.planner.tables import preset_tables
from embedding.planner.tiers import harmonic, zipf_hit_rate
from embedding.types import ShardingPlan, TableConfig, Tier
from neocomm.cli import main

GIB = 1 << 30


def plan(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_harmonic_numbers_and_zipf_hit_rate():
    for s in (0.8, 1.0, 1.05, 1.2):
        for k in (1, 7, 1000, 1001, 12345):
            exact = math.fsum(i ** -s for i in range(1, k + 1))
            assert harmonic(k, s) == pytest.approx(exact, rel=1e-12)
    assert zipf_hit_rate(0, 100, 1.05) == 0.0 and zipf_hit_rate(100, 100, 1.05) == 1.0
    rates = [zipf_hit_rate(c, 10**7, 1.05) for c in (10**3, 10**5, 10**6, 5 * 10**6)]
    assert rates == sorted(rates) and 0 < rates[0] < rates[-1] < 1
    # a steeper law concentrates more lookups on the hot rows
    assert zipf_hit_rate(10**5, 10**7, 1.2) > zipf_hit_rate(10**5, 10**7, 1.05)


def test_hardware_host_tier_fields():
    gpu = hardware_for(load_target("dgx-a100"), 8, device_memory=8 * GIB, host_memory=GIB)
    assert gpu.host_memory == GIB
    assert gpu.host_rate == pytest.approx(0.8 * 31.5e9)  # PCIe Gen4 x16, 80 % of line rate
    cpu = hardware_for(load_target("cpu-host"), 2, device_memory=GIB)
    assert cpu.host_memory == 0 and cpu.host_rate == cpu.fabric.copy_bandwidth
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="host_memory"):
            Hardware(8, 8, GIB, host_memory=bad)
    with pytest.raises(ValueError, match="host_bandwidth"):
        Hardware(8, 8, GIB, host_bandwidth=-1.0)
    with pytest.raises(ValueError, match="hit_rate"):
        TableConstraints(hit_rate=1.5)
    with pytest.raises(ValueError, match="not both"):
        TableConstraints(hit_rate=0.5, zipf_exponent=1.1)


def _fits(capsys, *argv):
    """Plan in-process with ``--json -``; the plan and its estimates, after checking that
    every rank's device bytes and every node's host bytes are within budget."""
    rc, out, err = plan(capsys, *argv, "--json", "-")
    assert rc == 0, err
    data = json.loads(out)
    est = data["estimate"]
    usable, host = est["device_memory_usable"], est["host_memory_per_node"]
    per_node: dict[int, int] = {}
    for r in est["ranks"]:
        assert r["device_bytes"] <= usable
        per_node[r["node"]] = per_node.get(r["node"], 0) + r["host_bytes"]
    assert all(v <= host for v in per_node.values())
    assert est["step_seconds"] > 0
    return ShardingPlan.from_json(out), est, err


def test_criteo_1tb_on_8gib_devices_uses_host_memory(capsys):
    rc, _, err = plan(capsys, "criteo-1tb", "-n", "8", "--memory", "8GiB")
    assert rc == 1 and "short by" in err  # device memory alone is too small
    p, est, text = _fits(capsys, "criteo-1tb", "-n", "8", "--memory", "8GiB",
                         "--host-memory", "512GiB")
    tiered = [t for t in p.tables if t.memory.tiered]
    assert tiered and all(t.sharding.value != "data_parallel" for t in tiered)
    for t in p.tables:
        if t.memory.tier is Tier.CACHED:
            assert 0 < t.memory.cache_rows <= max(s.num_rows for s in t.shards)
    assert sum(r["host_bytes"] for r in est["ranks"]) > 0
    assert "Zipf s=1.05 assumed" in est["hit_rates"] and "Zipf s=1.05 assumed" in text
    for name in ("in_dist", "lookup", "emb_bwd", "host copy", "host GiB", "tiers:"):
        assert name in text
    rows = {t["table"]: t for t in est["tables"]}
    assert {rows[t.table]["tier"] for t in tiered} <= {"cached", "host"}


def test_criteo_1tb_uncapped_with_and_without_host_memory(capsys):
    p, est, _ = _fits(capsys, "criteo-1tb-uncapped", "-n", "8", "--memory", "32GiB",
                      "--host-memory", "1TiB")
    assert any(t.memory.tiered for t in p.tables)
    assert p.table("C20").memory.tiered  # 139.6 GiB: more than the 8 devices' 230 GiB allow
    p, est, text = _fits(capsys, "criteo-1tb-uncapped", "-n", "8", "--memory", "80GiB")
    assert not any(t.memory.tiered for t in p.tables)
    assert est["host_memory_per_node"] == 0 and "host tier" not in text


def test_model_that_fits_nowhere_says_by_how_much_per_tier(capsys):
    rc, out, err = plan(capsys, "criteo-1tb-uncapped", "-n", "8", "--memory", "8GiB",
                        "--host-memory", "200GiB")
    assert rc == 1
    assert "device memory" in err and "host memory" in err and "short by" in err
    assert "GiB" in err
    tables, cons = preset_tables("criteo-1tb-uncapped")
    hw = hardware_for(load_target("dgx-a100"), 8, device_memory=8 * GIB, reserve=0.1,
                      host_memory=200 * GIB)
    with pytest.raises(PlanDoesNotFitError) as info:
        plan_sharding(tables, hw, constraints=cons)
    assert info.value.host_short > 100 * GIB and info.value.device_short == 0
    # devices too small even for the lookup buffers of every table in host memory
    hw = dataclasses.replace(hw, device_memory=200 << 20, host_memory=2048 * GIB)
    with pytest.raises(PlanDoesNotFitError) as info:
        plan_sharding(tables, hw, constraints=cons)
    assert info.value.device_short > 0 and info.value.host_short == 0


@pytest.mark.parametrize("value,says", [("0", "expected a positive size"),
                                        ("-1GiB", "expected a size"),
                                        ("lots", "expected a size")])
def test_bad_host_memory_exits_2(capsys, value, says):
    with pytest.raises(SystemExit) as info:
        main(["plan", "criteo-1tb", "-n", "8", f"--host-memory={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--host-memory" in err and says in err and value in err


def test_host_memory_smaller_than_a_host_shard(capsys):
    rc, out, err = plan(capsys, "criteo-1tb-uncapped", "-n", "8", "--memory", "8GiB",
                        "--host-memory", "10GiB")
    assert rc == 2
    assert "--host-memory 10.00 GiB" in err and "table 'C1'" in err


def test_measured_hit_rate_is_used_and_named():
    tables = [TableConfig("big", 8_000_000, 64), TableConfig("small", 1000, 64)]
    hw = Hardware(2, 2, 512 << 20, host_memory=8 * GIB, host_bandwidth=20e9)
    wl = Workload(batch_size=4096)
    report = plan_sharding(tables, hw, wl, constraints={"big": TableConstraints(hit_rate=0.5)})
    big = next(t for t in report.tables if t.table == "big")
    assert big.tier.tiered and big.hit_source == "measured 0.5"
    assert "big measured 0.5" in report.hit_model
    assert max(r.memory.total for r in report.ranks) <= hw.usable_memory
    # the same plan priced as a plan file: host copies where the tables are host-resident
    again = evaluate_plan(report.plan, tables, hw, wl,
                          constraints={"big": TableConstraints(hit_rate=0.5)})
    assert any(r.host_seconds > 0 for r in again.ranks)
    assert [t.tier for t in again.tables] == [t.tier for t in report.tables]


def test_no_host_tier_keeps_todays_plans():
    tables, cons = preset_tables("criteo-1tb")
    hw = hardware_for(load_target("dgx-a100"), 8, device_memory=80 * GIB, reserve=0.1)
    report = plan_sharding(tables, hw, constraints=cons)
    assert not any(t.memory.tiered for t in report.plan.tables)
    assert all(r.memory.host == 0 and r.host_seconds == 0 for r in report.ranks)


def test_a_table_larger_than_one_nodes_host_memory_is_spread_over_nodes():
    """A host-resident table that one node's host memory cannot hold whole is spread by rows
    over the ranks of more nodes; each node's host bytes stay within its memory."""
    tables = [TableConfig("big", 8_000_000, 64), TableConfig("small", 1000, 64)]
    whole = 8_000_000 * 64 * 4
    hw = Hardware(4, 2, 256 << 20, host_memory=int(0.75 * whole), host_bandwidth=20e9)
    report = plan_sharding(tables, hw, Workload(batch_size=4096))
    big = report.plan.table("big")
    assert big.memory.tiered and big.sharding.value != "table_wise"
    nodes = {hw.node_of(s.rank) for s in big.shards}
    assert nodes == {0, 1}
    per_node = [0, 0]
    for r in report.ranks:
        per_node[hw.node_of(r.rank)] += r.memory.host
    assert max(per_node) <= hw.host_memory and sum(per_node) >= whole
    # with room for the whole table on one node the planner is free to keep it whole
    roomy = dataclasses.replace(hw, host_memory=4 * whole)
    assert plan_sharding(tables, roomy, Workload(batch_size=4096)).plan.table("big")
