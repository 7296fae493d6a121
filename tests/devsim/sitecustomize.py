"""Processes that tests start with the stand-in on their path (``DEVSIM=1``, set by
``activate.use_standin``) import it at start-up, as a program on a GPU host would find a
real CuPy with a device: neocomm binds a device only where CuPy is imported or the CUDA
driver reports one, and a host without a GPU has no driver to ask."""
import os

if os.environ.get("DEVSIM") == "1":
    import cupy  # noqa: F401  (the stand-in: tests/devsim comes first on the path)
