"""``neocomm plan`` run in-process: output, JSON, exit codes and bad input."""
import re

import pytest

from embedding.types import ShardingPlan
from neocomm.cli import main


def plan(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_criteo_plan_prints_tables_ranks_and_imbalance(capsys):
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--memory", "80GiB", "--baseline")
    assert rc == 0, err
    assert "plan of 26 tables for 8 ranks" in out
    for name in ("C1", "C20", "C26"):
        assert f"\n{name} " in out
    ranks = [line for line in out.splitlines() if line.strip().split(" ")[0:1] == ["7"]]
    assert ranks, "a line for rank 7"
    assert "imbalance (max/mean time):" in out
    assert "baseline (every table whole, plain greedy): step" in out


def test_json_plan_file(capsys, tmp_path):
    path = tmp_path / "plan.json"
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--json", str(path), "--summary")
    assert rc == 0, err
    loaded = ShardingPlan.from_json(path.read_text())
    assert loaded.world_size == 8 and len(loaded.tables) == 26
    assert f"plan written to {path}" in out
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--json", "-", "--summary")
    assert rc == 0 and ShardingPlan.from_json(out) == loaded  # deterministic
    assert "imbalance" in err  # the readable table goes to stderr then


def test_uncapped_fits_and_its_baseline_does_not(capsys):
    rc, out, err = plan(capsys, "criteo-1tb-uncapped", "-n", "8", "--memory", "80GiB",
                        "--baseline")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("C20 "))
    assert "row_wise" in line and "table_wise" not in line
    assert "baseline (every table whole, plain greedy): table" in out
    assert "does not fit" in out


def test_plan_that_cannot_fit_names_the_table_and_shortfall(capsys):
    rc, out, err = plan(capsys, "criteo-1tb-uncapped", "-n", "2", "--memory", "80GiB")
    assert rc == 1
    assert re.search(r"table 'C\d+'", err) and "short by" in err and "GiB" in err


def test_check_plan_against_world_size(capsys, tmp_path):
    path = tmp_path / "plan8.json"
    assert plan(capsys, "criteo-1tb", "-n", "8", "--json", str(path))[0] == 0
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "4", "--check", str(path))
    assert rc == 1
    assert "the plan is for 8 ranks, the world has 4" in err
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--check", str(path))
    assert rc == 0 and "matches" in out
    rc, out, err = plan(capsys, "criteo-1tb-uncapped", "-n", "8", "--check", str(path))
    assert rc == 1 and "do not cover" in err
    (tmp_path / "junk.json").write_text("{}")
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--check", str(tmp_path / "junk.json"))
    assert rc == 2 and "not a sharding plan" in err


def test_table_file(capsys, tmp_path):
    path = tmp_path / "tables.toml"
    path.write_text('[[tables]]\nname = "a"\nnum_rows = 1000\ndim = 64\n'
                    '[[tables]]\nname = "b"\nnum_rows = 30\ndim = 16\nsharding = "row_wise"\n')
    rc, out, err = plan(capsys, str(path), "-n", "2", "--memory", "1GiB", "--batch-size", "256")
    assert rc == 0, err
    assert "\nb " in out and "row_wise" in out


@pytest.mark.parametrize("argv,says", [
    (["-n", "0"], "expected a positive int, got '0'"),
    (["-n", "-4"], "expected a positive int"),
    (["-n", "8", "--memory", "0"], "expected a positive size"),
    (["-n", "8", "--memory=-80GiB"], "expected a size"),
    (["-n", "8", "--memory", "lots"], "expected a size"),
    (["-n", "8", "--reserve", "1.5"], "expected a fraction"),
    (["-n", "8", "--batch-size", "0"], "expected a positive int"),
])
def test_bad_arguments_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        main(["plan", "criteo-1tb", *argv])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_bad_inputs_exit_2(capsys, tmp_path):
    rc, out, err = plan(capsys, "criteo-2tb", "-n", "8")
    assert rc == 2 and "unknown table set 'criteo-2tb'" in err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tables]]\nname = "a"\nnum_rows = 10\ndim = 8\nrows = 3\n')
    rc, out, err = plan(capsys, str(bad), "-n", "2")
    assert rc == 2 and f"{bad}: tables[0].rows: unknown key" in err
    typed = tmp_path / "typed.json"
    typed.write_text('{"tables": [{"name": "a", "num_rows": 10, "dim": "8"}]}')
    rc, out, err = plan(capsys, str(typed), "-n", "2")
    assert rc == 2 and f"{typed}: tables[0].dim: expected an int, got str" in err
    cols = tmp_path / "cols.toml"
    cols.write_text('[[tables]]\nname = "a"\nnum_rows = 10\ndim = 100\n'
                    'sharding = "column_wise"\ncolumn_slices = 3\n')
    rc, out, err = plan(capsys, str(cols), "-n", "4")
    assert rc == 2 and "dim 100 is not divisible into 3 column slices" in err
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--fabric", "no-such-host")
    assert rc == 2 and "fabric" in err
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--ranks-per-node", "3")
    assert rc == 2 and "ranks_per_node" in err
    rc, out, err = plan(capsys, "criteo-1tb", "-n", "8", "--json", str(tmp_path / "no" / "p.json"))
    assert rc == 2 and "cannot write" in err
