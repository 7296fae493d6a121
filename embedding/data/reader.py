"""Rank-sliced batch readers: each rank reads its part of every global batch.

A data set is anything with ``num_records`` and ``read(start, stop) ->
Batch`` (:class:`~embedding.data.binary.BinaryDataset`,
:class:`~embedding.data.synthetic.SyntheticDataset`). Global batch ``i`` of
epoch ``e`` is records ``[p(i) B, (p(i) + 1) B)`` where ``p`` is the identity
or, with ``shuffle``, a permutation drawn from ``(seed, e)``; rank ``r`` of
``n`` takes rows ``[r B/n, (r + 1) B/n)`` of it. With ``shuffle_window``
the records themselves are shuffled instead (:class:`RecordShuffle`). The sequence of global
batches therefore depends on the seed only, never on the world size.

:class:`BroadcastReader` lets one reader rank read whole global batches and
send each rank its slice through an injected transport (OneToMany).
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

import numpy as np

from embedding.data.batch import Batch, shard_bounds

__all__ = ["Dataset", "ShardedReader", "BroadcastReader", "Transport", "one_to_many_transport",
           "RecordShuffle", "take"]


class Dataset(Protocol):
    """What a reader reads: ``num_records`` records, any range as a :class:`Batch`."""

    num_records: int

    def read(self, start: int, stop: int) -> Batch: ...


#: ``transport(pieces, root) -> piece``: on ``root``, ``pieces[r]`` is the
#: uint8 buffer for rank ``r`` (its own included); elsewhere ``pieces`` is
#: None. Every rank gets back its own buffer. A OneToMany.
Transport = Callable[[list | None, int], np.ndarray]


def take(dataset, records) -> Batch:
    """Records ``records`` (any order) of ``dataset``: its own ``read_records`` when it has
    one, else one ``read`` per run of consecutive records."""
    records = np.asarray(records, np.int64)
    own = getattr(dataset, "read_records", None)
    if own is not None:
        return own(records)
    order = np.argsort(records, kind="stable")
    sorted_ = records[order]
    breaks = np.flatnonzero(np.diff(sorted_) != 1) + 1
    parts = [dataset.read(int(run[0]), int(run[-1]) + 1)
             for run in np.split(sorted_, breaks) if run.size]
    whole = parts[0] if len(parts) == 1 else Batch.concat(parts)
    # whole holds sorted_ (each distinct run once); put the rows back in the asked order
    pos = np.empty(records.size, np.int64)
    pos[order] = np.arange(records.size)
    return whole.take(pos) if not np.array_equal(pos, np.arange(records.size)) else whole


class RecordShuffle:
    """An epoch's order of the records: blocks shuffled, then records within windows.

    The records fall into blocks (``dataset.blocks()``, a Parquet file's row
    groups, when it has them and they are not None; else runs of ``block``
    records). An epoch
    permutes the blocks, cuts the permuted sequence into windows of about
    ``window`` records, and permutes the records within each window, each
    permutation drawn from ``(seed, epoch, ...)``. Every record comes once
    per epoch, records from different files and row groups mix, and a batch
    only touches the blocks of one or two windows, so a reader keeps at most
    a window's blocks decoded. The order depends on the seed and the epoch
    only: a resumed run reads the same records.
    """

    def __init__(self, dataset, window: int, seed: int, block: int = 8192):
        n = int(dataset.num_records)
        blocks = getattr(dataset, "blocks", None)
        spans = blocks() if blocks is not None else None
        if spans is None:
            spans = [(a, min(block, n - a)) for a in range(0, n, block)]
        self.starts = np.array([a for a, _ in spans], np.int64)
        self.sizes = np.array([m for _, m in spans], np.int64)
        self.window = max(1, int(window))
        self.seed = int(seed)
        self.num_records = n
        self._epoch = None
        self._cache: dict[int, np.ndarray] = {}

    def _layout(self, epoch: int):
        if self._epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch, 0])
            order = rng.permutation(len(self.sizes))
            sizes = self.sizes[order]
            ends = np.cumsum(sizes)
            # window w holds the permuted blocks whose start falls in [w W, (w + 1) W)
            win = (ends - sizes) // self.window
            edges = np.flatnonzero(np.diff(win)) + 1
            self._groups = np.split(order, edges)
            self._bounds = np.concatenate([[0], np.cumsum([self.sizes[g].sum()
                                                           for g in self._groups])])
            self._epoch, self._cache = epoch, {}
        return self._groups, self._bounds

    def records(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """The records at positions ``[start, stop)`` of epoch ``epoch``'s order."""
        groups, bounds = self._layout(epoch)
        out = []
        w = int(np.searchsorted(bounds, start, side="right")) - 1
        pos = start
        while pos < stop:
            recs = self._cache.get(w)
            if recs is None:
                g = groups[w]
                recs = np.concatenate([np.arange(self.starts[b], self.starts[b] + self.sizes[b])
                                       for b in g])
                recs = recs[np.random.default_rng([self.seed, epoch, 1, w]).permutation(
                    recs.size)]
                self._cache = {w: recs}  # one window at a time
            a, b = pos - bounds[w], min(stop, bounds[w + 1]) - bounds[w]
            out.append(recs[a:b])
            pos = bounds[w] + b
            w += 1
        return np.concatenate(out) if len(out) > 1 else out[0]


