"""`neocomm simulate step` and `scale`: the planner's per-part estimates plus the dense part."""
from __future__ import annotations

import json

import pytest

from embedding.dense.types import DenseConfig, DenseOptimizerKind
from embedding.planner import Workload, plan_sharding
from embedding.planner.estimate import CostModel
from embedding.planner.hardware import hardware_for, load_target
from embedding.planner.types import STEP_PARTS
from embedding.presets import preset
from embedding.simulate import dense_flops_per_sample, estimate_step
from neocomm.cli import main


def _plan(ranks=16, batch=65536):
    hw = hardware_for(load_target("zionex"), ranks, device_memory=40 << 30, reserve=0.1)
    return plan_sharding(preset("criteo-1tb"), hw, Workload(batch_size=batch)), hw


def test_the_planners_parts_add_up_to_its_rank_times():
    """A rank's parts plus one latency per collective the plan uses are its planned time."""
    from collectives.types import CollectiveOp as Op
    from embedding.planner.estimate import Scope
    from embedding.types import ShardingType as S

    a2a, rs, ag, ar = Op.ALL_TO_ALL, Op.REDUCE_SCATTER, Op.ALL_GATHER, Op.ALL_REDUCE
    w, node = Scope.WORLD, Scope.NODE
    uses = {S.TABLE_WISE: {(a2a, w)}, S.COLUMN_WISE: {(a2a, w)},
            S.TABLE_COLUMN_WISE: {(a2a, w), (ag, node)},
            S.ROW_WISE: {(a2a, w), (rs, w), (ag, w)},
            S.TABLE_ROW_WISE: {(a2a, w), (rs, node), (ag, node)}, S.DATA_PARALLEL: {(ar, w)}}
    for ranks in (8, 32):
        report, hw = _plan(ranks)
        cost = CostModel(hw)
        ops = set().union(*(uses[t.sharding] for t in report.tables))
        assert len({t.sharding for t in report.tables}) > 1  # a mixed plan
        latency = sum(cost.latency(op, scope) for op, scope in ops)
        for rank in report.ranks:
            assert [p for p, _ in rank.parts] == [p for p in STEP_PARTS if p in dict(rank.parts)]
            assert sum(t for _, t in rank.parts) + latency == pytest.approx(rank.seconds,
                                                                            rel=1e-9)


def test_a_step_is_the_sum_of_its_visible_parts_and_overlap_only_hides():
    report, hw = _plan()
    dense = DenseConfig()
    on = estimate_step(report, hw, dense, 65536, flop_rate=19.5e12)
    off = estimate_step(report, hw, dense, 65536, flop_rate=19.5e12, overlap=False)
    assert on.step_seconds == pytest.approx(sum(t for _, t in on.parts))
    assert sum(t for _, t in off.hidden) == 0.0
    assert on.step_seconds <= off.step_seconds
    assert on.step_seconds + sum(t for _, t in on.hidden) == pytest.approx(off.step_seconds)
    assert on.samples_per_second == pytest.approx(65536 / on.step_seconds)
    # the dense part is the MLPs' forward and backward at the given rate
    assert dict(off.parts)["dense"] == pytest.approx(
        3 * 65536 / 16 * dense_flops_per_sample(dense) / 19.5e12)
    slower = estimate_step(report, hw, dense, 65536, flop_rate=19.5e11, overlap=False)
    assert dict(slower.parts)["dense"] == pytest.approx(10 * dict(off.parts)["dense"])
    adam = estimate_step(report, hw, dense, 65536, flop_rate=19.5e12, overlap=False,
                         optimizer=DenseOptimizerKind.ADAM)
    assert dict(adam.parts)["optimizer"] == pytest.approx(7 / 3 * dict(off.parts)["optimizer"])


def test_more_ranks_are_faster_until_collectives_dominate():
    dense = DenseConfig()
    steps = {}
    for n in (8, 32, 128):
        report, hw = _plan(n)
        steps[n] = estimate_step(report, hw, dense, 65536, flop_rate=19.5e12)
    assert steps[8].samples_per_second < steps[32].samples_per_second
    assert steps[8].bound == "compute" and steps[128].bound == "communication"
    assert steps[128].communication_seconds / steps[128].step_seconds > \
        steps[8].communication_seconds / steps[8].step_seconds


def test_a_bad_flop_rate_is_refused():
    report, hw = _plan(8)
    with pytest.raises(ValueError, match="flop_rate: expected operations per second > 0"):
        estimate_step(report, hw, DenseConfig(), 65536, flop_rate=0)


