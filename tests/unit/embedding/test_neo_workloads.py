"""Neo's DLRM workloads (embedding.neo) and `neocomm simulate zionex`."""
from __future__ import annotations

import json

import pytest

from embedding import neo
from embedding.simulate import predict_workload
from embedding.planner.tables import preset_tables
from embedding.presets import preset_names, table_rows
from embedding.simulate import dense_flops_per_sample
from neocomm.cli import main


@pytest.mark.parametrize("name", sorted(neo.MODELS))
def test_workloads_hold_the_published_parameters_and_flops(name):
    """Tables plus dense layers hold the published parameter count, the dense forward the
    published MFLOPS per sample, and the tables the published dims and pooling."""
    m = neo.model(name)
    assert neo.num_parameters(m) == pytest.approx(m.parameters, rel=1e-3)
    dense = neo.dense_config(m)
    assert dense_flops_per_sample(dense) / 1e6 == pytest.approx(m.mflops_per_sample, rel=0.02)
    shapes = dense.layer_shapes()
    assert len(shapes) == m.mlp_layers
    assert sum(o for _, _, o in shapes) / len(shapes) == pytest.approx(m.mlp_width, rel=0.01)
    tables, constraints = preset_tables(m.preset)
    dims = [t.dim for t in tables]
    assert len(tables) == m.num_tables
    assert (min(dims), max(dims)) == (m.dim_min, m.dim_max)
    assert sum(dims) / len(dims) == pytest.approx(m.dim_avg, abs=0.5)
    assert {c.ids_per_sample for c in constraints.values()} == {m.pooling}
    assert {t.dtype for t in tables} == {m.dtype}
    assert {t.optimizer.kind.value for t in tables} == {"rowwise_adagrad"}


def test_workload_names_and_refusals():
    assert {"neo-model-a", "neo-model-f", "neo-model-i"} <= set(preset_names())
    assert neo.model("neo-model-i") is neo.model("model-i")
    with pytest.raises(ValueError, match=r"workload: expected one of .* got 'model-z'"):
        neo.model("model-z")
    with pytest.raises(ValueError, match=r"'neo-model-a' is a planner-only table set"):
        table_rows("neo-model-a")


def test_the_prediction_is_the_simulators_step():
    """predict() prices the planner's plan with estimate_step: the step is the sum of its
    visible parts, the throughput the global batch over it, more ranks more samples/s."""
    m = neo.model("model-i")
    small = predict_workload(m, 8, host_memory=2 << 40)
    large = predict_workload(m, 64)
    for p, n in ((small, 8), (large, 64)):
        assert p.global_batch == m.local_batch * n
        assert p.step.step_seconds == pytest.approx(sum(t for _, t in p.step.parts))
        assert p.samples_per_second == pytest.approx(p.global_batch / p.step.step_seconds)
    assert small.tiered > 0 and small.host_bytes > 0  # 332B parameters exceed 8 GPUs
    assert large.tiered == 0 and large.host_bytes == 0
    assert large.samples_per_second > small.samples_per_second


def _zionex(capsys, *argv):
    rc = main(["simulate", "zionex", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_command_prints_and_writes_the_predictions(capsys, tmp_path):
    path = tmp_path / "zx.json"
    rc, out, _ = _zionex(capsys, "--workload", "model-i", "--ranks", "64,128",
                         "--json", str(path))
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["kind"] == "neocomm-simulate-zionex"
    rows = data["rows"]
    assert [(r["workload"], r["ranks"]) for r in rows] == [("model-i", 64), ("model-i", 128)]
    m = neo.model("model-i")
    expect = predict_workload(m, 128)
    got = rows[1]["predicted"]
    assert got["samples_per_second"] == pytest.approx(expect.samples_per_second)
    assert got["parts"] == pytest.approx(dict(expect.step.parts))
    assert rows[1]["reported_samples_per_second"] == m.reported_qps
    assert rows[1]["ratio"] == pytest.approx(expect.samples_per_second / m.reported_qps)
    assert rows[0]["reported_samples_per_second"] is None  # the paper reports 128 GPUs
    assert f"{expect.samples_per_second:,.0f}" in out and f"{m.reported_qps:,.0f}" in out
    assert "model-i" in out and "not checked against a stored copy" in out


@pytest.mark.parametrize("argv, message", [
    (["--workload", "model-q"], "--workload: expected one of ['model-a', 'model-f', "
                                "'model-i'], got 'model-q'"),
    (["--workload", "model-i", "--ranks", "0"], "--ranks: expected rank counts like 64,128, "
                                                "got '0'"),
    (["--workload", "model-i", "--ranks", "8", "--host-memory", "lots"], "lots"),
])
def test_the_command_refuses_bad_input_naming_it(capsys, argv, message):
    try:
        rc, _, err = _zionex(capsys, *argv)
    except SystemExit as exc:  # argparse refuses a size it cannot read
        rc, err = exc.code, capsys.readouterr().err
    assert rc == 2
    assert message in err
