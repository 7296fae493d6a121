"""The trainer's data sources, one module each, found by ``data.source`` in :data:`SOURCES`.

A source (:class:`~embedding.train.sources.base.Source`) checks the ``[data]``
table of a config when it is loaded and opens its data when training starts.
Adding a source is adding a module with its ``SOURCE``, its name in
:class:`~embedding.train.types.DataSource` and one entry here.
"""
from __future__ import annotations

from embedding.train.sources import binary, criteo, parquet, synthetic
from embedding.train.sources.base import Source
from embedding.train.types import DataSource

__all__ = ["SOURCES", "Source", "source_of"]

#: the source of each ``data.source`` name
SOURCES: dict[DataSource, Source] = {
    DataSource.SYNTHETIC: synthetic.SOURCE,
    DataSource.CRITEO: criteo.SOURCE,
    DataSource.BINARY: binary.SOURCE,
    DataSource.PARQUET: parquet.SOURCE,
}


def source_of(kind: DataSource) -> Source:
    """The registered source of ``kind`` (ValueError naming the registered ones otherwise)."""
    try:
        return SOURCES[kind]
    except KeyError:
        raise ValueError(f"data.source: expected one of {[k.value for k in SOURCES]}, "
                         f"got {getattr(kind, 'value', kind)!r}") from None
