"""Vocabulary of the dense (data-parallel) part of DLRM: architecture and optimizers."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from embedding.types import enum_arg

__all__ = ["DenseConfig", "DenseOptimizerKind", "DenseOptimizerConfig", "Bucket",
           "dense_flops_per_sample"]


@dataclass(frozen=True)
class DenseConfig:
    """DLRM's dense architecture: bottom MLP, "dot" interaction, top MLP.

    ``bottom_mlp`` lists the bottom layers' widths; its last width is the
    embedding dimension, since the bottom output takes part in the
    interaction with the ``num_sparse`` pooled embeddings. ``top_mlp`` lists
    the top layers' widths and ends in 1 (the logit). Defaults are MLPerf's
    DLRM on Criteo 1TB (13-512-256-128 and 1024-1024-512-256-1).
    """

    num_dense: int = 13
    num_sparse: int = 26
    bottom_mlp: tuple[int, ...] = (512, 256, 128)
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "bottom_mlp", tuple(int(w) for w in self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(int(w) for w in self.top_mlp))
        if self.num_dense <= 0:
            raise ValueError(f"num_dense: expected > 0, got {self.num_dense}")
        if self.num_sparse < 0:
            raise ValueError(f"num_sparse: expected >= 0, got {self.num_sparse}")
        if not self.bottom_mlp or min(self.bottom_mlp) <= 0:
            raise ValueError(f"bottom_mlp: expected positive widths, got {self.bottom_mlp}")
        if not self.top_mlp or min(self.top_mlp) <= 0 or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: expected positive widths ending in 1, got {self.top_mlp}")
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            dt = None
        if dt is None or dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"dtype: expected float32 or float64, got {self.dtype!r}")

    @property
    def embedding_dim(self) -> int:
        """Width of each pooled embedding (the bottom MLP's output width)."""
        return self.bottom_mlp[-1]

    @property
    def num_interactions(self) -> int:
        """Pairwise dot products: ``(F + 1) F / 2`` for F sparse features and the bottom output."""
        n = self.num_sparse + 1
        return n * (n - 1) // 2

    @property
    def top_input_dim(self) -> int:
        """Width of the top MLP's input: the bottom output and the interactions."""
        return self.embedding_dim + self.num_interactions

    def layer_shapes(self) -> list[tuple[str, int, int]]:
        """``(name, fan_in, fan_out)`` of every linear layer, in forward order."""
        out, width = [], self.num_dense
        for i, w in enumerate(self.bottom_mlp):
            out.append((f"bottom.{i}", width, w))
            width = w
        width = self.top_input_dim
        for i, w in enumerate(self.top_mlp):
            out.append((f"top.{i}", width, w))
            width = w
        return out

    @property
    def num_parameters(self) -> int:
        return sum(i * o + o for _, i, o in self.layer_shapes())


class DenseOptimizerKind(enum.Enum):
    """Optimizers of the dense parameters."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """Hyper-parameters of a dense optimizer (unitless; ``lr`` per step)."""

    kind: DenseOptimizerKind = DenseOptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0       # SGD only
    weight_decay: float = 0.0   # L2 for SGD/AdaGrad, decoupled (AdamW) for Adam
    eps: float = 1e-8           # AdaGrad and Adam
    beta1: float = 0.9          # Adam
    beta2: float = 0.999        # Adam
    initial_accumulator: float = 0.0  # AdaGrad

    def __post_init__(self):
        if not isinstance(self.kind, DenseOptimizerKind):
            object.__setattr__(self, "kind", enum_arg(DenseOptimizerKind, self.kind, "kind"))
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum: expected in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay}")
        if not self.eps > 0:
            raise ValueError(f"eps: expected > 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: expected in [0, 1), got {getattr(self, name)}")
        if self.initial_accumulator < 0:
            raise ValueError(f"initial_accumulator: expected >= 0, got {self.initial_accumulator}")


@dataclass(frozen=True)
class Bucket:
    """Elements ``[offset, offset + numel)`` of the flat parameter/gradient buffers.

    ``params`` names the parameters it holds, whole, in buffer order;
    ``index`` 0 is the bucket whose gradients are complete first in the
    backward pass.
    """

    index: int
    offset: int
    numel: int
    params: tuple[str, ...]


def dense_flops_per_sample(dense: DenseConfig) -> float:
    """Floating-point operations of one sample's dense forward (2 per multiply-add)."""
    macs = sum(i * o for _, i, o in dense.layer_shapes())
    macs += dense.num_interactions * dense.embedding_dim
    return 2.0 * macs
