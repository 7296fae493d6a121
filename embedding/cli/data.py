"""``neocomm data``: the data tools — the synthetic planted model's AUC, Criteo text to binary.

    neocomm data planted-auc --preset criteo-1tb-1000x --records 1048576
    neocomm data convert day_0 day_1 -o train.bin --preset criteo-1tb

``planted-auc`` scores the synthetic data's planted model on its own records
(the best AUC a trained model can approach); ``convert`` hashes Criteo text
(or ``.gz``) files into neocomm's binary layout. Exit status: 0 done, 1 a bad
input file (named with its line), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys

from embedding.cli import positive_int as _positive_int

__all__ = ["HELP", "add_arguments", "run"]

HELP = "data tools: the planted model's AUC, Criteo text to binary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from embedding.data.synthetic import TABLE_PRESETS

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="TOOL")
    p = sub.add_parser("planted-auc", help="AUC of the planted model on synthetic records")
    p.add_argument("--preset", default="criteo-1tb-1000x", choices=list(TABLE_PRESETS))
    p.add_argument("--records", type=_positive_int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("convert", help="convert Criteo text (or .gz) files to the binary format")
    c.add_argument("inputs", nargs="+")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--preset", default="criteo-1tb", choices=list(TABLE_PRESETS),
                   help="table sizes the ids are hashed into")
    c.add_argument("--missing", default="zero", choices=["zero", "empty"])


def run(args) -> int:
    from embedding.data.synthetic import SyntheticConfig, planted_auc, table_size_preset

    if args.data_command == "planted-auc":
        cfg = SyntheticConfig(table_sizes=table_size_preset(args.preset), seed=args.seed)
        r = planted_auc(cfg, args.records)
        print(f"preset {args.preset} seed {args.seed}: {r['records']} records, planted-model "
              f"AUC {r['auc']:.4f}, log-loss {r['log_loss']:.4f}, positive rate "
              f"{r['positive_rate']:.4f}")
        return 0
    from embedding.data.binary import convert_text
    from embedding.data.criteo import Preprocessor
    from embedding.data.types import DataFormatError

    pre = Preprocessor(table_size_preset(args.preset), missing=args.missing)
    try:
        n = convert_text(args.inputs, args.output, pre)
    except DataFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {n} records to {args.output}")
    return 0
