"""Parsers of `nvidia-smi topo -m` and `nvidia-smi --query-gpu` output."""
from __future__ import annotations

import pytest

from topology import ProbeWarning, fixture
from topology.smi import capture, parse_query_gpu, parse_topo_matrix


def test_modern_matrix_with_nic_legend():
    m = parse_topo_matrix(fixture("dgx-a100").nvidia_smi_topo)
    assert m.gpu_labels == [f"GPU{i}" for i in range(8)]
    assert m.nic_labels == [f"NIC{i}" for i in range(10)]
    assert m.nic_name("NIC7") == "mlx5_7"
    assert m.cells[("GPU0", "GPU5")] == "NV12"
    assert m.cells[("GPU0", "NIC0")] == "PXB" and m.cells[("GPU0", "NIC2")] == "SYS"
    assert m.cells[("NIC4", "NIC5")] == "PIX"
    assert m.cpu_affinity["GPU2"] == "16-31,144-159"
    assert m.numa == {"GPU0": 3, "GPU1": 3, "GPU2": 1, "GPU3": 1, "GPU4": 7, "GPU5": 7,
                      "GPU6": 5, "GPU7": 5}


def test_older_matrix_names_nics_and_has_no_numa_column():
    m = parse_topo_matrix(fixture("dgx1-v100").nvidia_smi_topo)
    assert m.nic_labels == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert m.nic_name("mlx5_2") == "mlx5_2"
    assert m.cells[("GPU0", "GPU3")] == "NV2" and m.cells[("GPU0", "GPU5")] == "SYS"
    assert m.cells[("GPU0", "mlx5_1")] == "PHB"
    assert m.cpu_affinity["GPU4"] == "20-39,60-79" and set(m.numa.values()) == {None}


def test_space_aligned_copy_parses_the_same():
    text = fixture("dgx-a100").nvidia_smi_topo
    spaced = text.expandtabs(8)  # as pasted from a terminal
    a, b = parse_topo_matrix(text), parse_topo_matrix(spaced)
    assert a.cells == b.cells and a.numa == b.numa and a.nic_names == b.nic_names


def test_missing_tabs_between_labels_and_cells_are_recovered():
    # some drivers print "NIC8NIC9" in the header and "NODENODE" in rows
    text = ("\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV18\tPXBNODE\t0-55\t0\t\tN/A\n"
            "GPU1\tNV18\t X \tNODEPXB\t0-55\t0\t\tN/A\n"
            "NIC0\tPXB\tNODE\t X \tNODE\n"
            "NIC1\tNODE\tPXB\tNODE\t X \n\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n")
    text = text.replace("NIC0\tNIC1\tCPU", "NIC0NIC1\tCPU")
    with _no_warning():
        m = parse_topo_matrix(text)
    assert m.labels == ("GPU0", "GPU1", "NIC0", "NIC1")
    assert m.cells[("GPU0", "NIC1")] == "NODE" and m.cells[("GPU1", "NIC1")] == "PXB"


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", ProbeWarning)

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


def test_malformed_rows_warn_and_are_skipped():
    text = fixture("dgx-a100").nvidia_smi_topo.replace("GPU3\tNV12\tNV12\tNV12",
                                                        "GPU3\tNV12\tQQQ\tNV12")
    with pytest.warns(ProbeWarning) as rec:
        m = parse_topo_matrix(text)
    messages = [str(w.message) for w in rec]
    assert any(m.startswith("nvidia-smi topo -m: row GPU3: expected 18 cells") for m in messages)
    assert "nvidia-smi topo -m: no valid row for ['GPU3']" in messages
    assert ("GPU3", "GPU0") not in m.cells and m.cells[("GPU0", "GPU3")] == "NV12"
    short = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV4\n"
    with pytest.warns(ProbeWarning) as rec:
        parse_topo_matrix(short)
    assert any("row GPU1" in str(w.message) for w in rec)


def test_not_a_matrix_warns():
    with pytest.warns(ProbeWarning, match="no header row with GPU0"):
        text = "Failed to initialize NVML: Driver/library version mismatch\n"
        assert parse_topo_matrix(text).labels == ()
    with pytest.warns(ProbeWarning, match="no GPU found"):
        parse_topo_matrix("No devices were found\n")


def test_nic_without_legend_entry_warns():
    text = fixture("dgx-a100").nvidia_smi_topo.replace("  NIC9: mlx5_9\n", "")
    with pytest.warns(ProbeWarning, match="NIC9 has no entry in the NIC Legend"):
        m = parse_topo_matrix(text)
    assert m.nic_name("NIC9") == "NIC9"


def test_query_gpu_csv():
    gpus = parse_query_gpu(fixture("dgx-a100").nvidia_smi_query)
    assert len(gpus) == 8
    g = gpus[2]
    assert (g.index, g.name, g.pci_bus_id, g.memory_bytes) == (
        2, "NVIDIA A100-SXM4-80GB", "0000:47:00.0", 81920 << 20)
    assert g.uuid.startswith("GPU-")


def test_query_gpu_other_column_order_and_na():
    text = ("name, index, memory.total [MiB], pci.bus_id\n"
            "Tesla V100-SXM2-16GB, 0, [N/A], 00000000:06:00.0\n")
    (g,) = parse_query_gpu(text)
    assert (g.index, g.name, g.memory_bytes, g.uuid) == (0, "Tesla V100-SXM2-16GB", None, "")


@pytest.mark.parametrize("text, match", [
    ("", "empty output"),
    ("GPU 0: NVIDIA A100 (UUID: GPU-x)\n", "no 'index' column"),
    ("index, name\nzero, A100\n", "line 2: malformed row"),
    ("index, name, memory.total [MiB]\n0, A100, lots\n", "malformed memory.total"),
])
def test_query_gpu_malformed(text, match):
    with pytest.warns(ProbeWarning, match=match):
        parse_query_gpu(text)


def test_capture_without_nvidia_smi_warns(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.warns(ProbeWarning, match="nvidia-smi is not on PATH"):
        assert capture(("topo", "-m")) is None


def test_capture_reports_a_failing_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it could not communicate "
                    "with the NVIDIA driver.\" >&2\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.warns(ProbeWarning, match="exit status 9: NVIDIA-SMI has failed"):
        assert capture(("topo", "-m")) is None
    captured = tmp_path / "topo.txt"
    captured.write_text(fixture("dgx1-v100").nvidia_smi_topo)
    fake.write_text(f"#!/bin/sh\nwhile IFS= read -r line; do echo \"$line\"; done < {captured}\n")
    assert "GPU0" in capture(("topo", "-m"))
