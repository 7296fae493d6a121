"""Jagged sparse input keyed by feature: the ids of one local batch.

:class:`KeyedJagged` is a small cousin of TorchRec's ``KeyedJaggedTensor``.
For features ``keys = (f0, f1, ...)`` and a batch of ``B`` samples it holds

- ``lengths``: ``len(keys) * B`` non-negative counts, feature-major: bag
  ``(f, b)`` (feature ``f``, sample ``b``) has ``lengths[f * B + b]`` ids;
- ``values``: the ids of every bag, concatenated in the same order (int64);
- ``weights``: optional per-id weights, one per value (float).

Example (two features, batch 2)::

    keys    = ("user", "item")
    lengths = [2, 0,   1, 3]        # user: [a b] []   item: [c] [d e f]
    values  = [a, b,   c, d, e, f]

Construction checks the structure (lengths sum to the number of values, no
negative lengths, one weight per id). :meth:`check_ids` checks the ids
against the tables that read them and applies each table's
:class:`~embedding.types.IdPolicy`. Every error names the feature and the
offending value.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from embedding.types import IdPolicy, enum_arg

__all__ = ["KeyedJagged", "JaggedFeature", "hash_ids", "apply_id_policy"]

_SPLITMIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_SPLITMIX_2 = np.uint64(0x94D049BB133111EB)


class JaggedFeature:
    """The bags of one feature: ``values`` (ids), ``lengths`` (per sample), ``weights`` or None."""

    __slots__ = ("key", "values", "lengths", "weights")

    def __init__(self, key: str, values, lengths, weights=None):
        self.key = key
        self.values = values
        self.lengths = lengths
        self.weights = weights

    @property
    def offsets(self) -> np.ndarray:
        """``len(lengths) + 1`` bag boundaries into ``values``."""
        out = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def bags(self) -> list[list[int]]:
        """The ids per sample as Python lists (for tests and debugging)."""
        off = self.offsets
        return [self.values[off[b]:off[b + 1]].tolist() for b in range(len(self.lengths))]


class KeyedJagged:
    """Ids of several features for one local batch, feature-major (see module doc).

    ``batch_size`` defaults to ``len(lengths) // len(keys)``; it is required
    when there are no keys. Arrays are NumPy; ``values`` are converted to
    int64 and ``lengths`` to int64.
    """

    __slots__ = ("keys", "values", "lengths", "weights", "batch_size", "_offsets", "_index")

    def __init__(self, keys: Sequence[str], values, lengths, weights=None,
                 batch_size: int | None = None):
        keys = tuple(keys)
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError(f"keys: expected non-empty feature names, got {k!r}")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"keys: feature names must be unique, got duplicates {dup}")
        values = np.asarray(values)
        lengths = np.asarray(lengths)
        if values.ndim != 1:
            raise ValueError(f"values: expected a 1-D array of ids, got shape {values.shape}")
        if lengths.ndim != 1:
            raise ValueError(f"lengths: expected a 1-D array, got shape {lengths.shape}")
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"values: expected integer ids, got dtype {values.dtype}")
        if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(f"lengths: expected integer lengths, got dtype {lengths.dtype}")
        if batch_size is None:
            if not keys:
                raise ValueError("batch_size: required when keys is empty")
            if lengths.size % len(keys):
                raise ValueError(f"lengths: expected len(keys) * batch_size = a multiple of "
                                 f"{len(keys)} entries, got {lengths.size}")
            batch_size = lengths.size // len(keys)
        batch_size = int(batch_size)
        if batch_size < 0:
            raise ValueError(f"batch_size: expected >= 0, got {batch_size}")
        if lengths.size != len(keys) * batch_size:
            raise ValueError(f"lengths: expected {len(keys)} features x {batch_size} samples = "
                             f"{len(keys) * batch_size} entries, got {lengths.size}")
        values = values.astype(np.int64, copy=False)
        lengths = lengths.astype(np.int64, copy=False)
        if lengths.size and lengths.min() < 0:
            pos = int(np.argmin(lengths))
            raise ValueError(f"lengths of feature {keys[pos // batch_size]!r}: expected >= 0, got "
                             f"{int(lengths[pos])} for sample {pos % batch_size}")
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != values.size:
            raise ValueError(f"lengths: sum to {int(offsets[-1])} ids but values holds "
                             f"{values.size}")
        if weights is not None:
            weights = np.asarray(weights)
            if not np.issubdtype(weights.dtype, np.floating):
                raise TypeError(f"weights: expected floating per-id weights, got dtype "
                                f"{weights.dtype}")
            if weights.shape != values.shape:
                raise ValueError(f"weights: expected one weight per id, shape {values.shape}, "
                                 f"got {weights.shape}")
        self.keys = keys
        self.values = values
        self.lengths = lengths
        self.weights = weights
        self.batch_size = batch_size
        self._offsets = offsets
        self._index = {k: i for i, k in enumerate(keys)}

    # -- construction helpers ------------------------------------------
    @classmethod
    def from_dict(cls, features: Mapping[str, object], batch_size: int | None = None
                  ) -> "KeyedJagged":
        """Build from ``{key: (values, lengths[, weights])}`` or ``{key: JaggedFeature}``."""
        keys, vals, lens, wts = [], [], [], []
        for key, item in features.items():
            if isinstance(item, JaggedFeature):
                v, ln, w = item.values, item.lengths, item.weights
            else:
                if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                    raise TypeError(f"features[{key!r}]: expected (values, lengths[, weights]), "
                                    f"got {type(item).__name__}")
                v, ln, w = (tuple(item) + (None,))[:3]
            keys.append(key)
            vals.append(np.asarray(v, np.int64).ravel())
            lens.append(np.asarray(ln, np.int64).ravel())
            wts.append(w)
        if batch_size is None and keys:
            sizes = {len(ln) for ln in lens}
            if len(sizes) != 1:
                raise ValueError(f"lengths: every feature needs one length per sample, got "
                                 f"{dict(zip(keys, map(len, lens)))}")
        weighted = [w is not None for w in wts]
        if any(weighted) and not all(weighted):
            missing = [k for k, w in zip(keys, weighted) if not w]
            raise ValueError(f"weights: given for some features but not for {missing}")
        weights = (np.concatenate([np.asarray(w).ravel() for w in wts])
                   if keys and all(weighted) else None)
        return cls(keys, np.concatenate(vals) if vals else np.zeros(0, np.int64),
                   np.concatenate(lens) if lens else np.zeros(0, np.int64), weights,
                   batch_size=batch_size)

    @classmethod
    def from_lists(cls, features: Mapping[str, Sequence[Sequence[int]]],
                   weights: Mapping[str, Sequence[Sequence[float]]] | None = None
                   ) -> "KeyedJagged":
        """Build from ``{key: [[ids of sample 0], [ids of sample 1], ...]}`` (tests, examples)."""
        d = {}
        for key, bags in features.items():
            lens = [len(b) for b in bags]
            vals = [int(i) for b in bags for i in b]
            if weights is not None:
                w = np.asarray([float(x) for b in weights[key] for x in b], np.float64)
                d[key] = (np.asarray(vals, np.int64), np.asarray(lens, np.int64), w)
            else:
                d[key] = (np.asarray(vals, np.int64), np.asarray(lens, np.int64))
        return cls.from_dict(d)

    # -- access ---------------------------------------------------------
    @property
    def offsets(self) -> np.ndarray:
        """``len(lengths) + 1`` bag boundaries into ``values`` (int64)."""
        return self._offsets

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return (f"KeyedJagged(keys={list(self.keys)}, batch_size={self.batch_size}, "
                f"ids={self.values.size}, weighted={self.weights is not None})")

    def value_range(self, key: str) -> tuple[int, int]:
        """``[start, end)`` of feature ``key``'s ids in ``values``."""
        i = self._key_index(key)
        b = self.batch_size
        return int(self._offsets[i * b]), int(self._offsets[(i + 1) * b])

    def feature(self, key: str) -> JaggedFeature:
        """The bags of one feature (views, no copy)."""
        i = self._key_index(key)
        s, e = self.value_range(key)
        b = self.batch_size
        return JaggedFeature(key, self.values[s:e], self.lengths[i * b:(i + 1) * b],
                             None if self.weights is None else self.weights[s:e])

    def to_dict(self) -> dict[str, JaggedFeature]:
        return {k: self.feature(k) for k in self.keys}

    def _key_index(self, key: str) -> int:
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"feature {key!r} is not in this input (features: "
                           f"{list(self.keys)})") from None

    def select(self, keys: Iterable[str]) -> "KeyedJagged":
        """The given features, in the given order (copies)."""
        keys = tuple(keys)
        feats = [self.feature(k) for k in keys]
        vals = np.concatenate([f.values for f in feats]) if feats else np.zeros(0, np.int64)
        lens = np.concatenate([f.lengths for f in feats]) if feats else np.zeros(0, np.int64)
        w = (np.concatenate([f.weights for f in feats])
             if self.weights is not None and feats else None)
        return KeyedJagged(keys, vals, lens, w, batch_size=self.batch_size)

    # -- validation -------------------------------------------------------
    def check_features(self, expected: Iterable[str]) -> None:
        """ValueError unless the keys are exactly ``expected`` (order free)."""
        expected = tuple(expected)
        missing = [k for k in expected if k not in self._index]
        unknown = [k for k in self.keys if k not in set(expected)]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing features {missing}")
            if unknown:
                parts.append(f"unknown features {unknown}")
            raise ValueError(f"keys: {' and '.join(parts)} (expected {sorted(expected)})")

    def check_ids(self, num_rows: Mapping[str, int],
                  policies: Mapping[str, IdPolicy] | None = None,
                  offsets: Mapping[str, int] | None = None) -> "KeyedJagged":
        """Check every feature's ids against ``num_rows[feature]`` and apply its policy.

        Features with :attr:`IdPolicy.ERROR` (the default) raise ValueError
        naming the feature, the first bad id and its sample when an id is
        negative or ``>= num_rows``. Features with ``MODULO``/``HASH`` have
        their ids mapped into range. Features whose ``num_rows`` is None (a
        dynamic table's) take any int64 id, unchecked. ``offsets[feature]`` (a table packed
        with others, :mod:`embedding.packing`) is added to the feature's checked and mapped
        ids, in the same pass that maps them. Returns ``self`` when nothing was mapped or
        moved, else a new :class:`KeyedJagged` with the new values.
        """
        policies = policies or {}
        offsets = offsets or {}
        self.check_features(num_rows)
        new_values = None
        for i, key in enumerate(self.keys):
            if num_rows[key] is None:  # a dynamic table: any int64 id, as it is
                continue
            rows = int(num_rows[key])
            policy = enum_arg(IdPolicy, policies.get(key, IdPolicy.ERROR), f"policies[{key!r}]")
            s, e = self.value_range(key)
            ids = self.values[s:e]
            if policy is IdPolicy.ERROR:
                if ids.size:
                    lo, hi = int(ids.min()), int(ids.max())
                    if lo < 0 or hi >= rows:
                        bad_pos = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
                        bad = int(ids[bad_pos])
                        sample = int(np.searchsorted(
                            self._offsets[i * self.batch_size + 1:(i + 1) * self.batch_size + 1],
                            s + bad_pos, side="right"))
                        raise ValueError(f"values of feature {key!r}: id {bad} (sample {sample}) "
                                         f"is outside [0, {rows}); declare a hash or modulo "
                                         f"id policy for its table to map such ids")
            offset = int(offsets.get(key, 0))
            if policy is IdPolicy.ERROR and not offset:
                continue
            if new_values is None:
                new_values = self.values.copy()
            if policy is not IdPolicy.ERROR:
                new_values[s:e] = apply_id_policy(ids, rows, policy)
            if offset:
                new_values[s:e] += offset
        if new_values is None:
            return self
        return KeyedJagged(self.keys, new_values, self.lengths, self.weights,
                           batch_size=self.batch_size)


def hash_ids(ids, xp=np):
    """splitmix64 finaliser of each id (as uint64); works for NumPy and CuPy arrays."""
    x = ids.astype(xp.uint64, copy=True)
    x ^= x >> xp.uint64(30)
    x *= xp.uint64(_SPLITMIX_1)
    x ^= x >> xp.uint64(27)
    x *= xp.uint64(_SPLITMIX_2)
    x ^= x >> xp.uint64(31)
    return x


def apply_id_policy(ids, num_rows: int, policy: IdPolicy, xp=np):
    """Map ``ids`` into ``[0, num_rows)`` by ``policy`` (ERROR returns them unchanged)."""
    policy = enum_arg(IdPolicy, policy, "policy")
    if policy is IdPolicy.ERROR:
        return ids
    if policy is IdPolicy.MODULO:
        return xp.mod(ids.astype(xp.int64, copy=False), xp.int64(num_rows))
    with np.errstate(over="ignore"):
        return (hash_ids(ids, xp) % xp.uint64(num_rows)).astype(xp.int64)
