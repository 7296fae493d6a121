"""topology: the fabric a job runs on, and whether it is the fabric it should be.

The lowest layer of neocomm (it imports nothing from the others):

- a fabric model (:mod:`topology.types`): hosts, NUMA nodes, GPUs, NICs, links;
- probes of NVML, ``nvidia-smi``, sysfs and procfs, merged by :func:`discover_host`;
- :func:`discover_world`: every host probed once, gathered over MPI;
- fabric specs in TOML (:func:`load_spec`, presets ``zionex``, ``dgx-a100``,
  ``dgx-h100``, ``dgx1-v100``, ``cpu-host``) and :func:`validate`;
- :func:`link_model`: bandwidth and latency per link class for the cost models.
"""
from __future__ import annotations

from topology.host import assign_nics, discover_host
from topology.linkmodel import LinkParams, inter_node_kind, intra_node_kind, link_model
from topology.snapshot import fixture, fixture_names
from topology.spec import FabricSpec, SpecError, load_spec, preset_names
from topology.types import (ClusterTopology, Gpu, GpuNicPair, HostTopology, Link, LinkKind,
                            LinkLayer, Nic, NumaNode, PciPath, PortState, ProbeWarning,
                            RankPlacement, TopologyError, from_json, to_json)
from topology.validate import ValidationReport, validate
from topology.world import discover_world

__all__ = [
    "ClusterTopology", "HostTopology", "Gpu", "Nic", "NumaNode", "Link", "GpuNicPair",
    "RankPlacement", "LinkKind", "LinkLayer", "PciPath", "PortState", "ProbeWarning",
    "TopologyError", "to_json", "from_json",
    "discover_host", "discover_world", "assign_nics", "fixture", "fixture_names",
    "FabricSpec", "SpecError", "load_spec", "preset_names", "validate", "ValidationReport",
    "link_model", "LinkParams", "inter_node_kind", "intra_node_kind",
]
