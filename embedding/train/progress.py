"""A plain-text progress bar for rank 0.

On a terminal it redraws one line in place (at most ``max_hz`` times a
second); otherwise (a log file, CI) it prints one line every ``every``
steps and on the last step, so logs stay readable::

    step   120/500 [#####...............]  24%  loss 0.4512  auc 0.7431  41.2k samples/s  eta 0:32

Under an MPI launcher a rank cannot tell whether the launcher's output is
a terminal (Open MPI gives every rank a pseudo-terminal either way), so
there the default is one line every ``every`` steps, unless ``neocomm run``
said its own output is a terminal (``NEOCOMM_STDOUT_TTY``);
``NEOCOMM_PROGRESS=bar`` asks for the in-place bar, ``lines`` for lines,
``off`` for silence.
"""
from __future__ import annotations

import os
import sys
import time

from neocomm import config

__all__ = ["ProgressBar", "format_rate", "format_eta", "progress_mode"]


_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def progress_mode(stream, environ=None) -> str:
    """``bar``, ``lines`` or ``off`` for ``stream`` under ``NEOCOMM_PROGRESS`` (see module doc)."""
    env = os.environ if environ is None else environ
    mode = config.get("PROGRESS", env)
    if mode != "auto":
        return mode
    if any(k in env for k in _LAUNCHER_VARS):
        return "bar" if config.get("STDOUT_TTY", env) else "lines"
    return "bar" if bool(getattr(stream, "isatty", lambda: False)()) else "lines"


def format_rate(x: float) -> str:
    """``41.2k``, ``1.31M`` or ``950``."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def format_eta(seconds: float) -> str:
    """``h:mm:ss`` or ``m:ss``."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Progress of ``total`` steps on ``stream`` (``enabled=False``: silent; other ranks).

    ``tty`` forces the in-place bar (True) or lines (False); None follows
    :func:`progress_mode`.
    """

    def __init__(self, total: int, *, stream=None, every: int = 25, enabled: bool = True,
                 width: int = 20, tty: bool | None = None, max_hz: float = 10.0):
        self.total = int(total)
        self.stream = stream if stream is not None else sys.stdout
        self.every = max(1, int(every))
        mode = progress_mode(self.stream) if tty is None else ("bar" if tty else "lines")
        self.enabled = bool(enabled) and mode != "off"
        self.width = int(width)
        self.tty = mode == "bar"
        self.min_interval = 1.0 / max_hz if max_hz > 0 else 0.0
        self._last_draw = 0.0
        self._open_line = False
        self.auc: float | None = None

    def line(self, step: int, loss: float | None, rate: float | None,
             eta: float | None) -> str:
        frac = min(1.0, step / self.total) if self.total else 1.0
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        w = len(str(self.total))
        parts = [f"step {step:>{w}}/{self.total} [{bar}] {100 * frac:3.0f}%"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if self.auc is not None:
            parts.append(f"auc {self.auc:.4f}")
        if rate:
            parts.append(f"{format_rate(rate)} samples/s")
        if eta is not None:
            parts.append(f"eta {format_eta(eta)}")
        return "  ".join(parts)

    def update(self, step: int, loss: float | None = None, rate: float | None = None,
               eta: float | None = None) -> None:
        """Show step ``step`` (1-based count of steps done)."""
        if not self.enabled:
            return
        last = step >= self.total
        if self.tty:
            now = time.monotonic()
            if not last and now - self._last_draw < self.min_interval:
                return
            self._last_draw = now
            self.stream.write("\r\x1b[2K" + self.line(step, loss, rate, eta))
            self._open_line = True
        elif last or step % self.every == 0:
            self.stream.write(self.line(step, loss, rate, eta) + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (an evaluation, a checkpoint) without breaking the bar."""
        if not self.enabled:
            return
        if self.tty and self._open_line:
            self.stream.write("\r\x1b[2K")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
