"""The dense, data-parallel part of DLRM: MLPs, dot interaction, loss, optimizers, metrics.

Array-module generic (NumPy, or CuPy when the inputs are CuPy arrays).
Gradients live in one flat buffer cut into buckets whose completion fires a
hook, so a trainer can overlap its AllReduce with the backward pass.
"""
from __future__ import annotations

from embedding.dense.buckets import FlatBuffers, plan_buckets
from embedding.dense.checks import NonFiniteError, check_finite, check_labels, check_loss
from embedding.dense.metrics import auc, bce_with_logits, log_loss, sigmoid
from embedding.dense.model import DenseModel
from embedding.dense.optim import SGD, AdaGrad, Adam, DenseOptimizer, make_optimizer
from embedding.dense.types import Bucket, DenseConfig, DenseOptimizerConfig, DenseOptimizerKind

__all__ = ["DenseModel", "DenseConfig", "Bucket", "FlatBuffers", "plan_buckets",
           "DenseOptimizerConfig", "DenseOptimizerKind", "DenseOptimizer", "SGD", "AdaGrad",
           "Adam", "make_optimizer", "auc", "log_loss", "sigmoid", "bce_with_logits",
           "NonFiniteError", "check_finite", "check_loss", "check_labels"]
