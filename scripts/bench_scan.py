"""Time the scan that builds a Parquet source's vocabularies: every rank alone vs shared.

    neocomm data example -o bigex --records 2000000
    neocomm run -n 2 -- python scripts/bench_scan.py bigex

Prints, for the training file of the example's config, the time when every
rank scans every row group itself and when the ranks share the row groups
(``scan(..., comm=)``, what training does), and whether both give the same
statistics and vocabularies.
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a directory written by `neocomm data example`")
    p.add_argument("--repeat", type=int, default=3, help="best of this many (default 3)")
    args = p.parse_args()
    from mpi4py import MPI

    from embedding.data.parquet import ParquetSource, scan
    from embedding.train import load_config

    comm = MPI.COMM_WORLD
    cfg = load_config(f"{args.data}/train.toml")
    schema = cfg.data.schema()
    src = ParquetSource(cfg.data.path, schema)
    best_alone = best_shared = float("inf")
    for _ in range(args.repeat):
        comm.Barrier()
        t = time.perf_counter()
        alone = scan(src, schema)
        comm.Barrier()
        best_alone = min(best_alone, time.perf_counter() - t)
        t = time.perf_counter()
        shared = scan(src, schema, comm=comm)
        comm.Barrier()
        best_shared = min(best_shared, time.perf_counter() - t)
    same = shared.to_dict() == alone.to_dict() and all(
        shared.vocabularies[k].values.equals(v.values) for k, v in alone.vocabularies.items())
    if comm.rank == 0:
        print(f"{comm.size} rank(s), {src.num_records:,} records in {len(src.row_groups)} row "
              f"groups: every rank scanning all {best_alone:.2f} s, shared {best_shared:.2f} s "
              f"(x{best_alone / best_shared:.2f}); same result: {same}")


if __name__ == "__main__":
    main()
