"""Hostfiles as ``neocomm run`` reads them, and where it says each rank goes."""
from __future__ import annotations

import os
import sys

import pytest

from neocomm.hostfile import HostSlots, describe_placement, placement, read_hostfile
from neocomm.launcher import Launcher, build_command, resolve_program

OMPI = Launcher("/x/mpirun", "openmpi")


def _file(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_read_slots_comments_and_repeats(tmp_path):
    hosts = read_hostfile(_file(tmp_path, "# rack 1\nnode-a slots=2\n\nnode-b  slots=3 # big\n"
                                          "node-c\nnode-a slots=1\n"))
    assert hosts == [HostSlots("node-a", 3), HostSlots("node-b", 3), HostSlots("node-c", None)]


@pytest.mark.parametrize("text,match", [
    ("node-a slots=two\n", r"line 1: 'slots=two': expected slots=N"),
    ("node-a\nnode-b slots=0\n", r"line 2: 'slots=0'"),
    ("# nothing\n\n", "names no host"),
])
def test_bad_hostfiles_name_the_line(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        read_hostfile(_file(tmp_path, text))
    with pytest.raises(ValueError, match="cannot read"):
        read_hostfile(str(tmp_path / "missing"))


@pytest.mark.parametrize("slots,n,want", [
    ((2, 2), 4, [2, 2]), ((2, 2), 3, [2, 1]), ((2, 2), 1, [1]),
    ((2, 1, 3), 7, [3, 1, 3]), ((2, 1, 3), 10, [4, 2, 4]), ((2, 1), 6, [4, 2]),
])
def test_placement_fills_slots_in_order_then_spreads(slots, n, want):
    hosts = [HostSlots(f"h{i}", s) for i, s in enumerate(slots)]
    plan = placement(hosts, n)
    assert [len(r) for _, r in plan] == want
    assert [r for _, ranks in plan for r in ranks] == list(range(n))


def test_placement_unknown_without_slots():
    hosts = [HostSlots("a", 2), HostSlots("b")]
    assert placement(hosts, 3) is None
    assert "as many ranks as it has cores" in describe_placement(hosts, 3)
    assert describe_placement([HostSlots("a", 2), HostSlots("b", 2)], 4) == \
        "4 rank(s) on 2 host(s): a ranks 0-1, b ranks 2-3"


def test_hostfile_maps_by_slot_and_forwards_the_environment(monkeypatch):
    monkeypatch.setenv("PATH", "/venv/bin:/usr/bin")
    monkeypatch.setenv("PYTHONPATH", "/src")
    argv = build_command(OMPI, 4, ["prog"], cores=2, is_root=True, hostfile="hosts")
    assert argv[argv.index("--map-by") + 1] == "slot:OVERSUBSCRIBE"
    assert "--oversubscribe" not in argv  # it would put every rank on the first host
    for key in ("PATH", "PYTHONPATH"):
        assert argv[argv.index(key) - 1] == "-x"
    argv = build_command(OMPI, 4, ["prog"], hostfile="hosts", extra=["--map-by", "node"])
    assert argv.count("--map-by") == 1 and argv[argv.index("--map-by") + 1] == "node"


def test_programs_resolve_to_this_environment(tmp_path, monkeypatch):
    assert resolve_program("python") == sys.executable
    assert resolve_program("python3") == sys.executable
    assert resolve_program("x.py") == "x.py" and resolve_program("/bin/true") == "/bin/true"
    tool = tmp_path / "mytool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert resolve_program("mytool") == str(tool)
    assert resolve_program("no-such-program-here") == "no-such-program-here"
    argv = build_command(OMPI, 2, ["python", "-c", "pass"])
    assert argv[-3:] == [sys.executable, "-c", "pass"]


def test_layout_hostfile_places_each_layout_on_its_hosts(tmp_path):
    from neocomm.hostfile import layout_hostfile

    src = _file(tmp_path, "# the cluster\nnode-a slots=1\nnode-b slots=1\nnode-c slots=4\n")
    out = layout_hostfile(src, 2, 2, str(tmp_path / "two-by-two"))
    assert read_hostfile(out) == [HostSlots("node-a", 2), HostSlots("node-b", 2)]
    # mapped by slot, 4 ranks land 2 to a host; the source file puts them 1, 1 and 2
    assert [len(r) for _, r in placement(read_hostfile(out), 4)] == [2, 2]
    assert [len(r) for _, r in placement(read_hostfile(src), 4)] == [1, 1, 2]
    three = layout_hostfile(src, 3, 1, str(tmp_path / "three-by-one"))
    assert [h.slots for h in read_hostfile(three)] == [1, 1, 1]
    with pytest.raises(ValueError, match="4 nodes wanted, but it names 3 host"):
        layout_hostfile(src, 4, 1, str(tmp_path / "four"))
