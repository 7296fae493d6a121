"""``neocomm train``: train a DLRM with sharded embeddings and data-parallel dense layers.

Run on every rank of an MPI job::

    neocomm run -n 4 -- neocomm train                     # built-in defaults, synthetic data
    neocomm run -n 4 -- neocomm train --config train.toml --steps 2000 --out runs/a
    neocomm run -n 4 -- neocomm train --config train.toml --resume   # the latest checkpoint

With no arguments it trains a small model on synthetic data with a planted
model and reports the held-out AUC next to the planted model's.
``--print-config`` prints every setting (a starting point for a config
file). Exit status, the same on every rank: 0 trained, 1 training stopped
(bad data, a non-finite tensor, an unusable checkpoint, tables that do not
fit), 2 a bad configuration or option.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["HELP", "add_arguments", "run"]

HELP = "train a DLRM with sharded embeddings"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML configuration (see docs/training.md); default: built-in "
                        "settings (synthetic data, a small model)")
    parser.add_argument("--steps", type=_count, default=None,
                        help="train until this many steps are done (train.steps)")
    parser.add_argument("--batch-size", type=_count, default=None,
                        help="global batch, samples per step over all ranks, a multiple of "
                        "the ranks (train.batch_size; default 2048 rounded down to a multiple "
                        "of the ranks)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="output directory: metrics log, checkpoints, plot "
                        "(output.dir; default neocomm-out)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                        help="resume from the latest checkpoint, or from CKPT (a checkpoint "
                        "directory); 'auto' resumes when there is one")
    parser.add_argument("--plan", metavar="PLAN.json", default=None,
                        help="train with this sharding plan (from neocomm plan --config ... "
                        "--json PLAN.json) instead of planning (plan.file)")
    parser.add_argument("--seed", type=_count, default=None,
                        help="seed of the initial weights and the data (train.seed)")
    parser.add_argument("--plot", action="store_true", default=None,
                        help="draw loss and AUC against steps into DIR/metrics.png (matplotlib)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                        help="run the input dist and the dense AllReduce without overlap")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="train on NumPy arrays over MPI (cpu) or on CuPy arrays on each "
                        "rank's GPU over NCCL (cuda) (train.device)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as TOML and exit")


def _config(args):
    from embedding.train import apply_overrides, load_config

    cfg = load_config(args.config)
    return apply_overrides(cfg, steps=args.steps, batch_size=args.batch_size, out=args.out,
                           resume=args.resume, seed=args.seed, plot=args.plot,
                           overlap=args.overlap, device=args.device, plan=args.plan)


def run(args) -> int:
    from embedding.train import ConfigError

    cfg, exc = None, None
    try:
        cfg = _config(args)
    except ConfigError as e:
        exc = e
    if args.print_config:
        if exc is not None:
            print(f"neocomm train: error: {exc}", file=sys.stderr)
            return 2
        from embedding.train import to_toml

        sys.stdout.write(to_toml(cfg))
        return 0
    import neocomm

    world = neocomm.init()
    if exc is None and args.batch_size:  # named as the user gave it
        from embedding.train.batching import global_batch

        try:
            global_batch(args.batch_size, world.size, source="command line",
                         key="--batch-size")
        except ConfigError as e:
            exc = e
    try:
        return _train(world, cfg, exc)
    except Exception as e:  # agreed errors end here; anything else aborts the job
        if not getattr(e, "agreed", False):
            raise
        if world.rank == 0:
            print(f"neocomm train: error: {e}", file=sys.stderr)
            sys.stderr.flush()
        return 2 if isinstance(e, ConfigError) else 1


def _train(world, cfg, exc) -> int:
    from embedding.train import Trainer
    from embedding.train.setup import fail_together

    fail_together(world.world, "configuration", exc)
    trainer = Trainer(cfg, world.world)
    out = sys.stdout if world.rank == 0 else None
    try:
        if world.rank == 0:
            _header(trainer, world)
        if cfg.checkpoint.resume:
            trainer.resume(cfg.checkpoint.resume)
        result = trainer.train()
    except BaseException as e:
        # An agreed error stopped every rank at the same point: finish what is in flight.
        # Anything else is this rank's alone: do not wait for peers, let the job abort.
        trainer.close(drain=bool(getattr(e, "agreed", False)))
        raise
    trainer.close()
    plot_line = None
    if cfg.output.plot and world.rank == 0:
        plot_line = _plot(trainer)
    if world.rank == 0:
        _summary(trainer, result, plot_line, out)
    return 0


def _header(trainer, world) -> None:
    from embedding.train.loop import data_source_name

    cfg = trainer.cfg
    rows = sum(t.num_rows for t in trainer.tables)
    plan = ", ".join(f"{k} x{len(v)}" for k, v in trainer.describe_plan().items())
    print(f"neocomm train: {world.size} rank(s), {len(trainer.tables)} tables "
          f"({rows:,} rows, dim {cfg.model.embedding_dim}), plan: {plan}")
    from embedding.train.batching import batch_note

    print(f"  data: {data_source_name(cfg)}; {batch_note(trainer.given_batch, world.size)}, "
          f"{cfg.train.steps} steps; overlap {'on' if cfg.train.overlap else 'off'}; "
          f"{trainer.threads} thread(s) per rank")
    sys.stdout.flush()


def _plot(trainer) -> str:
    from embedding.train import PlotUnavailable, plot_metrics

    target = trainer.out_dir / "metrics.png"
    try:
        return str(plot_metrics(trainer.metrics.path, target))
    except PlotUnavailable as exc:
        return f"not written: {exc}"


def _summary(trainer, result, plot_line, out) -> None:
    w = lambda *a: print(*a, file=out)  # noqa: E731
    if result.steps_run:
        w(f"trained {result.steps_run} step(s) ({result.samples:,} samples) in "
          f"{result.seconds:.1f} s on {trainer.size} rank(s): "
          f"{result.samples / max(result.seconds, 1e-9):,.0f} samples/s; "
          f"final loss {result.loss:.4f}")
    else:
        w(f"nothing to train: step {result.step} of {trainer.cfg.train.steps} is done")
    if result.auc is not None:
        from embedding.train.loop import describe_eval

        line = describe_eval(trainer.last_eval, thousands=True)
        if result.planted_auc is not None:
            line += f"; the planted model's AUC on them: {result.planted_auc:.4f}"
        w(line)
    w("outputs:")
    w(f"  metrics log  {result.metrics_path}")
    w(f"  checkpoint   {result.checkpoint}")
    if plot_line is not None:
        w(f"  plot         {plot_line}")
    out.flush()
