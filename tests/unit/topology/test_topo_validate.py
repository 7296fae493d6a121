"""Validation rules, each seen passing and failing, and the deliberately broken host."""
from __future__ import annotations

import dataclasses

import pytest

from topology import ClusterTopology, load_spec, validate
from topology.spec import parse_spec
from topology.types import LinkKind, RankPlacement
from topology.validate import RULES, CheckStatus


def statuses(report, rule):
    return [c.status for c in report.checks if c.rule == rule]


def passes(report, rule):
    s = statuses(report, rule)
    return bool(s) and all(x is CheckStatus.PASS for x in s)


def fails(report, rule):
    return CheckStatus.FAIL in statuses(report, rule)


def failing(report, rule):
    return [c for c in report.checks if c.rule == rule and c.status is CheckStatus.FAIL]


def spec_with(**tables) -> object:
    """A DGX-A100-like spec with some tables replaced (TOML snippets)."""
    base = {"fabric": 'name = "custom"', "cluster": "nodes = 1",
            "node": 'gpus = 8\ngpu_model = "A100"\nmin_gpu_memory_gib = 40\nmin_cpus = 128',
            "nvlink": 'topology = "all-to-all"\nmin_lanes = 12\nmin_bandwidth_gbs = 300',
            "nic": 'count = 8\nlink_layer = "infiniband"\nmin_rate_gbps = 200\n'
                   'gpu_affinity = "one-per-gpu"\nmax_path = "PXB"\nnuma_local = true\n'
                   'gpudirect = true'}
    base.update(tables)
    text = "\n".join(f"[{k}]\n{v}" for k, v in base.items() if v is not None)
    return parse_spec(text, "custom.toml")


def test_good_dgx_a100_passes_every_rule(host):
    report = validate(host("dgx-a100"), load_spec("dgx-a100"))
    assert report.passed and not report.failures
    for rule in RULES[:-1]:
        assert passes(report, rule), rule
    assert statuses(report, "bandwidth") == [CheckStatus.SKIP] * 2


def test_cube_mesh_passes_its_own_preset(host):
    report = validate(host("dgx1-v100"), load_spec("dgx1-v100"))
    assert report.passed and passes(report, "nvlink-topology")


def test_cpu_host_passes_cpu_preset_and_fails_gpu_presets(host):
    assert validate(host("cpu-host"), load_spec("cpu-host")).passed
    report = validate(host("cpu-host"), load_spec("dgx-a100"))
    assert fails(report, "gpu-count") and fails(report, "nic-count") and fails(report, "cpus")
    (check,) = failing(report, "gpu-count")
    assert "CPU-only host" in check.found and check.host == "cpu-host-01"


def test_nodes_rule(host):
    assert passes(validate(host("dgx-a100"), load_spec("dgx-a100")), "nodes")
    (check,) = failing(validate(host("dgx-a100"), load_spec("zionex")), "nodes")
    assert check.expected == "16 hosts" and check.found.startswith("1 host")


def test_gpu_model_and_memory_rules(host):
    report = validate(host("dgx-a100"), load_spec("dgx-h100"))
    assert fails(report, "gpu-model") and passes(report, "gpu-memory")  # 80 GiB >= 80
    report = validate(host("dgx1-v100"), spec_with(node='gpus = 8\nmin_gpu_memory_gib = 40',
                                                    nvlink=None, nic=None))
    assert len(failing(report, "gpu-memory")) == 8
    assert failing(report, "gpu-memory")[0].found == "32 GiB"
    unknown = dataclasses.replace(host("dgx-a100"),
                                  gpus=tuple(dataclasses.replace(g, memory_bytes=None)
                                             for g in host("dgx-a100").gpus))
    assert statuses(validate(unknown, load_spec("dgx-a100")), "gpu-memory") == \
        [CheckStatus.SKIP] * 8


def test_nvlink_topology_rule(host):
    report = validate(host("dgx1-v100"), spec_with(nvlink='topology = "all-to-all"\nmin_lanes = 6',
                                                   node="gpus = 8", nic=None))
    (check,) = failing(report, "nvlink-topology")
    assert "no NVLink GPU0-GPU5" in check.found
    mesh = spec_with(nvlink='topology = "hybrid-cube-mesh"\nmin_lanes = 6', node="gpus = 8",
                     nic=None)
    assert passes(validate(host("dgx1-v100"), mesh), "nvlink-topology")
    (check,) = failing(validate(host("dgx-a100"), mesh), "nvlink-topology")
    assert "unexpected NVLink GPU0-GPU5" in check.found


def test_nvlink_lanes_and_bandwidth_rules(host):
    report = validate(host("dgx-a100-faulty"), load_spec("dgx-a100"))
    (lanes,) = failing(report, "nvlink-lanes")
    (bw,) = failing(report, "nvlink-bandwidth")
    assert (lanes.gpu, lanes.found) == (5, "10 links")
    assert bw.gpu == 5 and bw.found.startswith("250")
    assert len(statuses(report, "nvlink-lanes")) == 8


