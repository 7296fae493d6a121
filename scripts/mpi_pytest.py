"""Run pytest on one MPI rank; ranks other than 0 write their output to a file.

Used by scripts/run_tests.py as ``mpirun -n N python scripts/mpi_pytest.py ARGS``
so that the terminal shows one rank's report, and other ranks' reports are
shown only when they fail.
"""
import os
import sys


def main() -> int:
    from neocomm.logs import rank_from_env

    rank = rank_from_env() or 0
    outdir = os.environ.get("MPI_PYTEST_OUTDIR")
    if outdir and rank != 0:
        fd = os.open(os.path.join(outdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import pytest

    rc = int(pytest.main(["--with-mpi", "-q", "--color=no", "-p", "no:cacheprovider",
                          *sys.argv[1:]]))
    if outdir:
        with open(os.path.join(outdir, f"rank{rank}.rc"), "w") as f:
            f.write(str(rc))
    return rc


if __name__ == "__main__":
    sys.exit(main())
