"""``python -m embedding.data``: measure the synthetic planted-model AUC, convert Criteo text.

    python -m embedding.data planted-auc --preset criteo-1tb-1000x --records 1048576
    python -m embedding.data convert day_0 day_1 -o train.bin --preset criteo-1tb-1000x
"""
from __future__ import annotations

import argparse
import sys

from embedding.data.synthetic import TABLE_PRESETS, SyntheticConfig, planted_auc, table_size_preset


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embedding.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
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
    args = parser.parse_args(argv)
    if args.command == "planted-auc":
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


if __name__ == "__main__":
    sys.exit(main())
