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


def test_every_fixture_materialises_its_tree_once(host):
    """Each shipped fixture's tree becomes real files, links and folders (once per
    process), and discovery reads the hardware the snapshot records."""
    from topology.snapshot import FIXTURES_DIR
    from topology.types import PortState

    names = fixture_names()
    assert {"dgx-a100", "dgx1-v100", "cpu-host", "dgx-a100-faulty"} <= set(names)
    for name in names:
        fx = fixture(name)
        assert fixture(name) is fx  # materialised once per process
        for kind, rel, value in parse_tree((FIXTURES_DIR / name / "root.tree").read_text()):
            path = fx.root / rel
            if kind == "file":
                assert not path.is_symlink() and path.read_text() == value, rel
            elif kind == "link":
                assert path.is_symlink() and os.readlink(path) == value, rel
            else:
                assert path.is_dir(), rel
    a100 = host("dgx-a100")  # the snapshot's sysfs and nvidia-smi texts, discovered
    nic = a100.nic("mlx5_0")
    assert nic.rate_gbps == 200.0 and nic.state is PortState.ACTIVE
    assert [g.index for g in a100.gpus] == list(range(8))
    assert a100.gpus[0].memory_bytes == 81920 << 20  # "81920 MiB" in the query capture
    cpu = fixture("cpu-host")
    assert cpu.nvidia_smi_topo is None and cpu.nvidia_smi_query is None
    assert host("cpu-host").gpus == ()
    with pytest.raises(ValueError, match="fixture: expected one of"):
        fixture("no-such-host")

