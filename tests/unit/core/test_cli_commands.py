"""The ``neocomm`` dispatcher: commands found through the ``neocomm.commands`` entry points."""
from __future__ import annotations

import importlib.metadata as md

import pytest

from neocomm import cli

#: every command of the product, in the order ``neocomm --help`` lists them
EXPECTED = ["run", "info", "fabric", "topo", "bench", "checkpoint", "data", "plan", "predict",
            "simulate", "train"]


def _with_extra(monkeypatch, *extra: tuple[str, str]):
    """Make the entry points of ``neocomm.commands`` the installed ones plus ``extra``."""
    real = md.entry_points

    def fake(**kw):
        found = list(real(**kw))
        if kw.get("group") == cli.COMMAND_GROUP:
            found += [md.EntryPoint(name, value, cli.COMMAND_GROUP) for name, value in extra]
        return found

    monkeypatch.setattr(md, "entry_points", fake)


def test_every_command_is_registered_and_loads(capsys):
    """Each registered command loads, and ``neocomm NAME --help`` reaches that module's own
    parser: the usage names the command and lists every option its add_arguments adds."""
    import argparse

    table = cli.commands()
    assert list(table) == EXPECTED, "reinstall (pip install -e .) after changing entry points"
    for name, command in table.items():
        module = command.load()
        assert cli.help_line(module), f"{name}: no HELP line"
        own = argparse.ArgumentParser(prog=f"neocomm {name}")
        module.add_arguments(own)
        options = [a.option_strings[-1] for a in own._actions if a.option_strings]
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and out.startswith(f"usage: neocomm {name} "), out
        missing = [o for o in options if o not in out]
        assert not missing, f"{name} --help lacks {missing}"
    assert table["bench"].target == "collectives.cli.bench"
    assert table["topo"].target == "neocomm.cli.topo"
    assert table["train"].target == "embedding.cli.train"


def test_top_level_help_lists_every_command_with_its_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert f"\n  {name:<11} " in out
    assert "  bench       collective bandwidth tests in the style of nccl-tests" in out
    assert out.index("  run ") < out.index("  info ") < out.index("  topo ") < \
        out.index("  bench ") < out.index("  train ")


def test_a_command_that_cannot_load_says_which_and_why(monkeypatch, capsys):
    _with_extra(monkeypatch, ("broken", "no_such_module_for_neocomm"), ("bare", "json"))
    assert cli.main(["broken", "--x"]) == 1
    err = capsys.readouterr().err
    assert ("neocomm: command 'broken' cannot be loaded from no_such_module_for_neocomm "
            "(entry point in neocomm.commands): ModuleNotFoundError") in err
    assert cli.main(["bare"]) == 1
    assert "command 'bare' cannot be loaded from json" in capsys.readouterr().err
    with pytest.raises(cli.CommandLoadError, match=r"it has no add_arguments\(\) and no run\(\)"):
        cli.commands()["bare"].load()
    assert cli.main(["--help"]) == 0  # the listing still works, and names the broken one
    out = capsys.readouterr().out
    assert "  broken      (cannot be loaded: ModuleNotFoundError" in out
    assert "  train       train a DLRM with sharded embeddings" in out


def test_a_registered_name_cannot_take_a_core_command(monkeypatch):
    _with_extra(monkeypatch, ("run", "json"), ("bench", "json"))
    table = cli.commands()
    assert table["run"].target == "neocomm.cli.run"
    assert table["bench"].target == "collectives.cli.bench"


def test_python_dash_m_neocomm_is_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "neocomm", "plan", "no-such-set", "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no-such-set" in done.stderr, done.stdout + done.stderr
