"""Text snapshots of /sys and /proc, and the shipped fixtures."""
from __future__ import annotations

import os

import pytest

from topology.snapshot import dump_tree, fixture, fixture_names, materialize, parse_tree


def test_parse_dump_round_trip():
    text = ("@file sys/a/rate\n200 Gb/sec (4X HDR)\n@link sys/b -> a\n@dir sys/module/x\n"
            "@file proc/modules\nline one\nline two\n")
    entries = parse_tree(text)
    assert entries == [("file", "sys/a/rate", "200 Gb/sec (4X HDR)\n"), ("link", "sys/b", "a"),
                       ("dir", "sys/module/x", ""),
                       ("file", "proc/modules", "line one\nline two\n")]
    assert parse_tree(dump_tree(entries)) == entries


def test_materialize_makes_real_files_and_symlinks(tmp_path):
    root = materialize("@file sys/devices/x/numa_node\n3\n@link sys/class/y -> ../devices/x\n",
                       tmp_path)
    link = root / "sys/class/y"
    assert link.is_symlink() and (link / "numa_node").read_text() == "3\n"
    assert os.path.realpath(link) == str(root / "sys/devices/x")


@pytest.mark.parametrize("text, match", [
    ("@wat sys/a\n", "malformed entry"),
    ("orphan content\n", "outside a @file"),
    ("@file /etc/passwd\nx\n", "relative"),
    ("@file sys/../../x\nx\n", "inside the root"),
    ("@link sys/a\n", "malformed entry"),
])
def test_malformed_trees(text, match):
    with pytest.raises(ValueError, match=match):
        parse_tree(text, "t.tree")


def test_fixture_names_and_contents():
    names = fixture_names()
    assert {"dgx-a100", "dgx1-v100", "cpu-host", "dgx-a100-faulty"} <= set(names)
    fx = fixture("dgx-a100")
    assert fx.nvidia_smi_topo.startswith("\tGPU0\tGPU1")
    assert "NIC Legend:" in fx.nvidia_smi_topo
    header = fx.nvidia_smi_query.splitlines()[0]
    assert header == "index, name, uuid, pci.bus_id, memory.total [MiB]"
    rate = fx.root / "sys/class/infiniband/mlx5_0/ports/1/rate"
    assert rate.read_text() == "200 Gb/sec (4X HDR)\n"
    assert (fx.root / "sys/class/infiniband/mlx5_0/ports/1/state").read_text() == "4: ACTIVE\n"
    assert fixture("dgx-a100") is fx  # materialised once per process
    cpu = fixture("cpu-host")
    assert cpu.nvidia_smi_topo is None and cpu.nvidia_smi_query is None
    with pytest.raises(ValueError, match="fixture: expected one of"):
        fixture("no-such-host")
