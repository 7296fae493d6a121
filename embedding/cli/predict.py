"""``neocomm predict``: score a Parquet file with a trained model.

    neocomm predict --checkpoint runs/a --data test.parquet --out scores.parquet
    neocomm run -n 2 -- neocomm predict --checkpoint runs/a/checkpoints/step-000000000400 \\
        --data new/ --out scores.parquet --keep event_id

``--checkpoint`` is a checkpoint directory, or a training output directory
(its latest checkpoint). ``--tables EXPORT`` scores with the int8 tables of
an export of that checkpoint (``neocomm checkpoint export``) in place of its
float32 ones; the dense model stays the checkpoint's. The model comes from the checkpoint alone: its
configuration, tables and vocabularies; the input needs the feature
columns it was trained on (the label is optional). The output has, per
input row and in input order, the kept columns (default: every input column
that is not a feature: keys and the label), ``score`` (the probability)
and ``logit``. Runs on any number of ranks. Exit status: 0 written, 1 a
bad checkpoint or input file, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["HELP", "add_arguments", "run"]

HELP = "score a Parquet file with a trained model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from embedding.cli import positive_int

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint, or a training output directory (its latest)")
    parser.add_argument("--data", required=True, nargs="+", metavar="PATH",
                        help="Parquet file(s) or directories to score")
    parser.add_argument("--out", required=True, metavar="FILE.parquet",
                        help="the predictions file (written atomically by rank 0)")
    parser.add_argument("--keep", default=None, metavar="COLS",
                        help="comma-separated input columns to copy beside the scores "
                        "(default: every column that is not a feature)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="rows scored per step over all ranks, a multiple of the ranks "
                        "(default: the model's evaluation batch, rounded down to a multiple "
                        "of the ranks)")
    parser.add_argument("--tables", default=None, metavar="EXPORT",
                        help="an int8 export of the checkpoint (neocomm checkpoint export): "
                        "score with its tables instead of the float32 ones")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="score on NumPy over MPI (cpu) or CuPy over NCCL (cuda); default: "
                        "the model's training device")


def run(args) -> int:
    import neocomm
    from embedding.train.predict import predict
    from embedding.train.types import ConfigError

    world = neocomm.init()
    keep = None
    if args.keep is not None:
        keep = [c.strip() for c in args.keep.split(",") if c.strip()]
    try:
        r = predict(args.checkpoint, args.data, args.out, keep=keep, group=world.world,
                    batch_size=args.batch_size, device=args.device, tables=args.tables)
    except Exception as e:
        if not getattr(e, "agreed", False):
            raise
        if world.rank == 0:
            print(f"neocomm predict: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) and "--" in str(e) else 1
    if world.rank == 0:
        line = (f"wrote {r['rows']:,} predictions to {r['out']} (columns: "
                f"{', '.join(r['columns'])}) from {r['checkpoint']} (step {r['step']})")
        if "tables" in r:
            line += f" with the int8 tables of {r['tables']} ({', '.join(r['int8_tables'])})"
        print(line)
        if "auc" in r:
            print(f"on the input's labels: AUC {r['auc']:.4f}, log-loss {r['log_loss']:.4f}, "
                  f"accuracy {r['accuracy']:.4f}")
    return 0
