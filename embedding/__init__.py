"""Sharded embeddings, their kernels and planner, and the DLRM trainer built on them."""
from embedding import settings as _settings  # noqa: F401  (declares NEOCOMM_* settings)
