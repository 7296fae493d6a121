"""The global batch of a run: as given, or the default fitted to the number of ranks.

``train.batch_size`` is the global batch, samples per step over all ranks;
every rank takes an equal slice of it, so each rank's loss weighs the same in
the data-parallel mean. Left at 0 (the default) it is :data:`DEFAULT_BATCH_SIZE`
rounded down to a multiple of the ranks (at least one sample per rank): 2048
on 1, 2, 4 or 8 ranks, 2046 on 3, 2045 on 5. A value given must split evenly;
one that does not is refused naming the nearest values that do.
``train.eval_batch_size`` 0 is the training batch; a value given must split
too.

>>> global_batch(0, 3), global_batch(0, 4), global_batch(1536, 3)
(2046, 2048, 1536)
>>> nearest_multiples(2048, 3)
(2046, 2049)
"""
from __future__ import annotations

import dataclasses

from embedding.train.types import ConfigError

__all__ = ["DEFAULT_BATCH_SIZE", "global_batch", "nearest_multiples", "resolve_batches",
           "batch_note"]

#: samples per step over all ranks when ``train.batch_size`` is 0 (rounded down to a
#: multiple of the ranks)
DEFAULT_BATCH_SIZE = 2048


def nearest_multiples(value: int, ranks: int) -> tuple[int, ...]:
    """The multiples of ``ranks`` nearest to ``value`` (below and above; at least ``ranks``)."""
    below = (value // ranks) * ranks
    above = below + ranks
    return (above,) if below < ranks else (below, above)


#: what 0 stands for, by key
_ZERO = {"train.batch_size": f"the default ({DEFAULT_BATCH_SIZE} rounded down to a multiple "
                             f"of the ranks)",
         "train.eval_batch_size": "the training batch"}


def _split_error(source: str, key: str, value: int, ranks: int) -> ConfigError:
    near = " or ".join(map(str, nearest_multiples(value, ranks)))
    zero = f", or 0 for {_ZERO[key]}" if key in _ZERO else ""
    return ConfigError(source, key, f"{value} samples do not split evenly over {ranks} ranks; "
                       f"use a multiple of {ranks} ({near}){zero}")


def global_batch(given: int, ranks: int, *, source: str = "",
                 key: str = "train.batch_size") -> int:
    """The global batch on ``ranks`` ranks for ``given`` (0: the default, rounded down to a
    multiple of ``ranks``); ConfigError naming ``key`` when a given value does not split."""
    ranks = int(ranks)
    if ranks <= 0:
        raise ValueError(f"ranks: expected > 0, got {ranks}")
    if not given:
        return max(ranks, DEFAULT_BATCH_SIZE // ranks * ranks)
    if given % ranks:
        raise _split_error(source, key, int(given), ranks)
    return int(given)


def resolve_batches(cfg, ranks: int):
    """``cfg`` with ``train.batch_size`` and ``train.eval_batch_size`` as used on ``ranks``
    ranks (both > 0 and multiples of ``ranks``); ConfigError for a given value that does not
    split."""
    tr = cfg.train
    batch = global_batch(tr.batch_size, ranks, source=cfg.source)
    evb = (global_batch(tr.eval_batch_size, ranks, source=cfg.source,
                        key="train.eval_batch_size") if tr.eval_batch_size else batch)
    if (batch, evb) == (tr.batch_size, tr.eval_batch_size):
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(tr, batch_size=batch,
                                                              eval_batch_size=evb))


def batch_note(given: int, ranks: int) -> str:
    """How the global batch of ``given`` came about on ``ranks`` ranks, for the plan line:
    ``"global batch 2046 (default 2048 rounded down to a multiple of 3 ranks)"``."""
    batch = global_batch(given, ranks)
    if given:
        return f"global batch {batch}"
    if batch == DEFAULT_BATCH_SIZE:
        return f"global batch {batch} (default)"
    if batch > DEFAULT_BATCH_SIZE:
        return f"global batch {batch} (default: one sample per rank)"
    return (f"global batch {batch} (default {DEFAULT_BATCH_SIZE} rounded down to a multiple "
            f"of {ranks} ranks)")
