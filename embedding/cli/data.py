"""``neocomm data``: the data tools — stats, inspect, conversion, an example, the planted AUC.

    neocomm data example -o demo                       # Parquet files and their train.toml
    neocomm data stats --config demo/train.toml        # columns, nulls, distinct, table sizes
    neocomm data inspect --config demo/train.toml --rows 3
    neocomm data planted-auc --preset criteo-1tb-1000x --records 1048576
    neocomm data convert day_0.gz day_1.gz -o train.parquet
    neocomm data convert day_0.gz day_1.gz -o train.bin --preset criteo-1tb
    neocomm data convert clicks.csv -o clicks.parquet --list-column history
    neocomm data convert part-*.tsv --no-header -o parts.parquet
    neocomm data convert train.bin -o train.parquet

``planted-auc`` scores the synthetic data's planted model on its own records
(the best AUC a trained model can approach). ``convert`` reads its inputs in
order into one output; ``--to`` (default from the output's suffix:
``.parquet`` -> parquet, else binary) and ``--from`` (default from the inputs'
suffix, ``.gz`` aside: ``.csv``, ``.tsv``, ``.bin`` -> binary, else criteo)
pick the route:

  criteo -> parquet    raw values: label, I1..I13 int64, C1..C26 string (null when empty)
  csv/tsv -> parquet   the header's columns (--no-header: c0, c1, ...); --list-column
                       columns split on --list-separator into lists
  binary -> parquet    label, dense float32, one int64 (or list) column per sparse feature
  criteo -> binary     ids hashed into the tables of --preset (--missing: zero or empty bag)

Exit status: 0 done, 1 a bad input file (named with its line or column), 2 bad
arguments (an unsupported route among them).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from embedding.cli import positive_int as _positive_int

__all__ = ["HELP", "add_arguments", "run"]

HELP = "data tools: stats, inspect, convert to Parquet, an example data set"

_SOURCES = ("criteo", "csv", "tsv", "binary")
_TARGETS = ("parquet", "binary")
_ROUTES = (("criteo", "parquet"), ("csv", "parquet"), ("tsv", "parquet"),
           ("binary", "parquet"), ("criteo", "binary"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from embedding.data.synthetic import TABLE_PRESETS

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="TOOL")
    p = sub.add_parser("planted-auc", help="AUC of the planted model on synthetic records")
    p.add_argument("--preset", default="criteo-1tb-1000x", choices=list(TABLE_PRESETS))
    p.add_argument("--records", type=_positive_int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("example", help="write an example Parquet data set and its training "
                       "config (a file of the shape you will bring)")
    e.add_argument("-o", "--output", required=True, metavar="DIR")
    e.add_argument("--shape", choices=("clicks", "ratings"), default="clicks",
                   help="clicks (default) or ratings: a MovieLens-100K-like ratings set "
                   "(skewed users and items, a genre list, nulls; see embedding.data.example)")
    e.add_argument("--records", type=_positive_int, default=None,
                   help="records (default: clicks 200000 for training, valid and test a tenth "
                   "each; ratings 100000 in all, split 80/10/10)")
    e.add_argument("--seed", type=int, default=0)
    st = sub.add_parser("stats", help="per column: type, nulls, distinct values, list lengths; "
                        "the tables a training config implies")
    st.add_argument("paths", nargs="*", metavar="PATH",
                    help="Parquet files or directories (default: the config's data.path)")
    st.add_argument("--config", metavar="FILE", default=None,
                    help="a training config with source = \"parquet\": its columns, label "
                    "check and table sizes")
    st.add_argument("--json", metavar="FILE", default=None, help="also write the stats as JSON "
                    "('-': stdout)")
    ins = sub.add_parser("inspect", help="a few rows decoded as the trainer sees them")
    ins.add_argument("--config", metavar="FILE", required=True,
                     help="a training config with source = \"parquet\"")
    ins.add_argument("paths", nargs="*", metavar="PATH",
                     help="files to show (default: the config's data.path)")
    ins.add_argument("--rows", type=_positive_int, default=5, help="rows to show (default 5)")
    ins.add_argument("--start", type=int, default=0, help="first row (default 0)")
    c = sub.add_parser("convert", help="convert Criteo text, CSV/TSV or binary files to Parquet "
                                       "(or Criteo text to binary)")
    c.add_argument("inputs", nargs="+", help="input files, read in order into one output")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--to", choices=_TARGETS,
                   help="output format (default: parquet for a .parquet output, else binary)")
    c.add_argument("--from", dest="source", choices=_SOURCES,
                   help="input format (default from the suffix: .csv, .tsv, .bin -> binary, "
                        "else criteo)")
    c.add_argument("--no-header", action="store_true",
                   help="csv/tsv: the first row is data; columns are named c0, c1, ...")
    c.add_argument("--list-column", action="append", default=[], metavar="COL",
                   help="csv/tsv: split this column into a list (repeatable)")
    c.add_argument("--list-separator", default=None, metavar="SEP",
                   help="csv/tsv: the separator of list elements (default |)")
    c.add_argument("--row-group-size", type=_positive_int, default=None, metavar="N",
                   help="parquet: records per row group (default 131072)")
    c.add_argument("--preset", default=None, choices=list(TABLE_PRESETS),
                   help="criteo -> binary: table sizes the ids are hashed into "
                        "(default criteo-1tb)")
    c.add_argument("--missing", default=None, choices=["zero", "empty"],
                   help="criteo -> binary: a missing categorical is 0 or an empty bag "
                        "(default zero)")


def _infer_source(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    return {".csv": "csv", ".tsv": "tsv", ".bin": "binary"}.get(ext, "criteo")


def _route(args) -> tuple[str, str]:
    """``(source, target)`` of ``convert``; ValueError with the message for the user."""
    target = args.to or ("parquet" if args.output.lower().endswith(".parquet") else "binary")
    source = args.source
    if source is None:
        kinds = {p: _infer_source(p) for p in args.inputs}
        if len(set(kinds.values())) > 1:
            listed = ", ".join(f"{p} ({k})" for p, k in kinds.items())
            raise ValueError(f"the inputs look like different formats ({listed}); name one "
                             "with --from")
        source = kinds[args.inputs[0]]
    if (source, target) not in _ROUTES:
        supported = ", ".join(f"{a} -> {b}" for a, b in _ROUTES)
        raise ValueError(f"cannot convert {source} -> {target}; supported: {supported}")
    if source not in ("csv", "tsv"):
        used = [flag for flag, on in (("--no-header", args.no_header),
                                      ("--list-column", args.list_column),
                                      ("--list-separator", args.list_separator is not None))
                if on]
        if used:
            raise ValueError(f"{', '.join(used)}: only for csv/tsv inputs, got {source}")
    if target != "binary":
        used = [flag for flag, v in (("--preset", args.preset), ("--missing", args.missing))
                if v is not None]
        if used:
            raise ValueError(f"{', '.join(used)}: only for criteo -> binary (Parquet keeps raw "
                             f"values), got {source} -> {target}")
    elif args.row_group_size is not None:
        raise ValueError("--row-group-size: only for parquet output, got binary")
    return source, target


def _describe(path: str, source: str) -> str:
    """``label, 13 dense, 26 sparse columns`` (or ``N columns, K list`` for csv/tsv)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    lists = sum(1 for f in schema if pa.types.is_list(f.type))
    if source in ("csv", "tsv"):
        return f"{len(schema)} columns" + (f", {lists} list" if lists else "")
    dense = sum(1 for f in schema if re.fullmatch(r"I\d+|dense_\d+", f.name))
    return (f"label, {dense} dense, {len(schema) - 1 - dense} sparse columns"
            + (f" ({lists} list)" if lists else ""))


