"""Flat parameter and gradient buffers, cut into buckets for overlapped AllReduce.

Every dense parameter is a view into one flat parameter buffer and its
gradient a view into one flat gradient buffer of the same layout. The layout
follows the order in which the backward pass completes gradients, and the
buffers are cut into :class:`~embedding.dense.types.Bucket` ranges of about
``bucket_bytes`` each (a parameter is never split; one larger than a bucket
gets a bucket of its own). While the backward pass runs, a hook is called as
soon as a bucket's last gradient has been written, so a data-parallel trainer
can start that bucket's AllReduce while the backward pass goes on::

    def hook(bucket, grad):          # grad: the bucket's view of flat_grads
        handles.append(group.all_reduce_async(grad))
    model.backward(dlogits, hook=hook)
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from embedding.dense.types import Bucket

__all__ = ["FlatBuffers", "BucketHook", "plan_buckets"]

#: ``hook(bucket, grad_view)``, called once per bucket per backward pass.
BucketHook = Callable[[Bucket, object], None]


def plan_buckets(specs: list[tuple[str, int]], itemsize: int,
                 bucket_bytes: int) -> tuple[Bucket, ...]:
    """Cut parameters ``(name, numel)`` (in buffer order) into buckets of ~``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: expected > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    names: list[str] = []
    start = offset = 0
    for name, numel in specs:
        if names and (offset - start + numel) * itemsize > bucket_bytes:
            buckets.append(Bucket(len(buckets), start, offset - start, tuple(names)))
            names, start = [], offset
        names.append(name)
        offset += numel
    if names:
        buckets.append(Bucket(len(buckets), start, offset - start, tuple(names)))
    return tuple(buckets)


class FlatBuffers:
    """Parameters ``(name, shape)`` (in gradient-completion order) in flat buffers of ``xp``.

    ``grad_alloc(numel, dtype)``, when given, allocates the flat gradient
    buffer (zeroed), e.g. in symmetric memory for a faster AllReduce.
    """

    def __init__(self, specs: list[tuple[str, tuple[int, ...]]], dtype, xp=np,
                 bucket_bytes: int = 25 << 20, grad_alloc=None):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        sizes = [(name, int(np.prod(shape))) for name, shape in specs]
        self.numel = sum(n for _, n in sizes)
        self.params = xp.zeros(self.numel, self.dtype)
        self.grads = (xp.zeros(self.numel, self.dtype) if grad_alloc is None
                      else grad_alloc(self.numel, self.dtype))
        self.shapes = {name: tuple(shape) for name, shape in specs}
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, n in sizes:
            self.offsets[name] = offset
            offset += n
        self.buckets = plan_buckets(sizes, self.dtype.itemsize, bucket_bytes)
        self._bucket_of = {name: b.index for b in self.buckets for name in b.params}
        self._pending = [len(b.params) for b in self.buckets]
        self._hook: BucketHook | None = None

    def param(self, name: str):
        """The parameter ``name`` as a view of the flat parameter buffer."""
        return self._view(self.params, name)

    def grad(self, name: str):
        """The gradient of ``name`` as a view of the flat gradient buffer."""
        return self._view(self.grads, name)

    def _view(self, flat, name):
        off = self.offsets[name]
        shape = self.shapes[name]
        return flat[off:off + int(np.prod(shape))].reshape(shape)

    @property
    def bucket_params(self) -> list:
        """One view of the flat parameter buffer per bucket, bucket order."""
        return [self.params[b.offset:b.offset + b.numel] for b in self.buckets]

    @property
    def bucket_grads(self) -> list:
        """One view of the flat gradient buffer per bucket, bucket order."""
        return [self.grads[b.offset:b.offset + b.numel] for b in self.buckets]

    def begin_backward(self, hook: BucketHook | None) -> None:
        """Arm the readiness counters for one backward pass."""
        self._pending = [len(b.params) for b in self.buckets]
        self._hook = hook

    def mark_ready(self, *names: str) -> None:
        """The gradients of ``names`` are written; fire the hook of each bucket now complete."""
        for name in names:
            i = self._bucket_of[name]
            self._pending[i] -= 1
            if self._pending[i] == 0 and self._hook is not None:
                b = self.buckets[i]
                self._hook(b, self.grads[b.offset:b.offset + b.numel])

    def end_backward(self) -> None:
        """Check that every bucket completed (a wiring error otherwise)."""
        left = [b.index for b, n in zip(self.buckets, self._pending) if n]
        self._hook = None
        if left:
            raise RuntimeError(f"buckets {left} never completed in the backward pass")
