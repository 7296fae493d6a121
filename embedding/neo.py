"""The DLRM workloads of Meta's Neo paper as planner inputs, and their step on a fabric.

Neo (Mudigere et al., "Software-Hardware Co-design for Fast and Scalable
Training of Deep Learning Recommendation Models", ISCA 2022, arXiv
2104.05158) evaluates three production models on 16 ZionEX nodes (128 A100
GPUs). The paper gives each model's size and shape in aggregate only: total
parameters, dense MFLOPS per sample, the order of magnitude of its table count,
the range and mean of its embedding dims, the mean pooling factor, the number
and mean width of its MLP layers and the local batch size. :data:`MODELS`
holds those figures; what the paper does not give is assumed here and every
assumption is named in :attr:`NeoModel.assumed`:

- the table count: the lower end of the published order of magnitude
  ("1000s" -> 1000);
- the rows of each table: spread log-uniformly over :data:`ROW_SPREAD`
  (two decades), shuffled against the dims, and scaled so that tables plus
  dense layers hold the published parameter count;
- the dims of a model with a dim range: a power-law quantile spread from the
  published minimum to the published maximum, rounded to multiples of 4, whose
  exponent is chosen to give the published mean;
- every table's pooling factor: the published mean;
- the dense layers: ``mlp_layers`` layers whose widths average the published
  mean width (the last one is the logit, 1 wide), half bottom and half top,
  with ``num_dense`` = the mean width; the number of vectors in the dot
  interaction is the one whose FLOPs bring the dense forward to the published
  MFLOPS per sample;
- the optimizers: row-wise AdaGrad for the tables, SGD for the dense layers.

:func:`table_fields` gives the tables as the fields of a
:class:`~embedding.presets.TableSet` (registered in :mod:`embedding.presets` as
``neo-model-a``, ``neo-model-f``, ``neo-model-i``: ``neocomm plan --tables
neo-model-a`` plans one); :func:`dense_config` the dense model;
:func:`embedding.simulate.predict_workload` plans a model for a number of ranks on a
fabric and prices its step with :func:`embedding.simulate.estimate_step`, the cost
model of ``neocomm simulate step``. This module imports nothing of the planner.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["NeoModel", "MODELS", "ROW_SPREAD", "PAPER", "model", "table_fields", "dims_of",
           "dense_config", "num_parameters"]

#: Where the paper's figures come from (arXiv 2104.05158, the ISCA 2022 version).
PAPER = "https://arxiv.org/abs/2104.05158"

#: Ratio of the largest to the smallest table's rows of a model (assumed: not published).
ROW_SPREAD = 100.0


@dataclass(frozen=True)
class NeoModel:
    """One of the paper's models: the published aggregate figures and what is assumed.

    ``parameters`` in all (tables and dense layers); ``mflops_per_sample`` the
    dense forward's millions of floating-point operations per sample;
    ``num_tables`` embedding tables of ``dim_min``..``dim_max`` elements wide,
    ``dim_avg`` on average, each read ``pooling`` ids per sample;
    ``mlp_layers`` dense layers ``mlp_width`` wide on average; ``local_batch``
    samples per GPU per step; ``dtype`` of the table rows; ``reported_qps``
    the training throughput the paper reports on 128 GPUs (samples/s).
    ``verified`` says whether these figures were read from a stored copy of the
    paper, ``assumed`` what the paper does not give.
    """

    name: str
    parameters: float
    mflops_per_sample: float
    num_tables: int
    dim_min: int
    dim_max: int
    dim_avg: float
    pooling: float
    mlp_layers: int
    mlp_width: int
    local_batch: int
    reported_qps: float
    dtype: str = "float32"
    verified: bool = False
    assumed: tuple[str, ...] = ()

    @property
    def preset(self) -> str:
        """The name of its table set (:mod:`embedding.presets`)."""
        return f"neo-{self.name}"


_COMMON = ("table rows spread log-uniformly over two decades, scaled to the parameter count",
           "every table reads the mean pooling factor",
           "dense layers of equal width, num_dense = the mean width, interaction width "
           "solved for the published MFLOPS per sample",
           "row-wise AdaGrad for the tables, SGD for the dense layers")

#: The paper's three models (its Table 3), by name. The figures were taken from the
#: paper's model table as published; the stored copies reachable while this module was
#: written (the abstract at ar5iv and research.facebook.com) did not include the table,
#: so ``verified`` is False: check them against the paper before quoting.
MODELS: dict[str, NeoModel] = {m.name: m for m in (
    NeoModel("model-a", 793e9, 638.0, 1000, 4, 384, 93.0, 15.0, 20, 3375, 512, 1.2e6,
             assumed=("1000 tables (published: 'thousands')",
                      "dims spread by a power law over [4, 384] to the mean 93") + _COMMON),
    NeoModel("model-f", 12e12, 5.0, 10, 256, 256, 256.0, 20.0, 7, 490, 512, 1.7e6,
             dtype="float16",
             assumed=("10 tables (published: 'tens')",
                      "float16 rows: 12T float32 parameters (48 TB) exceed the HBM and the "
                      "assumed host memory of 16 nodes") + _COMMON),
    NeoModel("model-i", 332e9, 60.0, 100, 92, 92, 92.0, 70.0, 43, 682, 2048, 3.4e6,
             assumed=("100 tables (published: 'hundreds')",) + _COMMON),
)}


def model(name: str) -> NeoModel:
    """The model called ``name`` (``model-a``, ``model-f``, ``model-i``; ``neo-`` prefix
    allowed); ValueError naming the known ones otherwise."""
    key = name[len("neo-"):] if isinstance(name, str) and name.startswith("neo-") else name
    if key not in MODELS:
        raise ValueError(f"workload: expected one of {sorted(MODELS)}, got {name!r}")
    return MODELS[key]


def _quantile_dims(m: NeoModel, p: float) -> list[int]:
    n, lo, hi = m.num_tables, m.dim_min, m.dim_max
    out = []
    for i in range(n):
        u = i / (n - 1) if n > 1 else 0.0
        d = lo * (hi / lo) ** (u ** p)
        out.append(max(lo, min(hi, 4 * round(d / 4))))
    return out


def dims_of(m: NeoModel) -> list[int]:
    """Each table's dim: all ``dim_avg`` when the range is one value, else a power-law
    spread from ``dim_min`` to ``dim_max`` whose exponent gives the mean ``dim_avg``."""
    if m.dim_min == m.dim_max:
        return [m.dim_min] * m.num_tables
    lo, hi = 0.05, 20.0  # the mean falls as the exponent grows
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if sum(_quantile_dims(m, mid)) / m.num_tables > m.dim_avg:
            lo = mid
        else:
            hi = mid
    return _quantile_dims(m, math.sqrt(lo * hi))


def dense_config(m: NeoModel):
    """The dense model (:class:`~embedding.dense.types.DenseConfig`): ``mlp_layers``
    layers averaging ``mlp_width`` (the last is the logit), half bottom and half top,
    and as many vectors in the dot interaction as bring the forward's FLOPs closest to
    ``mflops_per_sample``."""
    from embedding.dense.types import DenseConfig, dense_flops_per_sample

    width = round((m.mlp_layers * m.mlp_width - 1) / (m.mlp_layers - 1))
    bottom = m.mlp_layers // 2
    shape = dict(num_dense=m.mlp_width, bottom_mlp=(width,) * bottom,
                 top_mlp=(width,) * (m.mlp_layers - bottom - 1) + (1,))
    target = m.mflops_per_sample * 1e6

    def error(f: int) -> float:
        return abs(dense_flops_per_sample(DenseConfig(num_sparse=f, **shape)) - target)

    lo, hi = 0, 1
    while dense_flops_per_sample(DenseConfig(num_sparse=hi, **shape)) < target:
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            raise ValueError(f"{m.name}: no interaction width reaches "
                             f"{m.mflops_per_sample} MFLOPS per sample")
    while hi - lo > 1:  # the FLOPs grow with the interaction's width
        mid = (lo + hi) // 2
        if dense_flops_per_sample(DenseConfig(num_sparse=mid, **shape)) < target:
            lo = mid
        else:
            hi = mid
    return DenseConfig(num_sparse=min((lo, hi), key=error), **shape)


def _rows(m: NeoModel, dims: list[int]) -> list[int]:
    n = m.num_tables
    weights = [ROW_SPREAD ** ((i + 0.5) / n) for i in range(n)]
    random.Random(f"neo-{m.name}").shuffle(weights)  # rows independent of the dims
    embedding = m.parameters - dense_config(m).num_parameters
    scale = embedding / sum(w * d for w, d in zip(weights, dims))
    return [max(1, round(w * scale)) for w in weights]


def table_fields(m: NeoModel) -> dict:
    """The model's tables as the fields of a :class:`~embedding.presets.TableSet` (module
    doc): ``name``, ``rows``, ``names``, ``dims``, ``ids_per_sample``, ``dtype``,
    ``optimizer`` and ``summary``."""
    dims = dims_of(m)
    return dict(name=m.preset, rows=tuple(_rows(m, dims)),
                names=tuple(f"{m.name[-1]}{i:04d}" for i in range(m.num_tables)),
                dims=tuple(dims), ids_per_sample=(m.pooling,) * m.num_tables, dtype=m.dtype,
                optimizer="rowwise_adagrad",
                summary=f"Neo's {m.name}: {m.num_tables} tables, {m.parameters:.3g} "
                        f"parameters with the dense layers")


def num_parameters(m: NeoModel) -> int:
    """Parameters of the workload as built: its tables' rows x dims plus its dense layers."""
    dims = dims_of(m)
    return sum(r * d for r, d in zip(_rows(m, dims), dims)) + dense_config(m).num_parameters