def _convert(args) -> int:
    from embedding.data.types import DataFormatError

    try:
        source, target = _route(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if target == "binary":
            from embedding.data.binary import convert_text
            from embedding.data.criteo import Preprocessor
            from embedding.data.synthetic import table_size_preset

            preset = args.preset or "criteo-1tb"
            pre = Preprocessor(table_size_preset(preset), missing=args.missing or "zero")
            n = convert_text(args.inputs, args.output, pre)
            print(f"wrote {n} records to {args.output} (binary, ids hashed into preset {preset})")
            return 0
        from embedding.data import convert

        rgs = {} if args.row_group_size is None else {"row_group_size": args.row_group_size}
        if source == "criteo":
            n = convert.criteo_to_parquet(args.inputs, args.output, **rgs)
        elif source == "binary":
            n = convert.binary_to_parquet(args.inputs, args.output, **rgs)
        else:
            sep = "|" if args.list_separator is None else args.list_separator
            n = convert.delimited_to_parquet(
                args.inputs, args.output, delimiter="," if source == "csv" else "\t",
                header=not args.no_header, list_columns=args.list_column,
                list_separator=sep, **rgs)
    except (DataFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} records to {args.output} (parquet: {_describe(args.output, source)})")
    return 0


def run(args) -> int:
    from embedding.data.synthetic import SyntheticConfig, planted_auc, table_size_preset

    if args.data_command == "planted-auc":
        cfg = SyntheticConfig(table_sizes=table_size_preset(args.preset), seed=args.seed)
        r = planted_auc(cfg, args.records)
        print(f"preset {args.preset} seed {args.seed}: {r['records']} records, planted-model "
              f"AUC {r['auc']:.4f}, log-loss {r['log_loss']:.4f}, positive rate "
              f"{r['positive_rate']:.4f}")
        return 0
    if args.data_command == "example":
        return _example(args)
    if args.data_command in ("stats", "inspect"):
        return _with_schema(args)
    return _convert(args)


def _example(args) -> int:
    from embedding.data.example import write_example, write_ratings

    ratings = args.shape == "ratings"
    n = args.records or (100_000 if ratings else 200_000)
    try:
        paths = (write_ratings(args.output, records=n, seed=args.seed) if ratings else
                 write_example(args.output, records=n, eval_records=max(1, n // 10),
                               seed=args.seed))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ratings:
        print(f"wrote {paths['train']}, {paths['valid']} and {paths['test']} (80/10/10 of "
              f"{n:,} ratings) and {paths['config']}")
        print(f"(the planted model scores AUC {paths['planted_auc']:.4f} on test)")
        return 0
    print(f"wrote {paths['train']} ({n:,} records), {paths['valid']} and {paths['test']} "
          f"({max(1, n // 10):,} each)")
    print(f"and the config that trains on them: {paths['config']}")
    print(f"(the planted model behind the clicks scores AUC {paths['planted_auc']:.4f} on "
          f"test: what a perfect model approaches)")
    print(f"next: neocomm data stats --config {paths['config']}")
    print(f"      neocomm run -n 2 -- neocomm train --config {paths['config']} --out runs/example")
    return 0


def _schema_config(args):
    """``(config, schema)`` of ``--config`` (a Parquet source), or (None, None)."""
    from embedding.train.config import load_config
    from embedding.train.types import DataSource

    if args.config is None:
        return None, None
    cfg = load_config(args.config)
    if cfg.data.source is not DataSource.PARQUET:
        raise ValueError(f"{args.config}: data.source is {cfg.data.source.value!r}; stats and "
                         f"inspect read Parquet sources (source = \"parquet\")")
    return cfg, cfg.data.schema()


def _with_schema(args) -> int:
    from embedding.data.types import DataFormatError
    from embedding.train.types import ConfigError

    try:
        cfg, schema = _schema_config(args)
        paths = list(args.paths) or (list(cfg.data.path) if cfg is not None else [])
        if not paths:
            raise ValueError("no files: give PATH arguments or --config")
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from embedding.data.schema import SchemaError

    try:
        if args.data_command == "stats":
            return _stats(args, paths, schema)
        return _inspect(args, cfg, paths)
    except SchemaError as exc:  # a setting the data cannot take (minmax of a constant column)
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    except DataFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _stats(args, paths, schema) -> int:
    import json

    from embedding.data.parquet import ParquetSource, scan

    src = ParquetSource(paths, schema)
    stats = scan(src, schema, distinct=True)
    out = sys.stderr if args.json == "-" else sys.stdout
    w = lambda *a: print(*a, file=out)  # noqa: E731
    w(f"{src.describe()}: {stats.records:,} records in {len(src.row_groups)} row group(s)")
    if schema is not None:
        w(f"label {schema.label!r}: {stats.positives:,} positive "
          f"({stats.positives / max(stats.records, 1):.1%})")
    w("")
    name_w = max(6, *(len(c) for c in stats.columns))
    type_w = max(4, *(len(c.type) for c in stats.columns.values()))
    w(f"{'column':<{name_w}}  {'type':<{type_w}}  {'nulls':>6}  {'distinct':>10}  "
      f"{'list length min/mean/max':>24}  range")
    for c in stats.columns.values():
        distinct = f"{c.distinct:,}" if c.distinct is not None else ""
        lengths = (f"{c.min_length}/{c.mean_length:g}/{c.max_length}"
                   if c.min_length is not None else "")
        span = f"{_num(c.minimum)} .. {_num(c.maximum)}" if c.minimum is not None else ""
        w(f"{c.column:<{name_w}}  {c.type:<{type_w}}  {c.null_share:>6.1%}  {distinct:>10}  "
          f"{lengths:>24}  {span}")
    if schema is not None:
        w("")
        w("tables the config implies")
        for table, feats in schema.tables().items():
            f0, rows = feats[0], stats.table_rows[table]
            how = (f"hash into {rows:,} rows" if f0.encoding == "hash" else
                   f"vocabulary: {rows - 1:,} values + row 0 for unknown = {rows:,} rows")
            names = ", ".join(f.name for f in feats)
            w(f"  {table:<{name_w}}  {how}; features {names} (pooling {f0.pooling})")
        if schema.dense:
            w("")
            w("dense features as the model gets them (x: the value, nulls filled; statistics "
              "of these files)")
            for d, c in zip(schema.dense, stats.dense.columns):
                lo, hi = c.model_range()
                flag = f"; and {d.column}_missing (0/1)" if d.indicator else ""
                w(f"  {d.column:<{name_w}}  {c.transform:<11}  {c.formula()}   mean "
                  f"{c.mean:.6g}, std {c.std:.6g}, range {c.minimum:g} .. {c.maximum:g} -> "
                  f"{lo:.4g} .. {hi:.4g}{flag}")
    if args.json:
        text = json.dumps(stats.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    return 0


def _num(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:g}"


def _inspect(args, cfg, paths) -> int:
    from embedding.data.parquet import ParquetDataset, ParquetSource, describe_rows, scan

    schema = cfg.data.schema()
    stats = scan(ParquetSource(cfg.data.path, schema), schema)  # the training vocabularies
    src = ParquetSource(paths, schema, label_optional=True)
    ds = ParquetDataset(src, schema, stats.vocabularies, stats.table_rows, dense=stats.dense)
    start = max(0, min(args.start, src.num_records - 1))
    stop = min(src.num_records, start + args.rows)
    print(f"{src.describe()}: rows {start}..{stop - 1} of {src.num_records:,}, as the trainer "
          f"sees them (value -> table row; row 0 stands for values the training data lacks)")
    if schema.dense:
        print("dense columns (raw value -> what the model gets):")
        for c in stats.dense.columns:
            print(f"    {c.column}: {c.transform}, {c.formula()}")
    for line in describe_rows(ds, start, stop):
        print(line)
    return 0
