"""sysfs/procfs probes on the fixtures, and what they do with bad entries."""
from __future__ import annotations

import os

import pytest

from topology import ProbeWarning, fixture
from topology.sysfs import (classify_pci, pci_numa, pci_path, probe_cpus, probe_gpudirect,
                            probe_hostname, probe_net_interfaces, probe_numa, probe_rdma_nics)
from topology.types import LinkLayer, PciPath, PortState


def test_rdma_nics_of_dgx_a100():
    nics = probe_rdma_nics(fixture("dgx-a100").root)
    assert [n.name for n in nics] == [f"mlx5_{i}" for i in range(10)]
    n0 = nics[0]
    assert (n0.link_layer, n0.state, n0.rate_gbps, n0.numa, n0.port) == (
        LinkLayer.INFINIBAND, PortState.ACTIVE, 200.0, 3, 1)
    assert n0.pci_bus_id == "0000:0c:00.0"
    assert n0.pci_path[0] == "pci0000:00" and n0.pci_path[-1] == "0000:0c:00.0"
    storage = nics[4]
    assert storage.link_layer is LinkLayer.ETHERNET and storage.rate_gbps == 100.0
    assert storage.link_kind.value == "roce"


def test_rdma_nics_of_faulty_host():
    nics = {n.name: n for n in probe_rdma_nics(fixture("dgx-a100-faulty").root)}
    assert "mlx5_7" not in nics
    assert nics["mlx5_3"].state is PortState.DOWN and not nics["mlx5_3"].active
    assert nics["mlx5_2"].numa == 0


def test_no_infiniband_class_warns_and_finds_nothing():
    with pytest.warns(ProbeWarning, match=r"sys/class/infiniband: absent"):
        assert probe_rdma_nics(fixture("cpu-host").root) == ()


@pytest.mark.parametrize("entry, text, match, check", [
    ("rate", "fast\n", "malformed rate 'fast'", lambda n: n.rate_gbps == 0.0),
    ("state", "ACTIVE\n", "malformed port state", lambda n: n.state is PortState.UNKNOWN),
    ("state", "9: WEIRD\n", "malformed port state", lambda n: n.state is PortState.UNKNOWN),
])
def test_malformed_port_entries_warn_and_go_on(fixture_copy, write_file, entry, text, match, check):
    root = fixture_copy("dgx-a100")
    write_file(root / "sys/class/infiniband/mlx5_1/ports/1" / entry, text)
    with pytest.warns(ProbeWarning, match=match) as rec:
        nics = {n.name: n for n in probe_rdma_nics(root)}
    assert any("mlx5_1/ports/1/" + entry in str(w.message) for w in rec)
    assert len(nics) == 10 and check(nics["mlx5_1"])
    assert nics["mlx5_0"].rate_gbps == 200.0  # the others are untouched


def test_unknown_link_layer_skips_that_port(fixture_copy, write_file):
    root = fixture_copy("dgx-a100")
    write_file(root / "sys/class/infiniband/mlx5_2/ports/1/link_layer", "Token Ring\n")
    with pytest.warns(ProbeWarning, match="unknown link layer 'Token Ring'"):
        names = [n.name for n in probe_rdma_nics(root)]
    assert "mlx5_2" not in names and len(names) == 9


def test_unreadable_entry_warns_naming_it(fixture_copy):
    root = fixture_copy("dgx-a100")
    rate = root / "sys/class/infiniband/mlx5_6/ports/1/rate"
    rate.unlink()
    rate.mkdir()  # reading a directory fails like an unreadable file
    with pytest.warns(ProbeWarning, match=r"mlx5_6/ports/1/rate: unreadable"):
        nics = {n.name: n for n in probe_rdma_nics(root)}
    assert nics["mlx5_6"].rate_gbps == 0.0 and nics["mlx5_6"].active


def test_nic_without_device_symlink_uses_uevent(tmp_path):
    # a tree copied without its symlinks: the PCI address still comes from uevent
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    for name, text in (("link_layer", "Ethernet"), ("state", "4: ACTIVE"),
                       ("rate", "100 Gb/sec (2X HDR)")):
        (port / name).write_text(text + "\n")
    device = tmp_path / "sys/class/infiniband/mlx5_0/device"
    device.mkdir()
    (device / "uevent").write_text("DRIVER=mlx5_core\nPCI_SLOT_NAME=0000:0c:00.0\n")
    (device / "numa_node").write_text("-1\n")
    (nic,) = probe_rdma_nics(tmp_path)
    assert nic.pci_bus_id == "0000:0c:00.0" and nic.pci_path == () and nic.numa is None
    assert nic.link_layer is LinkLayer.ETHERNET and nic.rate_gbps == 100.0


