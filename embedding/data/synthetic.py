"""A synthetic Criteo-shaped data set with a planted model, and table-size presets.

The presets are a view of :data:`embedding.presets.TABLE_SETS`, the table sets
the planner plans too.

Every record is a pure function of ``(seed, record index)`` (counter-based
hashing, no sequential random state), so any rank can produce any slice of
any global batch, and 1, 2 or 4 ranks see exactly the same global batches.

Record ``i``:

* dense feature ``j``: a hidden normal ``z_j``; the raw count is
  ``floor(exp(mu_j + s_j z_j)) - 1`` (so -1 occurs, as in Criteo), missing
  with probability ``dense_missing``; the feature is ``log(1 + max(count, 0))``
  (0 when missing);
* sparse feature ``f``: a popularity rank ``k`` drawn from a truncated Zipf
  law ``P(k) ~ (k + 1)^-alpha_f`` over the ``n_f`` rows, mapped to a row by
  a fixed bijection ``row = (a_f k + b_f) mod n_f`` (hot rows are spread over
  the table, not bunched at its start);
* label: Bernoulli(sigmoid(logit)) with the planted logit
  ``bias + sum_f w_f[row_f] + sum_j v_j z_j`` (missing ``z_j`` count as 0),
  where ``w_f[row] ~ N(0, sigma_s^2)`` is a hidden per-row weight (a hash of
  the row, so no table is stored) and ``v`` a hidden dense weight vector.
  ``logit_std`` sets the spread of the planted logit and ``dense_share`` the
  part of its variance that the dense features carry.

:func:`planted_auc` measures the AUC of the planted probabilities against
the sampled labels: the best AUC any model can reach on this data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from embedding.data.batch import Batch
from embedding.data.types import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from embedding.presets import TABLE_SETS, scale_table_sizes, table_rows, trainer_preset_names

__all__ = ["SyntheticConfig", "SyntheticDataset", "planted_auc", "scale_table_sizes",
           "table_size_preset", "TABLE_PRESETS"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 with good avalanche."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix64_int(x: int) -> int:
    """:func:`_mix64` of one Python int (no NumPy scalar overflow warnings)."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), a pure function of ``(seed, stream, index)``."""
    key = np.uint64(_mix64_int(_mix64_int(seed) * 0x100000001B3 + stream * 0x9E37 + 1))
    h = _mix64(_mix64(index.astype(np.uint64) * _GOLDEN + key) ^ key)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _normal(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Standard normals (Box-Muller on two counter-based uniforms)."""
    u1 = _uniform(seed, 2 * stream, index)
    u2 = _uniform(seed, 2 * stream + 1, index)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


#: Rows per feature of the table sets the trainer can train, by name: a view of
#: :data:`embedding.presets.TABLE_SETS` (the one registry, shared with the planner).
TABLE_PRESETS: dict[str, tuple[int, ...]] = {name: TABLE_SETS[name].rows
                                             for name in trainer_preset_names()}


def table_size_preset(name: str) -> tuple[int, ...]:
    """Table sizes of the preset ``name`` (:func:`embedding.presets.table_rows`)."""
    return table_rows(name)


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape and planted model of a synthetic data set (all values unitless)."""

    table_sizes: tuple[int, ...] = TABLE_PRESETS["criteo-1tb-1000x"]
    num_dense: int = NUM_DENSE
    seed: int = 0
    zipf_alpha: float | tuple[float, ...] = 1.1
    logit_std: float = 1.42
    dense_share: float = 0.3
    bias: float = -1.6
    dense_missing: float = 0.1
    feature_names: tuple[str, ...] = field(default=())

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.table_sizes)
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"table_sizes: expected positive sizes, got {sizes}")
        object.__setattr__(self, "table_sizes", sizes)
        alpha = self.zipf_alpha
        alpha = (float(alpha),) * len(sizes) if np.isscalar(alpha) else tuple(map(float, alpha))
        if len(alpha) != len(sizes) or min(alpha) <= 0:
            raise ValueError(f"zipf_alpha: expected a positive exponent or one per table, "
                             f"got {self.zipf_alpha}")
        object.__setattr__(self, "zipf_alpha", alpha)
        if self.num_dense < 0:
            raise ValueError(f"num_dense: expected >= 0, got {self.num_dense}")
        if not 0 <= self.dense_share <= 1:
            raise ValueError(f"dense_share: expected in [0, 1], got {self.dense_share}")
        if not 0 <= self.dense_missing < 1:
            raise ValueError(f"dense_missing: expected in [0, 1), got {self.dense_missing}")
        if self.logit_std < 0:
            raise ValueError(f"logit_std: expected >= 0, got {self.logit_std}")
        if self.dense_share == 1 and self.num_dense == 0:
            raise ValueError("dense_share: 1 needs dense features (num_dense > 0)")
        if not self.feature_names:
            names = SPARSE_NAMES if len(sizes) == NUM_SPARSE else tuple(
                f"f{i}" for i in range(len(sizes)))
            object.__setattr__(self, "feature_names", names)


