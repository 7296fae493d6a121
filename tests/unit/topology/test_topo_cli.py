"""`neocomm topo` and `neocomm fabric` in one process (no MPI launcher)."""
from __future__ import annotations

import json

import pytest

from neocomm.cli import main
from topology import fixture


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(key, raising=False)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_topo_on_this_host(capsys):
    rc, out, _ = run(capsys, "topo")
    assert rc == 0 and out.startswith("cluster: 1 host, 1 node, 1 rank")
    assert "Link model" in out and "shm" in out
    if "GPUs:" not in out:  # a CPU-only development machine
        assert "CPU-only host: no NVIDIA GPU found" in out


def test_topo_renders_a_fixture_like_nvidia_smi(capsys):
    rc, out, _ = run(capsys, "topo", "--fixture", "dgx-a100")
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("GPU0  GPU1"))
    assert header.split()[-3:] == ["Affinity", "NUMA", "Affinity"]
    gpu5 = next(line for line in lines if line.startswith("GPU5  NV12"))
    assert gpu5.split()[6] == "X" and "112-127,240-255" in gpu5
    assert "  NIC7: mlx5_7" in out and "mlx5_4  1     Ethernet (RoCE)" in out
    assert "GPUDirect RDMA: nvidia_peermem loaded" in out
    assert "0     dgx-a100-01  0     0      GPU0  mlx5_0" in out


def test_topo_json_round_trips_and_warns_on_stderr(capsys, tmp_path):
    rc, out, err = run(capsys, "topo", "--json", "--fixture", "cpu-host")
    assert rc == 0
    doc = json.loads(out)
    assert doc["type"] == "ClusterTopology" and doc["hosts"][0]["hostname"] == "cpu-host-01"
    assert "warning: cpu-host-01: sysfs" in err


def test_topo_from_captured_files(capsys, tmp_path):
    fx = fixture("dgx1-v100")
    topo, query = tmp_path / "topo.txt", tmp_path / "query.csv"
    topo.write_text(fx.nvidia_smi_topo)
    query.write_text(fx.nvidia_smi_query)
    rc, out, _ = run(capsys, "topo", "--sysfs-root", str(fx.root), "--nvidia-smi-topo", str(topo),
                     "--nvidia-smi-query", str(query))
    assert rc == 0 and "Tesla V100-SXM2-32GB" in out and "NVSwitch: no" in out


@pytest.mark.parametrize("argv, match", [
    (["--fixture", "dgx-z"], "--fixture: expected one of"),
    (["--sysfs-root", "/nonexistent/root"], "not a directory"),
    (["--nvidia-smi-topo", "/nonexistent/topo.txt"], "cannot read"),
])
def test_topo_bad_sources_exit_2(capsys, argv, match):
    rc, _, err = run(capsys, "topo", *argv)
    assert rc == 2 and match in err


def test_validate_this_host_against_cpu_preset(capsys):
    rc, out, _ = run(capsys, "fabric", "validate", "cpu-host")
    if "CPU-only" in out or "0 GPUs" in out:
        assert rc == 0 and "PASS:" in out
    else:  # pragma: no cover - a GPU machine is no CPU-only host
        assert rc == 1


def test_validate_fixtures_exit_codes(capsys):
    rc, out, _ = run(capsys, "fabric", "validate", "dgx-a100", "--fixture", "dgx-a100")
    assert rc == 0 and out.rstrip().endswith("0 failed, 2 skipped")
    rc, out, _ = run(capsys, "fabric", "validate", "dgx-a100", "--fixture", "dgx-a100-faulty")
    assert rc == 1 and "FAIL dgx-a100-07 mlx5_3: port 1 DOWN" in out
    rc, out, _ = run(capsys, "fabric", "validate", "dgx1-v100", "--fixture", "dgx1-v100", "--json")
    report = json.loads(out)
    assert rc == 0 and report["passed"] and report["counts"]["fail"] == 0


