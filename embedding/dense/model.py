"""The dense part of DLRM with an explicit forward and backward pass (no autograd).

``forward(dense, pooled)`` computes, for a local batch of ``B`` records with
``F`` pooled embeddings of width ``D``:

1. bottom MLP (ReLU after every layer): ``x = MLP_bot(dense)``, ``[B, D]``;
2. "dot" interaction: ``T = [x, e_1 .. e_F]`` ``[B, F + 1, D]``,
   ``Z = T T^T``; the strictly lower triangle of ``Z`` (row-major, ``i > j``)
   concatenated after ``x`` gives ``[B, D + (F + 1) F / 2]``;
3. top MLP (ReLU after every layer but the last): the logit ``[B]``.

``backward(dlogits)`` writes every parameter's gradient into the flat
gradient buffer (overwriting it), fires the bucket hook as buckets complete
and returns the gradient with respect to the pooled embeddings ``[B, F, D]``,
the input of the embedding backward. The code is array-module generic: the
model lives on NumPy or CuPy (``xp``), and its inputs must live there too.
"""
from __future__ import annotations

import numpy as np

from embedding.dense._xp import to_numpy
from embedding.dense.buckets import BucketHook, FlatBuffers
from embedding.dense.metrics import bce_with_logits
from embedding.dense.types import DenseConfig

__all__ = ["DenseModel"]


