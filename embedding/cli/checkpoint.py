"""``neocomm checkpoint``: inspect and verify checkpoints; export their tables as int8.

``neocomm checkpoint inspect DIR`` prints a checkpoint's step, plan, tables
and files with each file's size and checksum status. DIR is a checkpoint
directory or a root holding ``step-*`` directories (the newest complete one
is inspected, and the others listed). Exit status: 0 when every file
verifies, 1 when a file is missing or its checksum is wrong, 2 when DIR is
not a usable checkpoint.

``neocomm checkpoint export CKPT --out DIR`` writes the tables of a training
checkpoint (any world size and plan) as int8 rows in FBGEMM's FUSED8BIT
layout (``dim`` uint8 codes, float32 scale, float32 bias per row) to
``DIR/step-<step>``, an export that ``neocomm predict --tables`` scores with
and :class:`embedding.checkpoint.int8.Int8Export` reads. ``--tables``
picks tables by name. Exit status: 0 written, 1 CKPT is not a usable
training checkpoint, 2 bad arguments (an unknown table or format).
"""
from __future__ import annotations

import json
import sys
import time

from topology.sizes import format_size

__all__ = ["HELP", "add_arguments", "run"]

HELP = "inspect and verify checkpoints; export their tables as int8 for serving"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("inspect", help="verify checksums and print a checkpoint's contents")
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, a root of checkpoints "
                   "or a training output directory (its checkpoints/)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip reading the files (sizes are still checked)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e = sub.add_parser("export", help="write a checkpoint's tables as int8 rows for serving")
    e.add_argument("dir", metavar="CKPT", help="a checkpoint, a root of them or a training "
                   "output directory (its latest)")
    e.add_argument("--out", required=True, metavar="DIR",
                   help="where the export goes (as DIR/step-<step>)")
    e.add_argument("--tables", default=None, metavar="NAMES",
                   help="comma-separated tables to export (default: every table)")
    e.add_argument("--format", default="fused8bit_rowwise", metavar="FORMAT",
                   help="row format (supported: fused8bit_rowwise, FBGEMM's FUSED8BIT rows)")


def run(args) -> int:
    from pathlib import Path

    from embedding.checkpoint import (Checkpoint, CheckpointError, list_checkpoints)
    from embedding.checkpoint.types import MANIFEST

    if args.action == "export":
        return _export(args)
    if args.action != "inspect":  # pragma: no cover - argparse restricts the choices
        return 2
    root = Path(args.dir)
    if not list_checkpoints(root) and (root / "checkpoints").is_dir():
        root = root / "checkpoints"  # a training output directory, as predict and export take
    others = []
    if (root / MANIFEST).exists() or (root / "COMPLETE").exists():
        path = root
    else:
        infos = list_checkpoints(root)
        others = infos
        complete = [i for i in infos if i.complete]
        if not complete:
            print(f"{root}: no complete checkpoint"
                  + (f" ({len(infos)} incomplete)" if infos else ""), file=sys.stderr)
            for i in infos:
                print(f"  {i.path.name}: {i.why}", file=sys.stderr)
            return 2
        path = complete[-1].path
    try:
        ckpt = Checkpoint(path, verify=False)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = ckpt.manifest
    if args.no_verify:
        statuses = []
        for rec in m.files:
            p = ckpt.path / rec.path
            st = ("missing" if not p.is_file() else
                  "ok (size)" if p.stat().st_size == rec.bytes else "bad-size")
            statuses.append((rec, st, ""))
    else:
        statuses = [(s.record, s.status, s.actual) for s in ckpt.verify()]
    bad = [s for s in statuses if not s[1].startswith("ok")]
    if args.json:
        print(json.dumps({
            "path": str(ckpt.path), "step": m.step, "world_size": m.world_size,
            "created": m.created, "state": m.state,
            "plan": json.loads(m.plan.to_json()) if m.plan is not None else None,
            "tables": [t.to_dict() for t in m.tables],
            "files": [dict(r.to_dict(), status=st, actual=act) for r, st, act in statuses],
            "others": [{"path": str(i.path), "step": i.step, "complete": i.complete,
                        "why": i.why} for i in others if i.path != ckpt.path],
            "ok": not bad}, indent=1))
        return 1 if bad else 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)) if m.created else "?"
    print(f"checkpoint {ckpt.path}")
    print(f"  step {m.step}, world size {m.world_size}, written {when}")
    if m.state:
        print(f"  state: {json.dumps(m.state, sort_keys=True)}")
    if m.plan is not None:
        print(f"plan: {m.plan.world_size} ranks, {m.plan.ranks_per_node} per node, "
              f"{len(m.plan.tables)} tables")
        for tp in m.plan.tables:
            ranks = ",".join(str(r) for r in tp.ranks)
            print(f"  {tp.table:<16} {tp.sharding.value:<18} {len(tp.shards)} shard(s) on "
                  f"rank(s) {ranks}")
    else:
        print("plan: none recorded")
    if m.tables:
        print(f"tables ({len(m.tables)}):")
        for t in m.tables:
            print(f"  {t.name:<16} {t.num_rows} x {t.dim} {t.dtype}")
    total = sum(r.bytes for r in m.files)
    print(f"files ({len(m.files)}, {format_size(total)}):")
    for rec, st, act in statuses:
        where = ""
        if rec.slice is not None:
            where = f" {rec.slice.table}/{rec.slice.tensor}@{list(rec.slice.offset)}"
            if rec.slice.strided:
                where += f" step {list(rec.slice.stride)}"
        extra = f" (found {act})" if st not in ("ok", "ok (size)") and act else ""
        print(f"  {rec.path:<44} {format_size(rec.bytes):>10}  {rec.checksum}  {st.upper()}"
              f"{extra}  [{rec.name}{where}]")
    for i in others:
        if i.path != ckpt.path:
            print(f"other: {i.path.name} {'complete' if i.complete else 'INCOMPLETE: ' + i.why}")
    if bad:
        print(f"{len(bad)} file(s) failed verification", file=sys.stderr)
        return 1
    print("all files verified" if not args.no_verify else "sizes match (checksums not read)")
    return 0


def _export(args) -> int:
    import numpy as np

    from embedding.checkpoint import CheckpointError
    from embedding.checkpoint.int8 import Int8Export
    from embedding.train.export import export_int8

    names = None
    if args.tables is not None:
        names = [n.strip() for n in args.tables.split(",") if n.strip()]
    try:
        path = export_int8(args.dir, args.out, tables=names, fmt=args.format)
    except CheckpointError as exc:
        print(f"neocomm checkpoint export: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"neocomm checkpoint export: error: {exc}", file=sys.stderr)
        return 2
    ex = Int8Export(path, verify=False)
    print(f"int8 export {ex.path} ({ex.format}) of {ex.source['path']} (step {ex.step})")
    for t in ex.tables.values():
        before = t.rows * t.dim * np.dtype(t.dtype).itemsize
        after = ex.fused(t.name).nbytes
        kind = "dynamic, " if t.dynamic else ""
        print(f"  {t.name:<16} {t.rows} x {t.dim} ({kind}{t.dtype} {format_size(before)} -> "
              f"{format_size(after)})")
    return 0
