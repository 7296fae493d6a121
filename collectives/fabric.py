"""The fabric model of a process group: its shape, its links, its calibration.

:func:`fabric_for` builds the :class:`~collectives.types.FabricModel` the
selector prices algorithms with: the group's node layout, link parameters
from the discovered topology when there is one (else the shared-memory
defaults of :mod:`collectives.types`), then a calibration file
(``NEOCOMM_CALIBRATION``, written by ``neocomm bench --calibrate``) on top.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace

from collectives import settings
from collectives.types import FabricModel

__all__ = ["fabric_for", "load_calibration", "save_calibration",
           "apply_calibration", "read_json"]

_log = logging.getLogger(__name__)


def fabric_for(group, device: bool = False, first: str = "") -> FabricModel:
    """The (cached) fabric model of ``group`` for host (or ``device``) buffers:
    shape, links from the topology, calibration. The first call on a group is
    collective over it (the topology of its hosts is gathered), after an agreement
    that every member is making the same call (``first``, the collective's name)."""
    from collectives.state import state_of

    state = state_of(group)
    path = settings.calibration_path()
    key = (path, bool(device))
    found = state.fabrics.get(key)
    if found is not None:
        return found
    layout = state.layout
    fabric = _links_from_topology(state, device, first) or FabricModel()
    fabric = fabric.with_shape(layout.ranks_per_node, layout.num_nodes)
    if path:
        fabric = apply_calibration(fabric, load_calibration(path),
                                   f"NEOCOMM_CALIBRATION={path}")
    state.fabrics[key] = fabric
    return fabric


def _links_from_topology(state, device: bool, first: str = "") -> FabricModel | None:
    """Links of the group's discovered topology (None when discovery failed)."""
    from collectives.topofabric import discover_group_topology, fabric_from_topology

    group = state.group
    if state.topology is state.UNKNOWN:
        from neocomm import watchdog
        from neocomm.agree import agree

        # A member making a call that is not a collective (freeing the group, splitting
        # it) fails here with every member, rather than leaving the others in discovery;
        # collectives that differ are told apart by their own agreement, which follows.
        name = getattr(group, "name", "?")
        agree(group.comm, "collective", None, [],
              call=f"{first or 'a collective'}(...) (the first collective of group {name!r})",
              where=f" on group {name!r} (its first collective)")

        # collective over the group: the first call on it waits here for every member
        with watchdog.guard(f"topology discovery of group {getattr(group, 'name', '?')!r} "
                            f"(its first collective)"):
            state.topology = discover_group_topology(group)
    cluster = state.topology
    if cluster is None:
        return None
    return fabric_from_topology(cluster, device=device)


def read_json(path: str, where: str = ""):
    """The JSON in ``path``; ValueError (prefixed ``where``) naming the file when it cannot
    be read or is not JSON."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ValueError(f"{where}cannot read {path!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}{path!r} is not JSON: {exc}") from None


def load_calibration(path: str) -> dict:
    """Read a calibration JSON; ValueError naming the file when it is not one."""
    data = read_json(path, "NEOCOMM_CALIBRATION: ")
    if not isinstance(data, dict) or data.get("kind") != "neocomm-calibration":
        raise ValueError(f"NEOCOMM_CALIBRATION: {path!r} is not a neocomm calibration file "
                         "(write one with `neocomm bench --calibrate FILE`)")
    return data


def apply_calibration(fabric: FabricModel, data: dict, where: str = "calibration") -> FabricModel:
    """``fabric`` with the link parameters and algorithm factors of ``data``. ValueError
    naming both when ``data`` was measured on links of another class than ``fabric``'s
    (a calibration from another fabric)."""
    changes: dict = {}
    for name in ("intra", "inter"):
        if not isinstance(data.get(name), dict):
            continue
        link, kind = getattr(fabric, name), data[name].get("kind", "")
        if kind and link.kind and kind != link.kind and (name == "intra" or fabric.nodes > 1):
            raise ValueError(
                f"{where}: measured with {kind} {'within' if name == 'intra' else 'between'} "
                f"nodes ({data.get('source', 'unknown source')}), but this fabric has "
                f"{link.kind} ({fabric.source}); calibrate on this fabric")
        fields = {k: data[name][k] for k in ("latency", "bandwidth", "chunk_bytes")
                  if k in data[name]}
        changes[name] = replace(link, **fields)
    for name in ("copy_bandwidth", "reduce_bandwidth", "step_overhead"):
        if name in data:
            changes[name] = float(data[name])
    factors = dict(fabric.algorithm_factors)
    factors.update({str(k): float(v) for k, v in data.get("algorithm_factors", {}).items()})
    changes["algorithm_factors"] = tuple(sorted(factors.items()))
    changes["source"] = f"{fabric.source}; calibrated by {data.get('source', 'a file')}"
    return replace(fabric, **changes)


def save_calibration(path: str, fabric: FabricModel, factors: dict[str, float],
                     source: str) -> None:
    """Write a calibration file with ``fabric``'s links and the measured ``factors``."""
    data = {"kind": "neocomm-calibration", "version": 1, "source": source,
            "intra": asdict(fabric.intra), "inter": asdict(fabric.inter),
            "copy_bandwidth": fabric.copy_bandwidth,
            "reduce_bandwidth": fabric.reduce_bandwidth,
            "step_overhead": fabric.step_overhead,
            "algorithm_factors": dict(sorted(factors.items()))}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)

