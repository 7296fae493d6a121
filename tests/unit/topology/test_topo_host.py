"""Host discovery: probes merged into one HostTopology, warnings recorded."""
from __future__ import annotations

import warnings

import pytest

from topology import ProbeWarning, assign_nics, discover_host, fixture
from topology.types import LinkKind, PciPath


def test_dgx_a100(host):
    h = host("dgx-a100")
    assert h.hostname == "dgx-a100-01" and h.cpus == 256 and len(h.numa_nodes) == 8
    assert len(h.gpus) == 8 and all(g.nvlink_lanes == 12 for g in h.gpus) and h.nvswitch
    assert [g.numa for g in h.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert h.gpudirect_module == "nvidia_peermem"
    nv = [link for link in h.links if link.kind is LinkKind.NVLINK]
    assert len(nv) == 28 and all(link.bandwidth == 12 * 25e9 for link in nv)
    pair = h.pair(0, "mlx5_0")
    assert pair.path is PciPath.PXB and pair.gpudirect
    assert not h.pair(0, "mlx5_2").gpudirect  # SYS: too far for GPUDirect
    assert h.link("mlx5_4", "mlx5_5").path is PciPath.PIX
    assert {p.gpu: p.nic for p in assign_nics(h).values()} == {
        0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3", 4: "mlx5_6", 5: "mlx5_7",
        6: "mlx5_8", 7: "mlx5_9"}
    assert h.warnings == () and not h.cpu_only


def test_dgx1_cube_mesh(host):
    h = host("dgx1-v100")
    assert not h.nvswitch and all(g.nvlink_lanes == 6 for g in h.gpus)
    assert h.link("GPU0", "GPU3").lanes == 2 and h.link("GPU0", "GPU1").lanes == 1
    far = h.link("GPU0", "GPU5")
    assert far.kind is LinkKind.PCIE and far.path is PciPath.SYS
    assert [g.numa for g in h.gpus] == [0] * 4 + [1] * 4  # from the CPU Affinity column
    assert h.pair(1, "mlx5_0").path is PciPath.PIX and h.pair(1, "mlx5_1").path is PciPath.PHB
    assert h.gpudirect_module == "nv_peer_mem"
    # 4 NICs for 8 GPUs: only 4 GPUs get a NIC of their own
    assert len(assign_nics(h)) == 4


def test_faulty_host(host):
    h = host("dgx-a100-faulty")
    assert h.gpu(5).nvlink_lanes == 10 and h.gpu(4).nvlink_lanes == 12
    assert "mlx5_7" not in {n.name for n in h.nics}
    assert h.gpudirect_module == "" and not any(p.gpudirect for p in h.gpu_nic)


def test_cpu_only_host_says_so(host):
    h = host("cpu-host")
    assert h.cpu_only and h.gpus == () and h.nics == () and h.links[0].kind is LinkKind.TCP
    assert any("sys/class/infiniband: absent" in w for w in h.warnings)


def test_query_only_uses_sysfs_for_nic_paths():
    fx = fixture("dgx-a100")
    h = discover_host(fx.root, nvidia_smi_query=fx.nvidia_smi_query, live=False)
    assert h.sources == ("sysfs", "nvidia-smi --query-gpu")
    assert h.pair(0, "mlx5_0").path is PciPath.PXB and h.pair(0, "mlx5_6").path is PciPath.SYS
    assert h.links and not any(link.kind is LinkKind.NVLINK for link in h.links)


def test_warnings_are_emitted_and_recorded(fixture_copy, write_file):
    root = fixture_copy("dgx-a100")
    write_file(root / "sys/class/infiniband/mlx5_8/ports/1/rate", "garbage\n")
    fx = fixture("dgx-a100")
    bad_topo = fx.nvidia_smi_topo.replace("GPU6\tNV12", "GPU6\t???")
    with pytest.warns(ProbeWarning) as rec:
        h = discover_host(root, nvidia_smi_topo=bad_topo, nvidia_smi_query=fx.nvidia_smi_query,
                          live=False)
    messages = [str(w.message) for w in rec]
    assert any("mlx5_8/ports/1/rate: malformed rate" in m for m in messages)
    assert any(m.startswith("nvidia-smi topo -m: row GPU6") for m in messages)
    assert set(h.warnings) == set(messages)
    # the rest of discovery went on
    assert len(h.gpus) == 8 and len(h.nics) == 10 and h.nic("mlx5_8").rate_gbps == 0.0
    assert h.link("GPU0", "GPU1").lanes == 12


def test_matrix_nic_missing_from_sysfs_warns(fixture_copy):
    fx = fixture("dgx-a100")
    root = fixture_copy("dgx-a100")
    (root / "sys/class/infiniband/mlx5_9").unlink()
    with pytest.warns(ProbeWarning, match="lists NIC mlx5_9 that sysfs does not show"):
        h = discover_host(root, nvidia_smi_topo=fx.nvidia_smi_topo, live=False)
    assert len(h.nics) == 9


def test_live_host():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", ProbeWarning)
        h = discover_host("/")
    assert set(h.warnings) == {str(w.message) for w in rec if w.category is ProbeWarning}
    assert h.cpus >= 1 and h.hostname
    if not h.gpus:  # this development machine: nothing but CPUs
        assert h.cpu_only and any("nvidia-smi" in w or "NVML" in w for w in h.warnings)
