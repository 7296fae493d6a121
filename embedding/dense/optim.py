"""Optimizers of the dense parameters, acting on the flat buffers in place.

Each optimizer updates the whole flat parameter buffer from the flat
gradient buffer with a handful of vectorised operations (NumPy or CuPy), and
keeps its state as flat buffers of the same layout, so the state of a
data-parallel model is identical on every rank after each step.
"""
from __future__ import annotations

import numpy as np

from embedding.dense._xp import array_module, to_numpy
from embedding.dense.types import DenseOptimizerConfig, DenseOptimizerKind

__all__ = ["DenseOptimizer", "SGD", "AdaGrad", "Adam", "make_optimizer"]


class DenseOptimizer:
    """Base: ``step(params, grads)`` updates ``params`` in place; state as flat buffers."""

    state_names: tuple[str, ...] = ()

    def __init__(self, config: DenseOptimizerConfig):
        self.config = config
        self.steps = 0
        self.state: dict[str, object] = {}

    def _init_state(self, params) -> None:
        xp = array_module(params)
        for name in self.state_names:
            if name not in self.state or self.state[name].shape != params.shape:
                self.state[name] = xp.full(params.shape, self._initial(name), params.dtype)

    def _initial(self, name: str) -> float:
        return 0.0

    def step(self, params, grads) -> None:
        """One update of ``params`` from ``grads`` (same shape, dtype and module)."""
        if params.shape != grads.shape or params.dtype != grads.dtype:
            raise ValueError(f"grads: expected {params.dtype} {params.shape} like params, got "
                             f"{grads.dtype} {grads.shape}")
        self._init_state(params)
        self.steps += 1
        self._update(array_module(params), params, grads)

    def _update(self, xp, params, grads) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of the state buffers and ``"steps"`` (a 0-d int64 array)."""
        out = {name: to_numpy(v).copy() for name, v in self.state.items()}
        out["steps"] = np.asarray(self.steps, np.int64)
        return out

    def load_state_dict(self, state: dict, xp=np) -> None:
        """Restore :meth:`state_dict` output onto array module ``xp``."""
        missing = [n for n in self.state_names if n not in state]
        if missing or "steps" not in state:
            raise ValueError(f"state: missing {missing + ([] if 'steps' in state else ['steps'])} "
                             f"for {type(self).__name__}")
        self.steps = int(np.asarray(state["steps"]))
        self.state = {n: xp.asarray(state[n]).copy() for n in self.state_names}


class SGD(DenseOptimizer):
    """``p -= lr (g + wd p)``, with heavy-ball momentum when ``momentum > 0``."""

    def __init__(self, config: DenseOptimizerConfig):
        super().__init__(config)
        self.state_names = ("momentum",) if config.momentum > 0 else ()

    def _update(self, xp, params, grads) -> None:
        c = self.config
        g = grads + c.weight_decay * params if c.weight_decay else grads
        if c.momentum > 0:
            buf = self.state["momentum"]
            buf *= c.momentum
            buf += g
            g = buf
        params -= params.dtype.type(c.lr) * g


class AdaGrad(DenseOptimizer):
    """``G += g^2; p -= lr g / (sqrt(G) + eps)`` (with L2 ``wd`` folded into ``g``)."""

    state_names = ("sum_sq",)

    def _initial(self, name: str) -> float:
        return self.config.initial_accumulator

    def _update(self, xp, params, grads) -> None:
        c = self.config
        g = grads + c.weight_decay * params if c.weight_decay else grads
        acc = self.state["sum_sq"]
        acc += g * g
        params -= params.dtype.type(c.lr) * g / (xp.sqrt(acc) + c.eps)


class Adam(DenseOptimizer):
    """Adam with bias correction; ``weight_decay`` is decoupled (AdamW)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def _update(self, xp, params, grads) -> None:
        c = self.config
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m *= c.beta1
        m += (1 - c.beta1) * grads
        v *= c.beta2
        v += (1 - c.beta2) * grads * grads
        if c.weight_decay:
            params *= params.dtype.type(1 - c.lr * c.weight_decay)
        bc1 = 1 - c.beta1 ** self.steps
        bc2 = 1 - c.beta2 ** self.steps
        step = c.lr / bc1
        params -= params.dtype.type(step) * m / (xp.sqrt(v / bc2) + c.eps)


def make_optimizer(config: DenseOptimizerConfig | None = None) -> DenseOptimizer:
    """The optimizer of ``config.kind``."""
    config = config or DenseOptimizerConfig()
    return {DenseOptimizerKind.SGD: SGD, DenseOptimizerKind.ADAGRAD: AdaGrad,
            DenseOptimizerKind.ADAM: Adam}[config.kind](config)