class ShardedReader:
    """Iterates this rank's slice of each global batch of ``dataset``, epoch after epoch.

    ``global_batch_size`` must be a multiple of ``world_size``; the last
    partial global batch of an epoch is dropped. The position
    (:meth:`state_dict`) is ``(epoch, batch)``: the next global batch to read.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int, rank: int = 0,
                 world_size: int = 1, *, shuffle: bool = False, seed: int = 0,
                 shuffle_window: int = 0):
        self.dataset = dataset
        self.global_batch_size = int(global_batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.start, self.stop = shard_bounds(self.global_batch_size, self.rank, self.world_size)
        self.num_batches = int(dataset.num_records) // self.global_batch_size
        if self.num_batches == 0:
            raise ValueError(f"global_batch_size: {global_batch_size} is larger than the data "
                             f"set ({dataset.num_records} records)")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.batch = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        #: record-level shuffling (``shuffle`` and a window > 0): see RecordShuffle
        self.records = (RecordShuffle(dataset, shuffle_window, self.seed)
                        if self.shuffle and shuffle_window > 0 else None)

    @property
    def local_batch_size(self) -> int:
        return self.stop - self.start

    def global_index(self, epoch: int, batch: int) -> int:
        """Which global batch of the data set is batch ``batch`` of ``epoch``."""
        if not self.shuffle:
            return batch
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.num_batches)
            self._order_epoch = epoch
        return int(self._order[batch])

    def read_global(self, epoch: int, batch: int, rank: int | None = None) -> Batch:
        """Rank ``rank``'s slice (this rank's by default) of batch ``batch`` of ``epoch``."""
        if not 0 <= batch < self.num_batches:
            raise ValueError(f"batch: expected 0 <= batch < {self.num_batches}, got {batch}")
        a, b = ((self.start, self.stop) if rank is None else
                shard_bounds(self.global_batch_size, rank, self.world_size))
        if self.records is not None:
            base = batch * self.global_batch_size
            return take(self.dataset, self.records.records(epoch, base + a, base + b))
        base = self.global_index(epoch, batch) * self.global_batch_size
        return self.dataset.read(base + a, base + b)

    def next(self) -> Batch:
        """This rank's slice of the next global batch; moves to the next epoch at the end."""
        out = self.read_global(self.epoch, self.batch)
        self._advance()
        return out

    def _advance(self) -> None:
        self.batch += 1
        if self.batch == self.num_batches:
            self.epoch, self.batch = self.epoch + 1, 0

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next()

    def state_dict(self) -> dict:
        """The position as JSON-ready ints: ``{"epoch", "batch", "seed", "global_batch_size"}``."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from :meth:`state_dict` (same seed and global batch size)."""
        if int(state["seed"]) != self.seed or int(state["global_batch_size"]) != \
                self.global_batch_size:
            raise ValueError(f"state: written for seed {state['seed']} and global batch "
                             f"{state['global_batch_size']}, this reader has seed {self.seed} "
                             f"and global batch {self.global_batch_size}")
        batch = int(state["batch"])
        if not 0 <= batch < self.num_batches:
            raise ValueError(f"state: batch {batch} is outside [0, {self.num_batches})")
        self.epoch, self.batch = int(state["epoch"]), batch

    def carry_over(self, state: dict) -> dict:
        """This reader's position for ``state``, a position written with another global
        batch (same seed): in record order, or records shuffled in windows, the first of
        this reader's batches that starts at or after the records ``state`` had read of
        its epoch (fewer than one batch of that epoch's records go unread); with whole
        batches shuffled (their order depends on the batch size) the next epoch."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state: written for seed {state['seed']}, this reader has "
                             f"seed {self.seed}")
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if batch and self.shuffle and self.records is None:
            epoch, batch = epoch + 1, 0
        else:
            done = batch * int(state["global_batch_size"])  # records read of the epoch
            batch = -(-done // self.global_batch_size)
            if batch >= self.num_batches:
                epoch, batch = epoch + 1, 0
        return {"epoch": epoch, "batch": batch, "seed": self.seed,
                "global_batch_size": self.global_batch_size}


class BroadcastReader:
    """One reader rank reads whole global batches and sends each rank its slice.

    Every rank calls :meth:`next` in step; ``transport`` (a OneToMany, see
    :data:`Transport`) carries the packed slices (:meth:`Batch.pack`). The
    batches each rank gets are exactly those of a :class:`ShardedReader`
    with the same data set, batch size and seed. Only ``root`` touches
    ``dataset``; elsewhere it may be None. ``transport=None`` uses
    :func:`one_to_many_transport` on the world group (``rank`` and
    ``world_size`` are then world ranks).
    """

    def __init__(self, dataset: Dataset | None, global_batch_size: int, rank: int,
                 world_size: int, transport: Transport | None = None, *, root: int = 0,
                 shuffle: bool = False, seed: int = 0, feature_names=(),
                 shuffle_window: int = 0):
        if not 0 <= root < world_size:
            raise ValueError(f"root: expected 0 <= root < {world_size}, got {root}")
        if transport is None:
            transport = one_to_many_transport()
        if not callable(transport):
            raise TypeError(f"transport: expected a callable, got {type(transport).__name__}")
        self.global_batch_size = int(global_batch_size)
        self.rank, self.world_size, self.root = int(rank), int(world_size), int(root)
        self.start, self.stop = shard_bounds(self.global_batch_size, self.rank, self.world_size)
        self.transport = transport
        self.feature_names = tuple(feature_names)
        self._reader = None
        if self.rank == self.root:
            if dataset is None:
                raise ValueError("dataset: the root rank of a BroadcastReader needs a data set")
            self._reader = ShardedReader(dataset, global_batch_size, 0, 1, shuffle=shuffle,
                                         seed=seed, shuffle_window=shuffle_window)
            self.feature_names = self.feature_names or getattr(dataset, "feature_names", ())

    def next(self) -> Batch:
        """This rank's slice of the next global batch (a collective over all ranks)."""
        if self.rank == self.root:
            full = self._reader.next()
            pieces = [full.shard(r, self.world_size).pack() for r in range(self.world_size)]
            own = self.transport(pieces, self.root)
        else:
            own = self.transport(None, self.root)
        return Batch.unpack(np.asarray(own, np.uint8), self.feature_names)

    def state_dict(self) -> dict:
        """The root reader's position (meaningful on the root rank)."""
        return self._reader.state_dict() if self._reader is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Resume the root reader; other ranks ignore ``state``."""
        if self._reader is not None:
            self._reader.load_state_dict(state)

    def carry_over(self, state: dict) -> dict:
        """:meth:`ShardedReader.carry_over` of the root reader ({} elsewhere)."""
        return self._reader.carry_over(state) if self._reader is not None else {}


def one_to_many_transport(group=None) -> Transport:
    """A :data:`Transport` over ``collectives.one_to_many`` on ``group`` (None: the world group).

    The root broadcasts the byte size of every rank's piece (receivers of a
    jagged batch cannot know it), then sends every other rank its piece with
    one OneToMany of distinct payloads; the root keeps its own piece without
    a copy through the collective. Every rank of the group must call it.
    """
    def transport(pieces, root: int) -> np.ndarray:
        from collectives import broadcast, one_to_many

        from neocomm.world import group_or_world

        g = group_or_world(group)
        others = [r for r in range(g.size) if r != root]
        if not others:  # a group of one: nothing to send
            return np.asarray(pieces[root], np.uint8)
        counts = np.zeros(len(others), np.int64)
        if pieces is not None:
            if len(pieces) != g.size:
                raise ValueError(f"pieces: expected one buffer per rank of the group "
                                 f"({g.size}), got {len(pieces)}")
            counts[:] = [np.asarray(pieces[r]).size for r in others]
        broadcast(counts, root=root, group=g)
        send = (np.concatenate([np.asarray(pieces[r], np.uint8) for r in others])
                if pieces is not None else None)
        got = one_to_many(send, root=root, ranks=others, counts=counts, group=g)
        return np.asarray(pieces[root], np.uint8) if pieces is not None else got

    return transport
