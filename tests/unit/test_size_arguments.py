"""Every command's size arguments read sizes alike: K/M/G/T are powers of 1024 (as
nccl-tests' -b/-e), so 1MB, 1MiB, 1M and 1048576 are one size; a bad size names the
argument and the value as given."""
from __future__ import annotations

import argparse
import re

import pytest

from neocomm.cli import commands

#: every size argument of every command: (command, the words before it, option, dest)
SIZE_ARGUMENTS = [
    ("bench", ["all_reduce"], "-b", "minbytes"),
    ("bench", ["all_reduce"], "--maxbytes", "maxbytes"),
    ("fabric", ["validate", "zionex"], "--bytes", "bytes"),
    ("plan", ["tiny", "-n", "2"], "--memory", "memory"),
    ("plan", ["tiny", "-n", "2"], "--host-memory", "host_memory"),
    ("simulate", ["collective", "all_reduce", "--fabric", "zionex", "-n", "8"], "-b",
     "minbytes"),
    ("simulate", ["collective", "all_reduce", "--fabric", "zionex", "-n", "8"], "-e",
     "maxbytes"),
    ("simulate", ["calibrate", "--fabric", "zionex"], "--minbytes", "minbytes"),
    ("simulate", ["validate", "--fabric", "zionex"], "--maxbytes", "maxbytes"),
    ("simulate", ["step", "-n", "8"], "--memory", "memory"),
    ("simulate", ["scale"], "--memory", "memory"),
    ("simulate", ["zionex"], "--host-memory", "host_memory"),
]

SAME = {"1MB": 1 << 20, "1MiB": 1 << 20, "1M": 1 << 20, "1mb": 1 << 20, "1048576": 1 << 20,
        "64K": 64 << 10, "64KB": 64 << 10, "64KiB": 64 << 10, "2G": 2 << 30, "2GB": 2 << 30}


def _parser(name: str) -> argparse.ArgumentParser:
    """The command's own parser, built as ``neocomm NAME`` builds it."""
    parser = argparse.ArgumentParser(prog=f"neocomm {name}")
    commands()[name].load().add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser, words=()):
    """(words of the subcommand, option strings, dest) of every option, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _options(p, (*words, sub))
        elif action.option_strings:
            yield words, tuple(action.option_strings), action.dest


@pytest.mark.parametrize("name,words,option,dest", SIZE_ARGUMENTS)
def test_every_size_argument_reads_sizes_alike(name, words, option, dest):
    parser = _parser(name)
    for text, expected in SAME.items():
        args = parser.parse_args([*words, option, text])
        assert getattr(args, dest) == expected, (name, option, text)


@pytest.mark.parametrize("name,words,option,dest", SIZE_ARGUMENTS)
@pytest.mark.parametrize("bad", ["12 parsecs", "1MX", "-1M", "M"])
def test_a_bad_size_names_the_argument_and_the_value(name, words, option, dest, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser(name).parse_args([*words, f"{option}={bad}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"neocomm {name}") and "error: argument " in line, err
    assert re.search(rf"argument [-/\w]*{re.escape(option)}\b", line), err
    assert repr(bad) in line, err


def test_the_list_of_size_arguments_is_complete():
    """An option whose name says bytes or memory is a size argument and is in the list."""
    listed = {(name, option) for name, _, option, _ in SIZE_ARGUMENTS}
    for name in ("bench", "fabric", "plan", "simulate", "train", "checkpoint", "data",
                 "predict", "topo"):
        for words, options, dest in _options(_parser(name)):
            if re.search(r"(bytes|memory)$", dest):
                assert {(name, o) for o in options} & listed, (name, words, options)



def test_zero_host_memory_means_device_memory_only():
    """``simulate zionex --host-memory 0`` is the help's "0: device memory only"."""
    args = _parser("simulate").parse_args(["zionex", "--host-memory", "0"])
    assert args.host_memory == 0
