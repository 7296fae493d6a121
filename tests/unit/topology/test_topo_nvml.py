"""The NVML probe against fake NVML modules (no GPU here)."""
from __future__ import annotations

import sys

import pytest

from topology import ProbeWarning, discover_host, fixture
from topology.nvml import probe_nvml
from topology.types import LinkKind, PciPath


def test_nvswitch_host(fake_nvml):
    nvml = fake_nvml.a100()
    info = probe_nvml(nvml)
    assert nvml.shutdown_called
    assert [g.pci_bus_id for g in info.gpus][:2] == ["0000:07:00.0", "0000:0f:00.0"]
    assert info.gpus[0].memory_bytes == 80 << 30 and info.gpus[0].name.startswith("NVIDIA A100")
    assert info.nvswitch and set(info.lanes.values()) == {12}
    assert len(info.nvlink) == 28 and set(info.nvlink.values()) == {12}
    assert info.pcie[(0, 1)] is PciPath.PXB and info.pcie[(0, 7)] is PciPath.SYS


def test_nvswitch_without_p2p_has_no_gpu_pairs(fake_nvml):
    info = probe_nvml(fake_nvml.a100(p2p_ok=False))
    assert info.nvswitch and info.nvlink == {}


def test_cube_mesh_host(fake_nvml):
    info = probe_nvml(fake_nvml.dgx1())
    assert not info.nvswitch and set(info.lanes.values()) == {6}
    assert info.nvlink == fake_nvml.cube
    assert info.pcie[(0, 1)] is PciPath.PIX


def test_down_links_are_not_counted(fake_nvml):
    info = probe_nvml(fake_nvml.a100(down_links=[(5, 0), (5, 1)]))
    assert info.lanes[5] == 10 and info.nvlink[(0, 5)] == 10 and info.nvlink[(0, 1)] == 12


def test_nvml_absent_warns(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.warns(ProbeWarning, match=r"NVML \(nvidia-ml-py\): module pynvml is not installed"):
        assert probe_nvml() is None


def test_nvml_without_driver_warns(fake_nvml):
    with pytest.warns(ProbeWarning, match="nvmlInit failed .*Driver Not Loaded"):
        assert probe_nvml(fake_nvml.a100(fail_init=True)) is None


def test_failing_call_warns_and_goes_on(fake_nvml):
    nvml = fake_nvml.dgx1()

    def broken(h):
        raise RuntimeError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = broken
    with pytest.warns(ProbeWarning, match="nvmlDeviceGetMemoryInfo failed .GPU is lost"):
        info = probe_nvml(nvml)
    assert len(info.gpus) == 8 and info.gpus[0].memory_bytes is None


def test_host_discovery_through_nvml(fake_nvml):
    # NVML for the GPUs, the DGX A100 snapshot for NICs and NUMA, no nvidia-smi at all
    h = discover_host(fixture("dgx-a100").root, nvml=fake_nvml.a100(), live=False)
    assert "nvml" in h.sources and "nvidia-smi topo -m" not in h.sources
    assert h.nvswitch and [g.numa for g in h.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert h.link("GPU0", "GPU7").kind is LinkKind.NVLINK and h.link("GPU0", "GPU7").lanes == 12
    # GPU-NIC classes come from the sysfs PCI paths and agree with nvidia-smi's matrix
    with_smi = discover_host(fixture("dgx-a100").root, live=False,
                             nvidia_smi_topo=fixture("dgx-a100").nvidia_smi_topo)
    assert {(p.gpu, p.nic): p.path for p in h.gpu_nic} == \
           {(p.gpu, p.nic): p.path for p in with_smi.gpu_nic}