class DenseModel:
    """Bottom MLP, dot interaction and top MLP of DLRM, data-parallel.

    Parameters are initialised from ``seed`` as in the DLRM reference
    (weights ``N(0, 2 / (fan_in + fan_out))``, biases ``N(0, 1 / fan_out)``),
    drawn with NumPy in forward order, so every rank and both array modules
    start from the same values. ``bucket_bytes`` sizes the gradient buckets;
    ``grad_alloc(numel, dtype)`` allocates the flat gradient buffer (see FlatBuffers).

    The loss of :meth:`forward_backward` is the mean over the local batch;
    with equal local batches, the global-batch gradient is the mean of the
    ranks' gradients (AllReduce SUM, then divide by the world size).
    """

    def __init__(self, config: DenseConfig | None = None, *, seed: int = 0, xp=np,
                 bucket_bytes: int = 25 << 20, grad_alloc=None):
        self.config = config or DenseConfig()
        self.xp = xp
        self.dtype = np.dtype(self.config.dtype)
        self.layers = self.config.layer_shapes()
        self._relu = {name: not (name == f"top.{len(self.config.top_mlp) - 1}")
                      for name, _, _ in self.layers}
        specs = []
        for name, fan_in, fan_out in reversed(self.layers):
            specs += [(f"{name}.weight", (fan_in, fan_out)), (f"{name}.bias", (fan_out,))]
        self.buffers = FlatBuffers(specs, self.dtype, xp, bucket_bytes, grad_alloc)
        rng = np.random.default_rng(seed)
        for name, fan_in, fan_out in self.layers:
            w = rng.normal(0.0, np.sqrt(2.0 / (fan_in + fan_out)), (fan_in, fan_out))
            b = rng.normal(0.0, np.sqrt(1.0 / fan_out), fan_out)
            self.buffers.param(f"{name}.weight")[...] = xp.asarray(w, self.dtype)
            self.buffers.param(f"{name}.bias")[...] = xp.asarray(b, self.dtype)
        d = self.config.num_sparse + 1
        self._tril = tuple(xp.asarray(i) for i in np.tril_indices(d, -1))
        self._cache: dict | None = None

    # ------------------------------------------------------------ buffers
    @property
    def flat_params(self):
        """Every parameter, one flat buffer (layout: :attr:`buckets`)."""
        return self.buffers.params

    @property
    def flat_grads(self):
        """Every gradient, one flat buffer with the layout of :attr:`flat_params`."""
        return self.buffers.grads

    @property
    def buckets(self):
        return self.buffers.buckets

    def parameter(self, name: str):
        return self.buffers.param(name)

    def parameter_names(self) -> list[str]:
        """Parameter names in flat-buffer order (gradient-completion order)."""
        return list(self.buffers.offsets)

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{"params": flat parameters}`` as a NumPy copy."""
        return {"params": to_numpy(self.flat_params).copy()}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output; ValueError on a size or dtype mismatch."""
        flat = np.asarray(state["params"])
        if flat.shape != (self.buffers.numel,) or flat.dtype != self.dtype:
            raise ValueError(f"state['params']: expected {self.dtype} of shape "
                             f"({self.buffers.numel},), got {flat.dtype} {flat.shape}")
        self.flat_params[...] = self.xp.asarray(flat)

    # ------------------------------------------------------------ forward
    def _stack_pooled(self, pooled, batch: int):
        xp = self.xp
        f, d = self.config.num_sparse, self.config.embedding_dim
        if isinstance(pooled, (list, tuple)):
            if len(pooled) != f:
                raise ValueError(f"pooled: expected {f} pooled embeddings, got {len(pooled)}")
            pooled = xp.stack([xp.asarray(p, self.dtype) for p in pooled], axis=1) if f else \
                xp.zeros((batch, 0, d), self.dtype)
        pooled = xp.asarray(pooled, self.dtype)
        if pooled.shape != (batch, f, d):
            raise ValueError(f"pooled: expected shape ({batch}, {f}, {d}), got {pooled.shape}")
        return pooled

    def forward(self, dense, pooled):
        """Logits ``[B]`` for dense features ``[B, num_dense]`` and pooled embeddings.

        ``pooled`` is ``[B, F, D]`` or a sequence of ``F`` arrays ``[B, D]``.
        Activations are kept for :meth:`backward`.
        """
        xp = self.xp
        x = xp.asarray(dense, self.dtype)
        if x.ndim != 2 or x.shape[1] != self.config.num_dense:
            raise ValueError(f"dense: expected shape (B, {self.config.num_dense}), got {x.shape}")
        b = x.shape[0]
        emb = self._stack_pooled(pooled, b)
        acts, outs = {}, {}
        h = x
        for name, _, _ in self.layers[:len(self.config.bottom_mlp)]:
            acts[name] = h
            h = outs[name] = self._linear(name, h)
        bottom = h
        t = xp.concatenate([bottom[:, None, :], emb], axis=1)
        z = xp.matmul(t, t.transpose(0, 2, 1))
        li, lj = self._tril
        h = xp.concatenate([bottom, z[:, li, lj]], axis=1)
        for name, _, _ in self.layers[len(self.config.bottom_mlp):]:
            acts[name] = h
            h = outs[name] = self._linear(name, h)
        self._cache = {"acts": acts, "outs": outs, "t": t, "batch": b}
        return h[:, 0]

    def _linear(self, name, h):
        w = self.buffers.param(f"{name}.weight")
        y = h @ w + self.buffers.param(f"{name}.bias")
        if self._relu[name]:
            self.xp.maximum(y, 0, out=y)
        return y

    # ----------------------------------------------------------- backward
    def backward(self, dlogits, hook: BucketHook | None = None):
        """Gradients of every parameter (into :attr:`flat_grads`) and of the pooled embeddings.

        ``dlogits`` ``[B]`` is the loss gradient with respect to the logits of
        the last :meth:`forward`. ``hook(bucket, grad_view)`` is called when
        a bucket's gradients are complete. Returns ``d pooled`` ``[B, F, D]``.
        """
        xp = self.xp
        if self._cache is None:
            raise RuntimeError("backward: call forward first (once per backward)")
        cache = self._cache
        self._cache = None
        b = cache["batch"]
        g = xp.asarray(dlogits, self.dtype)
        if g.shape != (b,):
            raise ValueError(f"dlogits: expected shape ({b},), got {g.shape}")
        outs = cache["outs"]
        acts = cache["acts"]
        bufs = self.buffers
        bufs.begin_backward(hook)
        g = g[:, None]
        nb = len(self.config.bottom_mlp)
        for name, _, _ in reversed(self.layers[nb:]):
            g = self._linear_backward(name, acts[name], outs[name], g, need_input_grad=True)
        d = self.config.embedding_dim
        g_bottom = g[:, :d]
        gz = xp.zeros((b, self.config.num_sparse + 1, self.config.num_sparse + 1), self.dtype)
        li, lj = self._tril
        gz[:, li, lj] = g[:, d:]
        t = cache["t"]
        gt = xp.matmul(gz + gz.transpose(0, 2, 1), t)
        g = g_bottom + gt[:, 0, :]
        d_pooled = xp.ascontiguousarray(gt[:, 1:, :])
        for i, (name, _, _) in enumerate(reversed(self.layers[:nb])):
            g = self._linear_backward(name, acts[name], outs[name], g,
                                      need_input_grad=i < nb - 1)
        bufs.end_backward()
        return d_pooled

    def _linear_backward(self, name, h_in, y, g, need_input_grad: bool):
        xp = self.xp
        if self._relu[name]:
            g = g * (y > 0)
        gw = self.buffers.grad(f"{name}.weight")
        gb = self.buffers.grad(f"{name}.bias")
        xp.matmul(h_in.T, g, out=gw)
        xp.sum(g, axis=0, out=gb)
        out = g @ self.buffers.param(f"{name}.weight").T if need_input_grad else None
        self.buffers.mark_ready(f"{name}.weight", f"{name}.bias")
        return out

    def forward_backward(self, dense, pooled, labels, hook: BucketHook | None = None):
        """One step's ``(loss, logits, d_pooled)``: forward, mean BCE with logits, backward."""
        logits = self.forward(dense, pooled)
        loss, dlogits = bce_with_logits(logits, self.xp.asarray(labels, self.dtype))
        d_pooled = self.backward(dlogits, hook=hook)
        return loss, logits, d_pooled
