"""The settings table and the error family."""
from __future__ import annotations

import pickle
import warnings

import pytest

from neocomm import config
from neocomm.errors import BackendUnavailableError, CollectiveArgumentError, GroupGoneError


def test_defaults_and_typed_parsing():
    s = config.settings({})
    assert s["TIMEOUT"] == 300.0 and s["CHECK_ARGS"] is True and s["RANKS_PER_NODE"] == 0
    env = {"NEOCOMM_TIMEOUT": "2.5", "NEOCOMM_CHECK_ARGS": "off",
           "NEOCOMM_STAGING_BYTES": "4MiB", "NEOCOMM_RANKS_PER_NODE": "2"}
    s = config.settings(env)
    assert s["TIMEOUT"] == 2.5 and s["CHECK_ARGS"] is False
    assert s["STAGING_BYTES"] == 4 << 20 and s["RANKS_PER_NODE"] == 2


@pytest.mark.parametrize("env,match", [
    ({"NEOCOMM_TIMEOUT": "soon"}, "NEOCOMM_TIMEOUT='soon': expected float"),
    ({"NEOCOMM_CHECK_ARGS": "maybe"}, "NEOCOMM_CHECK_ARGS='maybe': expected bool"),
    ({"NEOCOMM_BACKEND": "gloo"}, "expected one of"),
    ({"NEOCOMM_RANKS_PER_NODE": "-1"}, "must be >= 0"),
    ({"NEOCOMM_STAGING_BYTES": "12"}, "must be >= 4096"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(config.SettingsError, match=match):
        config.settings(env)


def test_unknown_names_are_warned_about_with_a_suggestion():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.settings({"NEOCOMM_TIMOUT": "3"})
    assert any("NEOCOMM_TIMOUT" in str(w.message) and "did you mean" in str(w.message)
               for w in caught)


def test_prefixed_family():
    config.declare("TESTFAMILY_", str, "", "a test family", prefix=True)
    assert config.prefixed("TESTFAMILY_", "all_reduce", {"NEOCOMM_TESTFAMILY_ALL_REDUCE": "ring"}) == "ring"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.settings({"NEOCOMM_TESTFAMILY_X": "y"})
    assert not caught


def test_redeclaring_differently_is_an_error():
    with pytest.raises(ValueError, match="declared twice"):
        config.declare("TIMEOUT", int, 1, "other")


def test_errors_survive_pickling():
    err = CollectiveArgumentError("m", op="all_reduce", field="dtype", ranks=(1, 2),
                                  per_rank={1: "a", 2: "b"})
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ValueError) and back.field == "dtype" and back.ranks == (1, 2)
    assert back.per_rank == {1: "a", 2: "b"} and str(back) == "m"
    gone = pickle.loads(pickle.dumps(GroupGoneError("g", ranks=(4,))))
    assert isinstance(gone, ValueError) and gone.ranks == (4,) and str(gone) == "g"
    unavailable = pickle.loads(pickle.dumps(BackendUnavailableError("nccl", "no GPU")))
    assert unavailable.reason == "no GPU" and "not available: no GPU" in str(unavailable)


def _fresh(code: str):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


ENV = "{'NEOCOMM_ALGO_ALL_REDUCE': 'ring', 'NEOCOMM_CHUNK_BYTES': '1M', 'NEOCOMM_PROGRESS': 'off'}"


def test_layers_above_declare_their_settings_when_imported():
    """The core knows only its own settings; importing a layer declares that layer's (the
    core never looks upward for them)."""
    code = ("import warnings; from neocomm import config; "
            "print(sorted({'CHUNK_BYTES', 'PROGRESS'} & {s.name for s in config.table()}) "
            "or 'none'); "
            "import collectives, embedding.train; warnings.simplefilter('error'); "
            f"s = config.settings({ENV}); print(s['CHUNK_BYTES'], s['PROGRESS'])")
    assert _fresh(code) == ["none", str(1 << 20), "off"]


def test_the_command_line_knows_every_layers_settings_before_it_imports_them():
    """``neocomm`` may start the world before a command imports its layer: every layer's
    settings are declared before unknown names are warned about."""
    code = ("import contextlib, io, json, os, sys; "
            f"os.environ.update({ENV}); from neocomm import cli; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): cli.main(['info', '--json'])\n"
            "info = json.loads(out.getvalue()); "
            "print(info['unknown_settings'] or 'none', "
            "info['settings']['NEOCOMM_CHUNK_BYTES']['value'], "
            "info['settings']['NEOCOMM_PROGRESS']['value'], 'collectives' in sys.modules)")
    assert _fresh(code) == ["none", str(1 << 20), "off", "True"]


def test_importing_the_embedding_package_declares_all_of_its_settings():
    """A program that imports ``embedding`` (any part of it) before ``neocomm.init()`` gets
    no false "unknown setting" warning for the embedding layer's settings, whichever of its
    modules it has not loaded yet."""
    env = "{'NEOCOMM_EMBEDDING_KERNELS': 'numpy', 'NEOCOMM_PROGRESS': 'off'}"
    code = ("import sys, warnings; import embedding; from neocomm import config; "
            "warnings.simplefilter('error'); "
            f"s = config.settings({env}); "
            "print(s['EMBEDDING_KERNELS'], s['PROGRESS'], "
            "'embedding.kernels.compiled' in sys.modules)")
    assert _fresh(code) == ["numpy", "off", "False"]