class SyntheticDataset:
    """``num_records`` synthetic records; :meth:`read` returns any range as a :class:`Batch`."""

    def __init__(self, config: SyntheticConfig | None = None, num_records: int = 1 << 20):
        self.config = config or SyntheticConfig()
        if num_records <= 0:
            raise ValueError(f"num_records: expected > 0, got {num_records}")
        self.num_records = int(num_records)
        c = self.config
        self.table_sizes = c.table_sizes
        self.num_dense = c.num_dense
        self.num_sparse = len(c.table_sizes)
        self.feature_names = c.feature_names
        rng = np.random.default_rng([c.seed, 0x5EED])
        self._mu = rng.uniform(0.5, 4.0, c.num_dense)
        self._s = rng.uniform(0.5, 1.5, c.num_dense)
        g = rng.standard_normal(c.num_dense)
        dense_var = c.logit_std ** 2 * c.dense_share
        self._v = (g * math.sqrt(dense_var / max((g ** 2).sum(), 1e-12))
                   if c.num_dense else g)
        self._sigma_s = c.logit_std * math.sqrt((1 - c.dense_share) / self.num_sparse)
        self._perm = []
        for n in c.table_sizes:
            a = int(rng.integers(1, n)) if n > 1 else 1
            while math.gcd(a, n) != 1:
                a += 1
            self._perm.append((a, int(rng.integers(0, n))))

    def __len__(self) -> int:
        return self.num_records

    def _check(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.num_records}, "
                             f"got {start}, {stop}")
        return np.arange(start, stop, dtype=np.uint64)

    def _sample(self, idx: np.ndarray):
        c = self.config
        n = idx.shape[0]
        z = np.empty((n, c.num_dense))
        dense = np.empty((n, c.num_dense), np.float32)
        for j in range(c.num_dense):
            zj = _normal(c.seed, 10 + j, idx)
            missing = _uniform(c.seed, 200 + j, idx) < c.dense_missing
            count = np.floor(np.exp(np.minimum(self._mu[j] + self._s[j] * zj, 40.0))) - 1
            dense[:, j] = np.where(missing, 0.0, np.log1p(np.maximum(count, 0)))
            z[:, j] = np.where(missing, 0.0, zj)
        ids = np.empty((n, self.num_sparse), np.int64)
        for f, size in enumerate(c.table_sizes):
            u = _uniform(c.seed, 400 + f, idx)
            a = c.zipf_alpha[f]
            if abs(a - 1.0) < 1e-9:
                x = np.exp(u * math.log(size + 1.0))
            else:
                top = (size + 1.0) ** (1.0 - a) - 1.0
                x = (1.0 + u * top) ** (1.0 / (1.0 - a))
            rank = np.clip(np.floor(x).astype(np.int64) - 1, 0, size - 1)
            mul, add = self._perm[f]
            ids[:, f] = (rank * mul + add) % size
        return dense, z, ids

    def _logits(self, z: np.ndarray, ids: np.ndarray) -> np.ndarray:
        c = self.config
        logit = np.full(ids.shape[0], c.bias) + z @ self._v
        for f in range(self.num_sparse):
            logit += self._sigma_s * _normal(c.seed, 1000 + f, ids[:, f])
        return logit

    def probabilities(self, start: int, stop: int) -> np.ndarray:
        """The planted click probabilities of records ``[start, stop)`` (float64)."""
        idx = self._check(start, stop)
        _, z, ids = self._sample(idx)
        return 1.0 / (1.0 + np.exp(-self._logits(z, ids)))

    def read(self, start: int, stop: int) -> Batch:
        """Records ``[start, stop)``: one id per feature, labels sampled from the planted model."""
        idx = self._check(start, stop)
        dense, z, ids = self._sample(idx)
        p = 1.0 / (1.0 + np.exp(-self._logits(z, ids)))
        labels = (_uniform(self.config.seed, 3, idx) < p).astype(np.float32)
        return Batch.from_ids(dense, labels, ids, self.feature_names)

    def read_with_probabilities(self, start: int, stop: int) -> tuple[Batch, np.ndarray]:
        """:meth:`read` and :meth:`probabilities` of the same records, sampled once."""
        idx = self._check(start, stop)
        dense, z, ids = self._sample(idx)
        p = 1.0 / (1.0 + np.exp(-self._logits(z, ids)))
        labels = (_uniform(self.config.seed, 3, idx) < p).astype(np.float32)
        return Batch.from_ids(dense, labels, ids, self.feature_names), p


def planted_auc(config: SyntheticConfig | None = None, num_records: int = 1 << 20,
                chunk: int = 1 << 16) -> dict:
    """AUC and log-loss of the planted model on ``num_records`` records, and the positive rate."""
    from embedding.dense.metrics import auc, log_loss

    ds = SyntheticDataset(config, num_records)
    labels, probs = [], []
    for a in range(0, num_records, chunk):
        batch, p = ds.read_with_probabilities(a, min(a + chunk, num_records))
        labels.append(batch.labels)
        probs.append(p)
    y = np.concatenate(labels)
    p = np.concatenate(probs)
    return {"records": int(num_records), "auc": auc(y, p), "log_loss": log_loss(y, p),
            "positive_rate": float(y.mean())}

