"""Hardware numbers for the planner from the topology layer's models.

A *target* is what a plan is for: its links (priced by
:mod:`topology.linkmodel`), devices per host and device memory. It comes from

- a captured host shipped with :mod:`topology` (``dgx-a100``, ``dgx1-v100``,
  ``cpu-host``), discovered from its snapshot: links between ranks of a node
  are NVLink, else PCIe, else shared memory; between nodes InfiniBand, else
  RoCE, else TCP, one flow per active NIC of that kind; the GPUs give the
  ranks per node and the device memory;
- a fabric spec (:mod:`topology.spec`: ``zionex``, ``dgx-h100`` … or a
  ``.toml`` file): NVLink lanes times the link model's per-lane rate of the
  GPU model, NIC count and rate, GPUs per node, minimum GPU memory;
- a topology JSON file (``neocomm topo --json``): its first host, as above.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

from collectives.types import FabricModel
from embedding.planner.types import Hardware

__all__ = ["Target", "load_target", "target_names", "target_of_host", "target_of_spec",
           "load_host", "hardware_for", "host_copy_rate", "PCIE_EFFICIENCY"]


@dataclass(frozen=True)
class Target:
    """The machines a plan is for, before the plan's shape is known.

    ``fabric`` holds the links (its shape is set by :class:`Hardware`);
    ``devices_per_host`` the GPUs of one host (CPUs without GPUs);
    ``device_memory`` bytes per device (None: unknown); ``memory_bandwidth``
    the device memory throughput in bytes/s, ``flop_rate`` a device's peak FP32
    operations per second (0.0: unknown, e.g. hosts without GPUs).
    ``host_bandwidth`` is the host-to-device copy throughput of one device,
    bytes/s each way (:func:`host_copy_rate`; 0.0: the fabric's copy
    throughput).
    """

    name: str
    fabric: FabricModel
    devices_per_host: int
    device_memory: int | None = None
    memory_bandwidth: float = 0.0
    flop_rate: float = 0.0
    host_bandwidth: float = 0.0


#: Share of a PCIe x16 link's line rate (one direction) that pinned host-device copies
#: reach: TLP headers and flow control leave about 80 % (a Gen4 x16 link, 31.5 GB/s line
#: rate, copies at about 25 GB/s in CUDA's bandwidthTest on A100 hosts).
PCIE_EFFICIENCY = 0.8


def host_copy_rate(gpu_names, fabric: FabricModel) -> float:
    """Bytes/s one device copies between host and device memory, each way: for GPUs,
    :data:`PCIE_EFFICIENCY` of the slowest one's PCIe x16 line rate
    (:func:`topology.linkmodel.pcie_bandwidth`: the GPU's PCIe generation, e.g. Gen4 for
    A100, 0.8 x 31.5 GB/s = 25.2 GB/s); without GPUs, the fabric's copy throughput
    (host memory to host memory)."""
    from topology.linkmodel import pcie_bandwidth

    names = list(gpu_names)
    if not names:
        return float(fabric.copy_bandwidth)
    return PCIE_EFFICIENCY * min(pcie_bandwidth(n) for n in names)


def target_names() -> list[str]:
    """Names :func:`load_target` accepts: captured hosts, then fabric spec presets."""
    from topology.snapshot import fixture_names
    from topology.spec import preset_names

    hosts = fixture_names()
    return hosts + [n for n in preset_names() if n not in hosts]


def _gpu_rates(names) -> tuple[float, float]:
    """``(memory bytes/s, peak FP32 FLOP/s)`` of the slowest of these GPU models, from the
    link model (``topology.linkmodel``); 0.0 for a figure it does not know for every one."""
    from topology.linkmodel import compute_rate, memory_bandwidth

    def slowest(rate_of) -> float:
        rates = [rate_of(n) for n in names]
        return float(min(rates)) if rates and all(rates) else 0.0

    return slowest(memory_bandwidth), slowest(compute_rate)


def load_host(spec: str):
    """The :class:`~topology.types.HostTopology` of a captured host or a topology JSON file."""
    from topology import types as ttypes

    if os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as fh:
                data = ttypes.from_json(fh.read())
        except (OSError, ValueError) as exc:
            raise ValueError(f"fabric: cannot read a topology from {spec!r}: {exc}") from None
        if isinstance(data, ttypes.ClusterTopology) and data.hosts:
            return data.hosts[0]
        if isinstance(data, ttypes.HostTopology):
            return data
        raise ValueError(f"fabric: {spec!r} holds no host topology")
    from topology.host import discover_host
    from topology.snapshot import fixture_names, materialized
    from topology.types import ProbeWarning

    if spec not in fixture_names():
        raise ValueError(f"fabric: expected one of {target_names()} or a topology JSON or "
                         f"fabric spec TOML file, got {spec!r}")
    with materialized(spec) as fx, warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        return discover_host(fx.root, nvidia_smi_topo=fx.nvidia_smi_topo,
                             nvidia_smi_query=fx.nvidia_smi_query, live=False)


def target_of_host(host) -> Target:
    """The target of hosts like ``host`` (a :class:`~topology.types.HostTopology`)."""
    from collectives.topofabric import fabric_from_topology
    from topology.types import ClusterTopology

    fabric = fabric_from_topology(ClusterTopology.single(host), device=bool(host.gpus))
    fabric = replace(fabric, source=f"link model of host {host.hostname}: "
                                    f"{fabric.source.removeprefix('topology: ')}")
    sizes = [g.memory_bytes for g in host.gpus if g.memory_bytes]
    names = [g.name for g in host.gpus]
    return Target(host.hostname, fabric, len(host.gpus) or max(1, host.cpus),
                  min(sizes) if sizes else None, *_gpu_rates(names),
                  host_bandwidth=host_copy_rate(names, fabric))


def target_of_spec(spec) -> Target:
    """The target a fabric spec (:class:`~topology.spec.FabricSpec`) declares: its links as
    :func:`collectives.topofabric.spec_links` gives them (device buffers on GPU nodes)."""
    from collectives.topofabric import spec_links

    memory = int(spec.min_gpu_memory_gib * (1 << 30)) if spec.min_gpu_memory_gib else None
    names = [spec.gpu_model] if spec.gpu_model else []
    fabric = spec_links(spec, device=bool(spec.gpus))
    if spec.gpus and not names:
        names = ["unknown"]  # PCIe Gen3 when the model is not declared
    return Target(spec.name, fabric, spec.gpus or max(1, spec.min_cpus), memory,
                  *_gpu_rates([spec.gpu_model] if spec.gpu_model else []),
                  host_bandwidth=host_copy_rate(names, fabric))


def load_target(spec: str) -> Target:
    """The target named ``spec``: a captured host, a fabric spec preset, a fabric
    spec ``.toml`` file or a topology ``.json`` file. ValueError otherwise."""
    from topology.snapshot import fixture_names
    from topology.spec import SpecError, load_spec, preset_names

    if spec.endswith(".toml") or (spec in preset_names() and spec not in fixture_names()):
        try:
            return target_of_spec(load_spec(spec))
        except SpecError as exc:
            raise ValueError(f"fabric: {exc}") from None
    return target_of_host(load_host(spec))


def hardware_for(target: Target, world_size: int, *, ranks_per_node: int | None = None,
                 device_memory: int | None = None, reserve: float = 0.0,
                 min_column_dim: int = 32, memory_bandwidth: float | None = None,
                 host_memory: int = 0, host_bandwidth: float | None = None) -> Hardware:
    """:class:`Hardware` of ``world_size`` ranks on ``target``.

    ``ranks_per_node`` defaults to the target's devices per host (at most
    ``world_size``), ``device_memory`` and ``memory_bandwidth`` (bytes/s) to
    the target's. ``host_memory`` is the bytes per node host-resident tables may
    take (0: no host tier); ``host_bandwidth`` (bytes/s per rank, each way)
    defaults to the target's (:func:`host_copy_rate`).
    """
    if ranks_per_node is None:
        ranks_per_node = max(1, min(target.devices_per_host, world_size))
        if world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node: expected a divisor of world_size {world_size}, "
                             f"got {ranks_per_node}, the default: the devices per host of "
                             f"{target.name!r}; give ranks_per_node")
    if device_memory is None:
        if target.device_memory is None:
            raise ValueError(f"memory: {target.name!r} declares no device memory; give it "
                             f"explicitly")
        device_memory = target.device_memory
    if memory_bandwidth is None:
        memory_bandwidth = target.memory_bandwidth
    if host_bandwidth is None:
        host_bandwidth = target.host_bandwidth
    return Hardware(world_size=world_size, ranks_per_node=ranks_per_node,
                    device_memory=int(device_memory), fabric=target.fabric, reserve=reserve,
                    min_column_dim=min_column_dim, memory_bandwidth=float(memory_bandwidth),
                    host_memory=int(host_memory), host_bandwidth=float(host_bandwidth))