def test_nic_rules(host):
    report = validate(host("dgx-a100"), load_spec("dgx-h100"))
    assert passes(report, "nic-count") and passes(report, "nic-state")
    assert len(failing(report, "nic-rate")) == 8
    report = validate(host("dgx-a100"), load_spec("zionex"))  # wants RoCE, finds InfiniBand
    (count,) = failing(report, "nic-count")
    assert "2 RoCE ports" in count.found and "mlx5_0 (InfiniBand)" in count.found


def test_affinity_rule(host):
    tight = spec_with(nic='count = 8\nlink_layer = "ib"\nmin_rate_gbps = 200\n'
                          'gpu_affinity = "one-per-gpu"\nmax_path = "PIX"')
    report = validate(host("dgx-a100"), tight)
    assert len(failing(report, "gpu-nic-affinity")) == 8
    assert failing(report, "gpu-nic-affinity")[0].found == "mlx5_0 at PXB"
    loose = spec_with(nic='count = 4\nlink_layer = "ib"\nmin_rate_gbps = 100\nmax_path = "PIX"',
                      node="gpus = 8", nvlink=None)
    assert passes(validate(host("dgx1-v100"), loose), "gpu-nic-affinity")  # NICs shared


def test_numa_and_gpudirect_rules(host):
    report = validate(host("dgx-a100"), load_spec("zionex"))
    numa = failing(report, "nic-numa")
    assert numa and numa[0].found == "mlx5_4 on NUMA 2, GPU0 on NUMA 3"
    (gdr, *_) = failing(report, "gpudirect")
    assert "path SYS is beyond PXB" in gdr.found and gdr.nic == "mlx5_4"
    assert passes(validate(host("dgx-a100"), load_spec("dgx-a100")), "gpudirect")


def test_broken_cluster_reports_every_fault(host):
    """Missing NIC, downed port, NVLink lanes missing, GPUDirect off, NIC on the wrong NUMA."""
    report = validate(host("dgx-a100-faulty"), load_spec("dgx-a100"))
    assert not report.passed
    faults = {(c.rule, c.gpu, c.nic) for c in report.failures}
    assert ("nic-count", None, None) in faults                       # mlx5_7 is gone
    (count,) = failing(report, "nic-count")
    assert "7 InfiniBand ports" in count.found and "mlx5_7" not in count.found
    assert ("nic-state", None, "mlx5_3") in faults                   # port down
    assert ("nvlink-lanes", 5, None) in faults                       # GPU5 lost 2 links
    assert ("gpu-nic-affinity", 5, None) in faults                   # GPU5 has no NIC left
    assert any(r == "nic-numa" and nic == "mlx5_2" for r, _, nic in faults)
    gdr = failing(report, "gpudirect")
    assert len(gdr) == 7 and all("no peer-memory module" in c.found for c in gdr)
    assert all(c.host == "dgx-a100-07" for c in report.failures)
    text = report.format_text()
    for needle in ("FAIL    nic-count", "mlx5_3: port 1 DOWN", "GPU5: 10 links",
                   "mlx5_2 on NUMA 0, GPU3 on NUMA 1", "no peer-memory module"):
        assert needle in text, needle
    d = report.to_dict()
    assert d["passed"] is False and d["counts"]["fail"] == len(report.failures)


def test_faults_point_at_the_right_host_of_a_cluster(host):
    good, bad = host("dgx-a100"), host("dgx-a100-faulty")
    ranks = tuple(RankPlacement(r, (good, bad)[r // 8].hostname, r // 8, r % 8, r % 8)
                  for r in range(16))
    cluster = ClusterTopology((good, bad), ranks)
    report = validate(cluster, spec_with(cluster="nodes = 2"))
    assert passes(report, "nodes")
    assert {c.host for c in report.failures} == {"dgx-a100-07"}
    assert report.num_nodes == 2 and report.num_ranks == 16


def test_bandwidth_rule(host):
    spec = load_spec("cpu-host")
    h = host("cpu-host")
    report = validate(h, spec, {"shm": 5.0, LinkKind.TCP: 1.0, "allreduce_bus": 0.05},
                      measured_notes={"shm": "ranks 0->1"})
    (shm,) = [c for c in report.checks if c.subject.startswith("shm")]
    assert shm.status is CheckStatus.PASS and shm.found == "5 GB/s (ranks 0->1)"
    (ar,) = failing(report, "bandwidth")
    assert ar.subject == "allreduce bus bandwidth" and not report.passed
    skipped = validate(h, spec, {"allreduce_bus": 1.0},
                       measured_notes={"shm": "not measured: needs at least 2 ranks"})
    assert [c.status for c in skipped.checks if c.rule == "bandwidth"] == [
        CheckStatus.SKIP, CheckStatus.PASS]
    assert skipped.passed


@pytest.mark.parametrize("measured, match", [({"warp": 1.0}, "link classes"),
                                             ({"shm": -1.0}, "GB/s >= 0"),
                                             ({"shm": "fast"}, "GB/s >= 0")])
def test_bad_measurements(host, measured, match):
    with pytest.raises(ValueError, match=match):
        validate(host("cpu-host"), load_spec("cpu-host"), measured)


def test_bad_arguments(host):
    with pytest.raises(TypeError, match="topology: expected ClusterTopology"):
        validate({"hosts": []}, load_spec("cpu-host"))
    with pytest.raises(TypeError, match="spec: expected FabricSpec"):
        validate(host("cpu-host"), "cpu-host")
