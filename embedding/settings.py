"""The embedding layer's ``NEOCOMM_*`` settings, declared into the core's table when the
``embedding`` package is imported (so a program that imports any part of it before
``neocomm.init()`` has them known when the core checks the environment)."""
from __future__ import annotations

from neocomm import config

__all__ = ["KERNEL_MODES"]

#: ``NEOCOMM_EMBEDDING_KERNELS``: the CPU embedding kernels (embedding.kernels.compiled)
KERNEL_MODES = ("auto", "compiled", "numpy")

config.declare("PROGRESS", str, "auto", "Progress display of `neocomm train` on rank 0: auto "
               "(a bar on a terminal, lines otherwise and under an MPI launcher), bar, lines "
               "or off", choices=("auto", "bar", "lines", "off"))
config.declare("EMBEDDING_KERNELS", str, "auto",
               "CPU embedding kernels: auto (compiled when numba loads, after a process's first "
               "second of embedding work, else NumPy), compiled "
               "(fail when numba does not load) or numpy", choices=KERNEL_MODES)
