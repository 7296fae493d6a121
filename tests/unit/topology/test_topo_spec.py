"""Fabric specs: presets, and every kind of bad input naming file, key and problem."""
from __future__ import annotations

import pytest

from topology import SpecError, load_spec, preset_names
from topology.spec import parse_spec
from topology.types import LinkLayer, PciPath

GOOD = """
[fabric]
name = "t"
[cluster]
nodes = 2
[node]
gpus = 8
gpu_model = "A100"
[nvlink]
topology = "all-to-all"
min_lanes = 12
[nic]
count = 8
link_layer = "roce"
min_rate_gbps = 200
gpu_affinity = "one-per-gpu"
max_path = "pxb"
numa_local = true
gpudirect = true
[bandwidth]
roce = 20
allreduce_bus = 10.5
"""


def test_presets():
    assert {"zionex", "dgx-a100", "dgx-h100", "cpu-host"} <= set(preset_names())
    z = load_spec("zionex")
    assert (z.nodes, z.gpus, z.gpu_model) == (16, 8, "A100")
    assert z.nvlink.topology == "all-to-all" and z.nvlink.min_lanes == 12
    assert z.nic.link_layer is LinkLayer.ETHERNET and z.nic.min_rate_gbps == 200
    assert z.nic.gpu_affinity == "one-per-gpu" and z.nic.gpudirect and z.nic.numa_local
    h = load_spec("dgx-h100")
    assert h.nvlink.min_lanes == 18 and h.nic.min_rate_gbps == 400
    assert h.nic.link_layer is LinkLayer.INFINIBAND
    cpu = load_spec("cpu-host")
    assert cpu.gpus == 0 and cpu.nvlink is None and cpu.nic is None
    assert cpu.min_bandwidth["shm"] > 0


def test_good_spec_from_a_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(GOOD)
    spec = load_spec(str(path))
    assert spec.source == str(path) and spec.nic.max_path is PciPath.PXB
    assert spec.min_bandwidth == {"roce": 20.0, "allreduce_bus": 10.5}


def _bad(text: str, tmp_path) -> SpecError:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert str(path) in str(err.value)
    return err.value


@pytest.mark.parametrize("edit, key, problem", [
    (("min_lanes = 12", "min_lanes = 12\nlanes = 3"), "[nvlink] lanes", "unknown key"),
    (("[bandwidth]", "[bandwidth]\nethernet = 3"), "[bandwidth] ethernet", "unknown key"),
    (("[cluster]", "[clusters]"), "[clusters]", "unknown table"),
    (("nodes = 2", "nodes = \"two\""), "[cluster] nodes", "expected an integer, got str"),
    (("nodes = 2", "nodes = 2.0"), "[cluster] nodes", "expected an integer, got float"),
    (("numa_local = true", "numa_local = 1"), "[nic] numa_local", "expected true or false"),
    (("min_rate_gbps = 200", "min_rate_gbps = true"), "[nic] min_rate_gbps", "expected a number"),
    (("roce = 20", "roce = \"fast\""), "[bandwidth] roce", "expected a number"),
    (("min_lanes = 12", ""), "[nvlink] min_lanes", "missing required key"),
    (("count = 8", ""), "[nic] count", "missing required key"),
    (('name = "t"', ""), "[fabric] name", "missing required key"),
    (("nodes = 2", "nodes = 0"), "[cluster] nodes", "must be >= 1"),
    (("gpus = 8", "gpus = -1"), "[node] gpus", "must be >= 0"),
    (("min_lanes = 12", "min_lanes = 24"), "[nvlink] min_lanes", "no GPU has more"),
    (("min_rate_gbps = 200", "min_rate_gbps = 0"), "[nic] min_rate_gbps", "must be in (0, 1600]"),
    (("min_rate_gbps = 200", "min_rate_gbps = 4000"), "[nic] min_rate_gbps", "must be in"),
    (("roce = 20", "roce = -5"), "[bandwidth] roce", "must be > 0"),
    (('link_layer = "roce"', 'link_layer = "fddi"'), "[nic] link_layer", "expected one of"),
    (('max_path = "pxb"', 'max_path = "far"'), "[nic] max_path", "expected one of"),
    (('topology = "all-to-all"', 'topology = "ring"'), "[nvlink] topology", "expected one of"),
    (("count = 8", "count = 4"), "[nic] count", "one-per-gpu affinity needs at least 8"),
    (('topology = "all-to-all"', 'topology = "hybrid-cube-mesh"'), None, None),
])
def test_bad_specs_name_file_key_and_problem(tmp_path, edit, key, problem):
    old, new = edit
    assert old in GOOD
    text = GOOD.replace(old, new, 1)
    if key is None:  # a control: the edit alone is valid
        path = tmp_path / "ok.toml"
        path.write_text(text)
        assert load_spec(str(path)).nvlink.topology == "hybrid-cube-mesh"
        return
    err = _bad(text, tmp_path)
    assert err.key == key, str(err)
    assert problem in err.problem, str(err)


@pytest.mark.parametrize("edit, key, problem", [
    (("gpus = 8", "gpus = 4"), "[nvlink] topology", "exactly 8 GPUs"),
    (("gpus = 8", "gpus = 1"), "[nvlink]", "at least 2 GPUs"),
])
def test_impossible_combinations(tmp_path, edit, key, problem):
    text = GOOD.replace('topology = "all-to-all"', 'topology = "hybrid-cube-mesh"').replace(*edit)
    err = _bad(text, tmp_path)
    assert err.key == key and problem in err.problem


def test_cpu_only_spec_rejects_gpu_requirements(tmp_path):
    base = '[fabric]\nname = "c"\n[cluster]\nnodes = 1\n[node]\ngpus = 0\n'
    nic = '[nic]\ncount = 1\nlink_layer = "ib"\nmin_rate_gbps = 100\ngpudirect = true\n'
    err = _bad(base + nic, tmp_path)
    assert err.key == "[nic] gpudirect" and "requires GPUs" in err.problem
    err = _bad(base.replace("gpus = 0", 'gpus = 0\ngpu_model = "A100"'), tmp_path)
    assert err.key == "[node] gpu_model"


def test_missing_table_and_bad_toml(tmp_path):
    err = _bad('[fabric]\nname = "x"\n[node]\ngpus = 0\n', tmp_path)
    assert err.key == "[cluster]" and "missing required table" in err.problem
    err = _bad("[fabric\nname=", tmp_path)
    assert "not valid TOML" in err.problem
    err = _bad('[fabric]\nname = "x"\ncluster = 3\n[cluster]\nnodes=1\n[node]\ngpus=0\n', tmp_path)
    assert err.key == "[fabric] cluster"


def test_unknown_preset_and_wrong_table_type(tmp_path):
    with pytest.raises(SpecError, match="not a preset .presets: cpu-host"):
        load_spec("zionix")
    with pytest.raises(SpecError, match=r"\[node\]: expected a table"):
        parse_spec('node = 3\n[fabric]\nname="x"\n[cluster]\nnodes=1\n', "inline.toml")
