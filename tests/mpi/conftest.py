"""Shared fixtures for tests that run under mpirun (``--with-mpi``)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def world():
    """The World of this job (NEOCOMM_RANKS_PER_NODE picks emulated nodes)."""
    import neocomm

    return neocomm.init()


def agreed(world, ok: bool) -> bool:
    """True only when ``ok`` holds on every rank (so all ranks fail together)."""
    from mpi4py import MPI

    return bool(world.comm.allreduce(bool(ok), op=MPI.LAND))


@pytest.fixture
def all_ranks(world):
    """``all_ranks(ok, msg)`` asserts ``ok`` on every rank at once, never leaving a rank behind."""

    def check(ok, msg=""):
        assert agreed(world, ok), msg or "failed on at least one rank"

    return check


@pytest.fixture
def rng(world) -> np.random.Generator:
    """A generator that differs per rank but is reproducible."""
    return np.random.default_rng(12345 + world.rank)


@pytest.fixture
def agreements(monkeypatch):
    """How many argument agreements this rank ran (calls' and steps' alike): ``[n]``."""
    from neocomm import agree

    count = [0]
    real = agree.Agreement.run

    def counted(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(agree.Agreement, "run", counted)
    return count


@pytest.fixture
def example(world, tmp_path):
    """The example Parquet data set (3000 records, 250 held out), written by rank 0 into a
    directory every rank sees; its path."""
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    if world.rank == 0:
        from embedding.data.example import write_example

        write_example(base, records=3000, eval_records=250, row_group_size=700)
    world.comm.barrier()
    return base
