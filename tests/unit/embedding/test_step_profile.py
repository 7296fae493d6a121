"""The training step's compute measured on this host, and the step validated against runs."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embedding.profile import _co_runners, expected_max, rank_shares, read_training
from embedding.simulate import PARTS, estimate_step
from embedding.types import Shard, ShardingPlan, ShardingType, TablePlan, TableConfig
from neocomm.cli import main

HERE = Path(__file__).parent
RECORDED_STEPS = HERE / "data" / "step-2cpu-host.json"
RECORDED_BENCH = HERE.parent / "collectives" / "data" / "bench-2cpu-host.json"


def _tables():
    return [TableConfig("a", 100, 8, features=("fa",)), TableConfig("b", 50, 8, features=("fb",))]


def test_each_rank_serves_its_share_of_every_table():
    plan = ShardingPlan(2, 2, (
        TablePlan("a", ShardingType.ROW_WISE, (Shard(0, 0, 25, 0, 8), Shard(1, 25, 75, 0, 8))),
        TablePlan("b", ShardingType.TABLE_WISE, (Shard(1, 0, 50, 0, 8),))))
    shares = rank_shares(plan, _tables())
    assert shares == {0: {"a": 0.25}, 1: {"a": 0.75, "b": 1.0}}
    dp = ShardingPlan(2, 2, (TablePlan("b", ShardingType.DATA_PARALLEL,
                                       (Shard(0, 0, 50, 0, 8), Shard(1, 0, 50, 0, 8))),))
    assert rank_shares(dp, _tables()[1:]) == {0: {"b": 0.5}, 1: {"b": 0.5}}


def test_a_metrics_log_gives_the_median_window_after_the_first(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [{"event": "start"}] + [
        {"event": "train", "step_ms": ms, "phases_ms": {"dense": ms / 2}} for ms in
        (90.0, 10.0, 30.0, 20.0)] + [{"event": "end"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_training(str(log))
    assert got["step_ms"] == [10.0, 30.0, 20.0]  # the warm-up window is left out
    assert got["median_step_ms"] == 20.0 and got["median_phases_ms"] == {"dense": 10.0}
    log.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="no training window after the first 1"):
        read_training(str(log))


def test_launches_of_one_layout_merge_to_the_median_of_their_medians():
    from embedding.profile import median_of_training_launches

    def run(ranks, nodes, ms, dense):
        return {"ranks": ranks, "nodes": nodes, "emulated": True, "config": None, "steps": 9,
                "step_ms": [ms, ms], "median_step_ms": ms, "median_phases_ms": {"dense": dense}}

    merged = median_of_training_launches([run(2, 1, 40.0, 4.0), run(4, 2, 70.0, 7.0),
                                          run(2, 1, 90.0, 3.0), run(2, 1, 50.0, 5.0)])
    assert [(m["ranks"], m["launches"]) for m in merged] == [(2, 3), (4, 1)]
    two = merged[0]
    assert two["median_step_ms"] == 50.0 and two["median_phases_ms"] == {"dense": 4.0}
    assert sorted(two["step_ms"]) == [40.0, 40.0, 50.0, 50.0, 90.0, 90.0]
    assert two["launch_step_ms"] == [40.0, 90.0, 50.0]
    assert merged[1]["median_step_ms"] == 70.0 and "launch_step_ms" not in merged[1]
    again = median_of_training_launches([two, run(2, 1, 45.0, 4.0)])  # brings its launches
    assert again[0]["launch_step_ms"] == [40.0, 90.0, 50.0, 45.0]
    assert again[0]["median_step_ms"] == 47.5 and again[0]["launches"] == 4


def test_the_slowest_of_n_ranks_waits_the_expected_largest_of_n_steps():
    import random
    import statistics

    steps = [10.0, 10.0, 10.0, 14.0]  # one step in four is stretched by 4
    assert expected_max(steps, 1) == pytest.approx(statistics.fmean(steps))
    # the largest of 2 draws is 14 unless both draws are 10: 1 - (3/4)^2 of the time
    assert expected_max(steps, 2) == pytest.approx(10 + 4 * (1 - 0.75 ** 2))
    assert expected_max(steps, 64) == pytest.approx(14, rel=1e-6)
    rng = random.Random(3)
    xs = [rng.gauss(0, 1) for _ in range(200)]
    drawn = statistics.fmean(max(rng.choice(xs) for _ in range(4)) for _ in range(40000))
    assert expected_max(xs, 4) == pytest.approx(drawn, abs=0.03)
    assert expected_max([5.0] * 7, 8) == pytest.approx(5.0)  # no spread, no wait
    with pytest.raises(ValueError, match="samples"):
        expected_max([], 2)
    with pytest.raises(ValueError, match="n: expected a count >= 1, got 0"):
        expected_max([1.0], 0)


def test_co_runners_run_beside_the_profile_and_are_gone_after():
    from embedding.train import load_config

    cfg = load_config(None)
    with _co_runners(cfg, 64, 1, 1) as co:
        procs = list(co.procs)
        assert len(procs) == 1 and procs[0].poll() is None  # training beside us
        tmp = co.tmp  # its temporary directory: killed, it cannot clean it up itself
        assert os.path.isdir(tmp)
    assert all(p.poll() is not None for p in procs) and not co.procs
    assert not os.path.exists(tmp)


def _step_report():
    from embedding.planner import plan_sharding
    from embedding.planner.types import Hardware, Workload
    from collectives.types import FabricModel

    hw = Hardware(2, 2, 1 << 30, fabric=FabricModel(call_overhead=20e-6))
    return plan_sharding(_tables(), hw, Workload(batch_size=256)), hw


def test_a_measured_profile_replaces_the_priced_compute_and_keeps_the_collectives():
    from embedding.dense.types import DenseConfig

    report, hw = _step_report()
    dense = DenseConfig(num_dense=4, num_sparse=2, bottom_mlp=(16, 8), top_mlp=(16, 1))
    profile = {r: {"data": 1e-3, "input_dist": 2e-4, "lookup": 3e-4, "output_dist": 1e-4,
                   "dense": 5e-3, "sync": 1e-4, "emb_backward": 7e-4, "optimizer": 2e-4}
               for r in range(2)}
    priced = estimate_step(report, hw, dense, 256, flop_rate=1e9, overlap=False)
    measured = estimate_step(report, hw, dense, 256, flop_rate=1e9, overlap=False,
                             profile=profile)
    p, m = dict(priced.parts), dict(measured.parts)
    assert p["data"] == 0.0 and m["data"] == pytest.approx(1e-3)
    assert m["lookup"] == pytest.approx(3e-4) and m["dense"] == pytest.approx(5e-3)
    rank = report.ranks[measured.slowest_rank]
    update = rank.lookup_seconds - dict(rank.parts)["lookup"]
    assert update > 0
    # the embedding backward keeps its collectives and takes the measured update
    assert m["emb_backward"] == pytest.approx(p["emb_backward"] - update + 7e-4)
    # every call pays the fabric's call overhead: the step's small AllReduce included
    assert m["sync"] == pytest.approx(p["sync"] + 1e-4) and p["sync"] > 20e-6
    assert [name for name, _ in measured.parts] == list(PARTS)
    assert measured.step_seconds == pytest.approx(sum(m.values()))


def test_the_recorded_training_runs_are_predicted_from_their_profiles(tmp_path, capsys):
    """The recorded runs of this host, each with the compute profile taken beside it, priced
    with the calibrated fabric: every layout's prediction is printed beside its measurement,
    and within 25 % of it (the FLOP-rate model without a profile was ten times off)."""
    fabric = tmp_path / "host.toml"
    assert main(["simulate", "calibrate", "--bench", str(RECORDED_BENCH), "-o",
                 str(fabric)]) == 0
    capsys.readouterr()
    out = tmp_path / "cmp.json"
    code = main(["simulate", "validate", "--step", "--fabric", str(fabric), "--bench",
                 str(RECORDED_STEPS), "--json", str(out)])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    runs = json.loads(RECORDED_STEPS.read_text())["runs"]
    assert [(r["run"]["ranks"], r["run"]["nodes"]) for r in rows] == \
        [(r["ranks"], r["nodes"]) for r in runs]
    within = 0
    for row, run in zip(rows, runs):
        ratio = row["predicted"]["step_seconds"] * 1e3 / run["median_step_ms"]
        assert row["ratio"] == pytest.approx(ratio)
        assert 0.5 <= ratio <= 2.0
        within += abs(ratio - 1) <= 0.25
        assert f"{run['median_step_ms']:.2f}" in text
    assert f"within 25%: {within} of {len(runs)} layouts" in text
    assert within == len(runs) and code == 0
    assert "the host itself" not in text  # merged runs without their launches' steps
    # the same runs again, 10 % slower, as a second launch: both within 25 % of the median
    again = tmp_path / "again.json"
    again.write_text(json.dumps({"kind": "neocomm-step-measurements", "runs": [
        dict(r, median_step_ms=r["median_step_ms"] * 1.1) for r in runs]}))
    main(["simulate", "validate", "--step", "--fabric", str(fabric), "--bench",
          str(RECORDED_STEPS), "--bench", str(again)])
    text = capsys.readouterr().out
    assert f"the host itself: {len(runs)} of {len(runs)} layouts measured alike" in text
    first = runs[0]["median_step_ms"]
    assert f"{first:.1f}/{first * 1.1:.1f} ms" in text


def test_step_validation_wants_a_fabric_of_this_machine(capsys):
    assert main(["simulate", "validate", "--step", "--fabric", "zionex", "--bench",
                 str(RECORDED_STEPS)]) == 2
    assert "--fabric zionex: the step is validated on the machine at hand" in \
        capsys.readouterr().err