def test_validate_a_broken_topology_file(capsys, tmp_path):
    rc, out, _ = run(capsys, "topo", "--json", "--fixture", "dgx-a100-faulty")
    path = tmp_path / "broken.json"
    path.write_text(out)
    rc, out, _ = run(capsys, "fabric", "validate", "dgx-a100", "--topology", str(path), "--json")
    assert rc == 1
    faults = {(c["rule"], c["gpu"], c["nic"]) for c in json.loads(out)["checks"]
              if c["status"] == "fail"}
    assert {("nic-count", None, None), ("nic-state", None, "mlx5_3"), ("nvlink-lanes", 5, None),
            ("gpudirect", 0, "mlx5_0"), ("nic-numa", 3, "mlx5_2")} <= faults


def test_invalid_spec_exits_2_naming_file_and_key(capsys, tmp_path):
    spec = tmp_path / "typo.toml"
    spec.write_text('[fabric]\nname = "x"\n[cluster]\nnodes = 1\n[node]\ngpus = 0\ngpu = 3\n')
    rc, out, err = run(capsys, "fabric", "validate", str(spec), "--fixture", "cpu-host")
    assert rc == 2 and out == ""
    assert f"invalid spec: {spec}: [node] gpu: unknown key" in err
    rc, _, err = run(capsys, "fabric", "validate", "no-such-preset")
    assert rc == 2 and "not a preset" in err


@pytest.mark.parametrize("text, match", [
    ("{not json", "not JSON"),
    ('{"format": 1, "type": "ClusterTopology", "hosts": [{"cpus": 2}]}', "hostname: missing"),
    ('{"format": 1, "type": "HostTopology", "hostname": "h", "gpus": [{"index": "zero"}]}',
     "gpus[0].index"),
])
def test_invalid_topology_file_exits_2(capsys, tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    rc, _, err = run(capsys, "fabric", "validate", "cpu-host", "--topology", str(path))
    assert rc == 2 and match in err and str(path) in err


def test_host_topology_file_is_accepted(capsys, tmp_path):
    path = tmp_path / "h.json"
    path.write_text('{"format": 1, "type": "HostTopology", "hostname": "h", "cpus": 4}')
    rc, out, _ = run(capsys, "fabric", "validate", "cpu-host", "--topology", str(path))
    assert rc == 0 and "topology: 1 host (h)" in out


@pytest.mark.parametrize("argv, match", [
    (["validate"], "validate needs SPEC"),
    (["validate", "cpu-host", "--measure", "--topology", "x.json"], "cannot be combined"),
    (["validate", "cpu-host", "--iters", "0"], "--iters must be >= 1"),
    (["validate", "cpu-host", "--topology", "/nonexistent.json"], "invalid topology file"),
])
def test_bad_fabric_options_exit_2(capsys, argv, match):
    rc, _, err = run(capsys, "fabric", *argv)
    assert rc == 2 and match in err


def test_presets_listing(capsys):
    """Each preset `fabric presets` lists is a spec `fabric validate` takes by that name,
    described as its file describes it: the fixture host it describes passes it, and a
    CPU-only host fails every preset that asks for GPUs."""
    from topology.snapshot import fixture_names
    from topology.spec import load_spec

    rc, out, _ = run(capsys, "fabric", "presets")
    assert rc == 0
    listed = dict(line.split(None, 1) for line in out.splitlines())
    assert {"cpu-host", "dgx-a100", "dgx1-v100", "zionex"} <= set(listed)
    for name, description in listed.items():
        spec = load_spec(name)
        assert description == spec.description, name
        rc, out, err = run(capsys, "fabric", "validate", name, "--fixture", "cpu-host")
        assert rc == (1 if spec.gpus else 0), (name, rc, out, err)
        if name in fixture_names():
            rc, out, _ = run(capsys, "fabric", "validate", name, "--fixture", name)
            assert rc == 0 and " 0 failed" in out, (name, out)