def test_numa_and_cpus():
    root = fixture("dgx-a100").root
    nodes = probe_numa(root)
    assert [n.id for n in nodes] == list(range(8))
    assert nodes[3].cpus == tuple(range(48, 64)) + tuple(range(176, 192))
    assert nodes[0].memory_bytes == 131899292 * 1024
    assert probe_cpus(root) == 256
    assert probe_cpus(fixture("cpu-host").root) == 32


def test_numa_absent_and_malformed(tmp_path, fixture_copy, write_file):
    with pytest.warns(ProbeWarning, match="NUMA layout unknown"):
        assert probe_numa(tmp_path) == ()
    root = fixture_copy("cpu-host")
    write_file(root / "sys/devices/system/node/node1/cpulist", "8-x\n")
    with pytest.warns(ProbeWarning, match="node1/cpulist: malformed CPU list"):
        nodes = probe_numa(root)
    assert nodes[0].cpus and nodes[1].cpus == ()


def test_live_host_probes_run():
    nodes = probe_numa("/")
    assert probe_cpus("/") >= 1 and probe_hostname("/")
    assert all(n.cpus for n in nodes)


@pytest.mark.parametrize("name, module", [("dgx-a100", "nvidia_peermem"),
                                          ("dgx1-v100", "nv_peer_mem"),
                                          ("dgx-a100-faulty", ""), ("cpu-host", "")])
def test_gpudirect_module(name, module):
    assert probe_gpudirect(fixture(name).root) == module


def test_gpudirect_from_sys_module_and_memory_peers(tmp_path):
    (tmp_path / "sys/module/mlx5_ib").mkdir(parents=True)
    with pytest.warns(ProbeWarning, match="proc/modules: absent; GPUDirect RDMA looked up in "
                                          "sys/module only"):
        assert probe_gpudirect(tmp_path) == ""
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    assert probe_gpudirect(tmp_path) == "nvidia_peermem"
    other = tmp_path / "other"
    (other / "sys/kernel/mm/memory_peers/nv_mem").mkdir(parents=True)
    (other / "sys/kernel/mm/memory_peers/nv_mem/version").write_text("1.1-0\n")
    (other / "proc").mkdir()
    (other / "proc/modules").write_text("mlx5_ib 462848 0 - Live 0x0000000000000000\n")
    assert probe_gpudirect(other) == "nv_peer_mem"
    with pytest.warns(ProbeWarning, match="GPUDirect RDMA status unknown"):
        assert probe_gpudirect(tmp_path / "empty") == ""


def test_hostname():
    assert probe_hostname(fixture("dgx1-v100").root) == "dgx1-v100-03"


def test_hostname_absent_warns(tmp_path):
    with pytest.warns(ProbeWarning, match="host name unknown"):
        assert probe_hostname(tmp_path) == "unknown"


def test_net_interfaces_skip_virtual_and_read_speed():
    ifs = probe_net_interfaces(fixture("cpu-host").root)
    assert [(i.name, i.speed_gbps, i.state) for i in ifs] == [("eno1", 25.0, "up"),
                                                              ("eno2", None, "down")]


def test_pci_paths_and_classes():
    root = fixture("dgx-a100").root
    gpu0 = pci_path(root, "00000000:07:00.0")
    assert gpu0[0] == "pci0000:00" and gpu0[-1] == "0000:07:00.0"
    assert pci_numa(root, "0000:07:00.0") == 3
    assert pci_path(root, "not-a-bus") == () and pci_path(root, "0000:ff:00.0") == ()
    nic0 = probe_rdma_nics(root)[0].pci_path
    assert classify_pci(gpu0, nic0, 3, 3) is PciPath.PXB
    gpu2 = pci_path(root, "0000:47:00.0")
    assert classify_pci(gpu0, gpu2, 3, 1) is PciPath.SYS
    assert classify_pci(gpu0, gpu2, 3, 3) is PciPath.NODE
    assert classify_pci(gpu0, ()) is None


def test_pci_classes_pix_phb():
    a = ("pci0000:00", "0000:00:02.0", "0000:02:00.0", "0000:03:04.0", "0000:05:00.0")
    b = ("pci0000:00", "0000:00:02.0", "0000:02:00.0", "0000:03:08.0", "0000:06:00.0")
    c = ("pci0000:00", "0000:00:03.0", "0000:08:00.0", "0000:09:04.0", "0000:0c:00.0")
    f0 = ("pci0000:5e", "0000:5e:03.1", "0000:61:00.0")
    f1 = ("pci0000:5e", "0000:5e:03.1", "0000:61:00.1")
    assert classify_pci(a, b) is PciPath.PIX
    assert classify_pci(a, c) is PciPath.PHB
    assert classify_pci(f0, f1) is PciPath.PIX
    assert os.path.sep == "/"
