"""Text snapshots of a host's ``/sys`` and ``/proc`` files, and the shipped fixtures.

A snapshot (``root.tree``) is a plain-text image of the few sysfs and procfs
files the probes read, with their symbolic links, so that it can live in a
source tree and a wheel (real sysfs trees contain symlink loops that packaging
tools cannot copy). :func:`materialize` turns it back into a real directory
tree with real symlinks, which the probes then read exactly as they read
``/``. The format, one entry per block::

    @file sys/class/infiniband/mlx5_0/ports/1/rate
    200 Gb/sec (4X HDR)
    @link sys/class/infiniband/mlx5_0 -> ../../devices/pci0000:00/.../infiniband/mlx5_0
    @dir sys/module/nvidia_peermem

A ``@file`` block's content is every line up to the next ``@`` line.

Fixtures (:func:`fixture`) are directories under ``topology/fixtures/`` with a
``root.tree`` and, for GPU hosts, captured ``nvidia-smi topo -m``
(``nvidia-smi-topo-m.txt``) and ``nvidia-smi --query-gpu=...`` output
(``nvidia-smi-query-gpu.csv``).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Fixture", "fixture", "fixture_names", "materialize", "materialized", "parse_tree",
           "dump_tree", "FIXTURES_DIR"]

#: Directory of the shipped fixtures (package data).
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"

TOPO_FILE = "nvidia-smi-topo-m.txt"
QUERY_FILE = "nvidia-smi-query-gpu.csv"
TREE_FILE = "root.tree"


@dataclass(frozen=True)
class Fixture:
    """A captured host: a filesystem root to probe and the captured tool output."""

    name: str
    root: Path
    nvidia_smi_topo: str | None = None
    nvidia_smi_query: str | None = None


def parse_tree(text: str, source: str = "<tree>") -> list[tuple[str, str, str]]:
    """Entries ``(kind, path, value)`` of a snapshot; kind is file, link or dir.

    ValueError names the source and line of a malformed entry.
    """
    entries: list[tuple[str, str, str]] = []
    current: list | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("@"):
            head, _, rest = line[1:].partition(" ")
            rest = rest.strip()
            if head == "file" and rest:
                current = ["file", rest, []]
                entries.append(current)  # type: ignore[arg-type]
            elif head == "link" and " -> " in rest:
                path, target = rest.split(" -> ", 1)
                entries.append(("link", path.strip(), target.strip()))
                current = None
            elif head == "dir" and rest:
                entries.append(("dir", rest, ""))
                current = None
            else:
                raise ValueError(f"{source}:{lineno}: malformed entry {line!r}")
        elif current is not None:
            current[2].append(line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"{source}:{lineno}: content outside a @file entry: {line!r:.80}")
    out = []
    for kind, path, value in entries:
        if kind == "file":
            value = "".join(v + "\n" for v in value)  # type: ignore[union-attr]
        if path.startswith("/") or ".." in Path(path).parts:
            raise ValueError(f"{source}: path {path!r} must be relative and stay inside the root")
        out.append((kind, path, value))
    return out


def dump_tree(entries: list[tuple[str, str, str]]) -> str:
    """The snapshot text of ``entries`` (inverse of :func:`parse_tree`)."""
    lines = []
    for kind, path, value in entries:
        if kind == "file":
            lines.append(f"@file {path}")
            lines.extend(value.splitlines())
        elif kind == "link":
            lines.append(f"@link {path} -> {value}")
        else:
            lines.append(f"@dir {path}")
    return "\n".join(lines) + "\n"


def materialize(tree: str | Path, dest: str | Path) -> Path:
    """Write the snapshot ``tree`` (a ``root.tree`` path or its text) under ``dest``."""
    if isinstance(tree, Path):
        text, source = tree.read_text(), str(tree)
    else:
        text, source = tree, "<tree>"
    dest = Path(dest)
    for kind, rel, value in parse_tree(text, source):
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_text(value)
        elif kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
        else:
            if path.is_symlink() or path.exists():
                raise ValueError(f"{source}: {rel!r} is defined twice")
            os.symlink(value, path)
    return dest


_CACHE: dict[str, Fixture] = {}
_TMP: list[str] = []


def fixture_names() -> list[str]:
    """Names of the shipped fixtures."""
    if not FIXTURES_DIR.is_dir():
        return []
    return sorted(p.name for p in FIXTURES_DIR.iterdir() if (p / TREE_FILE).is_file())


def _fixture_files(name: str):
    base = FIXTURES_DIR / name
    if not (base / TREE_FILE).is_file():
        raise ValueError(f"fixture: expected one of {fixture_names()}, got {name!r}")

    def text(fname: str) -> str | None:
        path = base / fname
        return path.read_text() if path.is_file() else None

    return base / TREE_FILE, text(TOPO_FILE), text(QUERY_FILE)


@contextlib.contextmanager
def materialized(name: str):
    """The shipped fixture ``name`` with its tree in a temporary directory that exists only
    inside the ``with`` block: what a job probes once and then keeps in memory, so that a
    job killed later leaves nothing in the temporary directory."""
    tree, topo, query = _fixture_files(name)
    tmp = tempfile.mkdtemp(prefix=f"neocomm-fixture-{name}-")
    try:
        yield Fixture(name, materialize(tree, tmp), topo, query)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fixture(name: str) -> Fixture:
    """The shipped fixture ``name``, its tree materialised in a temporary directory
    (once per process, removed at exit; :func:`materialized` removes it at once)."""
    if name in _CACHE:
        return _CACHE[name]
    tree, topo, query = _fixture_files(name)
    tmp = tempfile.mkdtemp(prefix=f"neocomm-fixture-{name}-")
    if not _TMP:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _TMP])
    _TMP.append(tmp)
    result = Fixture(name, materialize(tree, tmp), topo, query)
    _CACHE[name] = result
    return result