def _simulate(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_step_prints_every_part_and_writes_json(tmp_path, capsys):
    js = tmp_path / "step.json"
    rc, out, err = _simulate(capsys, "step", "-n", "16", "--fabric", "zionex", "--batch-size",
                             "65536", "--json", str(js))
    assert rc == 0, err
    for part in STEP_PARTS:
        assert f"\n  {part:<14}" in out
    assert "samples/s" in out and "the GPU's peak FP32" in out
    data = json.loads(js.read_text())
    assert data["kind"] == "neocomm-simulate-step" and data["ranks"] == 16
    assert sum(data["parts"].values()) == pytest.approx(data["step_seconds"])
    rc, out, _ = _simulate(capsys, "step", "-n", "2")  # the default config on this host
    assert rc == 0 and "measured on this host" in out


def test_scale_replans_at_each_size(tmp_path, capsys):
    js, png = tmp_path / "scale.json", tmp_path / "scale.png"
    rc, out, err = _simulate(capsys, "scale", "--fabric", "zionex", "--ranks", "8,16,32",
                             "--batch-size", "65536", "--json", str(js), "--plot", str(png))
    assert rc == 0, err
    data = json.loads(js.read_text())
    assert [r["ranks"] for r in data["rows"]] == [8, 16, 32]
    weak = [r["weak"]["global_batch"] for r in data["rows"]]
    assert weak == [65536, 131072, 262144]
    assert all(r["strong"]["global_batch"] == 65536 for r in data["rows"])
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, match", [
    (["step", "-n", "16", "--fabric", "zionex", "--batch-size", "1000"],
     "batch size: 1000 samples do not split evenly over 16 ranks; use a multiple of 16 "
     "(992 or 1008)"),
    (["step", "-n", "12", "--fabric", "zionex"], "does not divide 12 ranks"),
    (["step", "-n", "2", "--fabric", "nosuch"], "nosuch"),
    (["step", "-n", "2", "--config", "/nonexistent/train.toml"], "/nonexistent/train.toml"),
    (["scale", "--ranks", "8,x"], "--ranks: expected rank counts like 8,16,32, got '8,x'"),
])
def test_bad_input_is_named(capsys, argv, match):
    rc, _, err = _simulate(capsys, *argv)
    assert rc == 2 and match in err, err


def test_a_given_plan_is_priced_as_the_planner_prices_its_own():
    import dataclasses

    from embedding.planner import PlanMismatchError, evaluate_plan
    from embedding.types import ShardingPlan

    report, hw = _plan(32)
    tables = preset("criteo-1tb")
    again = evaluate_plan(ShardingPlan.from_json(report.plan.to_json()), tables, hw,
                          Workload(batch_size=65536))
    assert again.plan == report.plan
    assert [r.seconds for r in again.ranks] == [r.seconds for r in report.ranks]
    assert [r.parts for r in again.ranks] == [r.parts for r in report.ranks]
    # a row-wise table whose blocks are not the planner's even split is named
    rw = next(tp for tp in report.plan.tables if len({s.row_offset for s in tp.shards}) > 1)
    first, second = sorted(rw.shards, key=lambda s: s.row_offset)[:2]
    moved = {first: dataclasses.replace(first, num_rows=first.num_rows - 1),
             second: dataclasses.replace(second, row_offset=second.row_offset - 1,
                                         num_rows=second.num_rows + 1)}
    odd = dataclasses.replace(rw, shards=tuple(moved.get(s, s) for s in rw.shards))
    bad = dataclasses.replace(report.plan, tables=tuple(odd if tp is rw else tp
                                                        for tp in report.plan.tables))
    with pytest.raises(PlanMismatchError, match=f"the shards of table '{rw.table}' are not "
                                                f"blocks the planner cuts"):
        evaluate_plan(bad, tables, hw, Workload(batch_size=65536))


def test_step_prices_a_plan_file_and_names_one_of_another_world(tmp_path, capsys):
    cfg = tmp_path / "train.toml"
    cfg.write_text('[tables]\npreset = "criteo-1tb"\n\n[train]\nbatch_size = 65536\n')
    plan = tmp_path / "plan.json"
    assert main(["plan", "--config", str(cfg), "--fabric", "zionex", "-n", "16",
                 "--ranks-per-node", "8", "--json", str(plan), "--summary"]) == 0
    capsys.readouterr()
    base = ["step", "--config", str(cfg), "--fabric", "zionex"]
    rc, planned, err = _simulate(capsys, *base, "-n", "16")
    assert rc == 0, err
    rc, given, err = _simulate(capsys, *base, "-n", "16", "--plan", str(plan))
    assert rc == 0, err
    assert given.splitlines()[2:] == planned.splitlines()[2:]  # the same plan, the same step
    rc, _, err = _simulate(capsys, *base, "-n", "32", "--plan", str(plan))
    assert rc == 2 and "the plan is for 16 ranks, the world has 32" in err
