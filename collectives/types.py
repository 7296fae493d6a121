"""Vocabulary of the collectives layer: operations, links, fabric models, requests.

Everything here is plain data (frozen dataclasses and Enums). Sizes are in
bytes, times in seconds, bandwidths in bytes per second.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

__all__ = ["CollectiveOp", "LinkCost", "FabricModel", "Request", "Layout", "DEFAULT_INTRA_LINK",
           "DEFAULT_INTER_LINK", "DEFAULT_COPY_BANDWIDTH", "DEFAULT_REDUCE_BANDWIDTH",
           "DEFAULT_STEP_OVERHEAD", "PAGE_BYTES", "ROCE_MTU", "SYMMETRIC_SEND",
           "SYMMETRIC_RECV"]

#: Bits of :attr:`Request.symmetric`: the send side, the receive side is symmetric memory.
SYMMETRIC_SEND, SYMMETRIC_RECV = 1, 2

#: RoCE / InfiniBand MTU in bytes; chunk sizes are multiples of it.
ROCE_MTU = 4096


class CollectiveOp(enum.Enum):
    """The collective operations of :mod:`collectives`."""

    ALL_TO_ALL = "all_to_all"
    ALL_TO_ALL_V = "all_to_all_v"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ONE_TO_MANY = "one_to_many"
    MANY_TO_MANY = "many_to_many"

    @classmethod
    def parse(cls, value: "CollectiveOp | str") -> "CollectiveOp":
        """Accept a CollectiveOp or its name (``"all_reduce"``, ``"ALL_REDUCE"``,
        ``"allreduce"``); ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for op in cls:
                if key in (op.value, op.value.replace("_", "")):
                    return op
        raise ValueError(f"op: expected one of {[o.value for o in cls]}, got {value!r}")


@dataclass(frozen=True)
class LinkCost:
    """One class of link seen by one rank: ``latency`` (seconds, the alpha of the
    alpha-beta model), ``bandwidth`` (bytes/s, 1/beta) and the chunk size
    (bytes) that large messages over it are cut into."""

    latency: float
    bandwidth: float
    chunk_bytes: int = 1 << 20
    #: the link class ("nvlink", "pcie", "shm", "roce", "infiniband", "tcp"; "" unknown):
    #: a shared-memory link moves bytes through the host's memory, and its rate depends
    #: on whether they are in cache (:attr:`FabricModel.cache_bytes`)
    kind: str = ""

    def __post_init__(self):
        if not self.latency >= 0:
            raise ValueError(f"latency: expected seconds >= 0, got {self.latency}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth: expected bytes/s > 0, got {self.bandwidth}")
        if int(self.chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: expected bytes > 0, got {self.chunk_bytes}")

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of ``nbytes`` over this link."""
        return self.latency + nbytes / self.bandwidth


# Defaults for a host we know nothing about: shared-memory-class numbers,
# since every rank of such a job (emulated nodes included) talks through
# shared memory. Sources:
# - Open MPI's shared-memory transport has a small-message latency of the
#   order of a microsecond (osu_latency on one host: 0.3-1 us).
# - Bandwidth: DESIGN.md section 7 quotes native Open MPI AlltoAll of 64 MiB
#   per rank on 2 ranks at about 8 ms on this machine class: 32 MiB each way
#   in 8 ms is about 4.2e9 bytes/s per rank and direction.
# - Local copies: one-core np.copyto of 256 MiB at 13-17 GB/s (same section);
#   the lower end is taken because ranks share the memory bus.
# - Reductions: an in-place add streams three arrays where a copy streams
#   two, so two thirds of the copy rate.
#: Intra-node link of an unknown host (shared memory), 1 us, 4.2e9 B/s, 4 MiB chunks
#: (the shared-memory chunk size of :mod:`collectives.topofabric`).
DEFAULT_INTRA_LINK = LinkCost(latency=1.0e-6, bandwidth=4.2e9, chunk_bytes=4 << 20, kind="shm")
#: Inter-node link of an unknown host: emulated nodes also use shared memory.
DEFAULT_INTER_LINK = LinkCost(latency=1.0e-6, bandwidth=4.2e9, chunk_bytes=4 << 20, kind="shm")
#: Local copy throughput per rank, bytes/s (np.copyto, see above).
DEFAULT_COPY_BANDWIDTH = 13.0e9
#: Local element-wise reduction throughput per rank, bytes/s of output.
DEFAULT_REDUCE_BANDWIDTH = DEFAULT_COPY_BANDWIDTH * 2.0 / 3.0
#: Bytes of a base page (x86-64, arm64 default): the unit of ``FabricModel.page_cost``.
PAGE_BYTES = 4096
#: Software cost of one point-to-point step issued from Python (post, test,
#: wait through mpi4py), seconds; an order-of-magnitude figure, calibrated
#: from measurements by ``neocomm bench --calibrate``.
DEFAULT_STEP_OVERHEAD = 5.0e-6


@dataclass(frozen=True)
class FabricModel:
    """The shape and links of one process group, as the cost model sees it.

    ``nodes`` nodes of ``ranks_per_node`` ranks each (a group whose nodes hold
    different numbers of ranks is described by its largest node). ``intra``
    is the link between two ranks of a node (per rank), ``inter`` the link of
    one NIC between nodes, ``nics_per_node`` how many NICs a node's ranks
    share for inter-node traffic. ``algorithm_factors`` holds calibration
    multipliers keyed ``"<op>/<algorithm>"`` or ``"<op>/<algorithm>@<log2 size>"``
    (measured time over modelled time), applied by
    :func:`collectives.cost.algorithm_cost`.

    Host effects, all off by default (``neocomm simulate calibrate`` fits them):
    ``call_overhead`` is the software cost of one API call beyond its algorithm
    (argument agreement, checks, selection), times the operation's entry of
    ``overhead_factors`` (keyed ``"<op>"``: the sparse operations check and key peer
    lists, the dense ones do not); ``node_bandwidth`` is the bytes/s a
    node's memory moves for all of its concurrent intra-node flows together (ranks
    that copy through shared memory share one memory system: each of ``f``
    concurrent flows gets at most ``node_bandwidth / f``); ``cache_bytes`` and
    ``cache_speedup``: when a call's working set on a node (every rank's send and
    receive buffers) fits in ``cache_bytes``, local rates (shared-memory links,
    copies, reductions) are ``cache_speedup`` times faster (a larger one gets no
    speedup: see :meth:`cache_factor`); ``cores_per_node``: with more ranks than cores on a
    node, every step waits ``switch_latency`` more for its peer to be scheduled,
    and software overheads stretch by ranks / cores. ``page_cost``: seconds a
    shared-memory transfer spends per 4 KiB page of the buffers it maps (a single-copy
    transport pins the peer's pages page by page), paid by calls whose buffers are
    smaller than ``huge_page_bytes`` (larger ones lie in huge pages; 0: none do).
    :meth:`effective` applies them to one request.

    A TCP link between nodes (``inter.kind == "tcp"``: kernel sockets over Ethernet, as
    MPI's TCP transport uses them) carries three more terms, all off by default:
    ``tcp_fraction`` is the part of the link's line rate (``inter.bandwidth``) that the
    transport reaches on the wire (a token bucket, a switch or the protocol's own pacing
    give a stream less than the rate); ``tcp_copy_bandwidth`` is the bytes/s of the
    hosts' own work per byte (the kernel copies every byte into the sender's socket and
    out of the receiver's, and handles every segment), paid beside the wire time, so a
    message of ``m`` bytes takes ``m / (fraction x rate) + m / tcp_copy_bandwidth``
    (0: no such cost); ``tcp_message_overhead`` is the seconds each message costs the
    hosts (system calls, wake-ups) beyond the wire's latency; ``tcp_call_overhead`` is
    the seconds each collective call whose messages cross such a link costs beyond its
    messages and bytes (:attr:`tcp_call_seconds`), MPI's own calls included: the ranks
    wait for messages in MPI yielding their cores, so a call's first messages (every one
    a rendezvous above MPI's 64 KiB eager limit over TCP, answered by the receiver before
    its bytes move) find their peers descheduled on a busy host. Measured on the test
    cluster: 3 to 7 ms a call on two cores shared by its hosts, under a load of 7 to 10.
    """

    ranks_per_node: int = 1
    nodes: int = 1
    intra: LinkCost = DEFAULT_INTRA_LINK
    inter: LinkCost = DEFAULT_INTER_LINK
    nics_per_node: int = 1
    copy_bandwidth: float = DEFAULT_COPY_BANDWIDTH
    reduce_bandwidth: float = DEFAULT_REDUCE_BANDWIDTH
    step_overhead: float = DEFAULT_STEP_OVERHEAD
    algorithm_factors: tuple[tuple[str, float], ...] = ()
    source: str = "defaults for an unknown host (shared memory)"
    call_overhead: float = 0.0
    node_bandwidth: float = 0.0
    cache_bytes: int = 0
    cache_speedup: float = 1.0
    cores_per_node: int = 0
    switch_latency: float = 0.0
    page_cost: float = 0.0
    huge_page_bytes: int = 0
    overhead_factors: tuple[tuple[str, float], ...] = ()
    tcp_fraction: float = 1.0
    tcp_copy_bandwidth: float = 0.0
    tcp_message_overhead: float = 0.0
    tcp_call_overhead: float = 0.0

    def __post_init__(self):
        for name in ("ranks_per_node", "nodes", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        for name in ("copy_bandwidth", "reduce_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected bytes/s > 0, got {getattr(self, name)}")
        for name in ("step_overhead", "call_overhead", "switch_latency", "node_bandwidth",
                     "page_cost", "tcp_copy_bandwidth", "tcp_message_overhead",
                     "tcp_call_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected a value >= 0, got {getattr(self, name)}")
        if not 0 < self.tcp_fraction <= 1:
            raise ValueError(f"tcp_fraction: expected a fraction of the line rate in (0, 1], "
                             f"got {self.tcp_fraction}")
        if not self.cache_speedup >= 1:
            raise ValueError(f"cache_speedup: expected a factor >= 1, got {self.cache_speedup}")
        for name in ("cache_bytes", "cores_per_node", "huge_page_bytes"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {getattr(self, name)}")
        for name in ("algorithm_factors", "overhead_factors"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, tuple(sorted(getattr(self, name).items())))

    @property
    def size(self) -> int:
        """Number of ranks the model describes."""
        return self.ranks_per_node * self.nodes

    def factor(self, op: CollectiveOp, algorithm: str, nbytes: int | None = None) -> float:
        """Calibration multiplier of ``algorithm`` for ``op`` (1.0 when uncalibrated).

        Keys are ``"<op>/<algorithm>"`` (any size) or ``"<op>/<algorithm>@<k>"``
        for sizes in ``[2^k, 2^(k+1))`` bytes; the nearest measured bucket of
        ``nbytes`` wins over the size-free key.
        """
        key = f"{op.value}/{algorithm}"
        plain, buckets = None, []
        for name, value in self.algorithm_factors:
            if name == key:
                plain = float(value)
            elif name.startswith(key + "@"):
                buckets.append((int(name[len(key) + 1:]), float(value)))
        if buckets and nbytes is not None:
            k = max(0, int(nbytes).bit_length() - 1)
            return min(buckets, key=lambda b: (abs(b[0] - k), b[0]))[1]
        return 1.0 if plain is None else plain

    def overhead_factor(self, op: CollectiveOp) -> float:
        """Calibration multiplier of :attr:`call_overhead` for a call of ``op`` (1.0 when
        uncalibrated)."""
        return float(dict(self.overhead_factors).get(op.value, 1.0))

    def inter_share(self, flows_per_node: int) -> float:
        """Bandwidth (bytes/s) one of ``flows_per_node`` concurrent inter-node
        flows of a node gets: the NICs are shared evenly, one flow never gets
        more than one NIC."""
        flows = max(1, int(flows_per_node))
        return self.inter.bandwidth * min(1.0, self.nics_per_node / flows)

    @property
    def oversubscription(self) -> float:
        """Ranks per core of a node (1.0 when ranks have cores of their own)."""
        if not self.cores_per_node or self.ranks_per_node <= self.cores_per_node:
            return 1.0
        return self.ranks_per_node / self.cores_per_node

    def cache_factor(self, working_set: float) -> float:
        """How much faster local rates are for a call whose working set on a node is
        ``working_set`` bytes: ``cache_speedup`` when it fits in ``cache_bytes``, else 1
        (a stream through buffers larger than the cache evicts each line before its
        next use, so a partial fit buys next to nothing)."""
        if self.cache_speedup <= 1.0 or self.cache_bytes <= 0:
            return 1.0
        return self.cache_speedup if working_set <= self.cache_bytes else 1.0

    def page_seconds(self, nbytes: float) -> float:
        """Seconds per byte that a shared-memory transfer of a call whose largest buffer
        is ``nbytes`` spends on its pages (``page_cost`` per 4 KiB page below
        ``huge_page_bytes``, nothing in huge pages)."""
        if self.page_cost <= 0 or 0 < self.huge_page_bytes <= nbytes:
            return 0.0
        return self.page_cost / PAGE_BYTES

    @property
    def tcp_terms(self) -> bool:
        """Whether the inter-node link is TCP with any of its terms on (class doc)."""
        return self.inter.kind == "tcp" and (self.tcp_fraction < 1.0 or
                                             self.tcp_copy_bandwidth > 0 or
                                             self.tcp_message_overhead > 0)

    @property
    def tcp_call_seconds(self) -> float:
        """The fixed cost of one collective call of this group over its TCP link
        (:attr:`tcp_call_overhead`, stretched by ranks over cores like the hosts' other
        work); 0 within one node or over other links."""
        if self.nodes < 2 or self.inter.kind != "tcp":
            return 0.0
        return self.tcp_call_overhead * self.oversubscription

    def tcp_link(self, link: LinkCost, over: float = 1.0) -> LinkCost:
        """``link`` (a TCP link at its line rate) with the TCP terms folded in: the rate
        the transport reaches on the wire, the hosts' per-byte work beside it (a core's
        work: it shares the core with ``over`` ranks) and each message's host cost."""
        per_byte = 1.0 / (link.bandwidth * self.tcp_fraction)
        if self.tcp_copy_bandwidth > 0:
            per_byte += over / self.tcp_copy_bandwidth
        return replace(link, bandwidth=1.0 / per_byte,
                       latency=link.latency + self.tcp_message_overhead * over)

    def effective(self, request: "Request") -> "FabricModel":
        """This fabric as one call of ``request`` sees it: the cache, page,
        oversubscription, TCP and call-overhead terms (class doc) folded into plain links
        and rates, so that the alpha-beta formulas need not know them. The identity when
        they are off."""
        over = self.oversubscription
        speed = self.cache_factor(self.ranks_per_node * request.working_set)
        paged = self.page_seconds(request.nbytes)
        tcp = self.tcp_terms
        if over == 1.0 and speed == 1.0 and paged == 0.0 and not tcp:
            return self
        switch = self.switch_latency if over > 1.0 else 0.0

        def local(link: LinkCost) -> LinkCost:
            # a copy through shared memory is a core's work (its pages too): it shares
            # the core
            if link.kind == "tcp" and tcp:
                wire = self.tcp_link(link, over)
                return replace(wire, latency=wire.latency + switch)
            if link.kind != "shm":
                return replace(link, latency=link.latency + switch)
            rate = 1.0 / (1.0 / (link.bandwidth * speed) + paged) / over
            return replace(link, latency=link.latency + switch, bandwidth=rate)

        return replace(self, intra=local(self.intra), inter=local(self.inter),
                       copy_bandwidth=self.copy_bandwidth * speed / over,
                       reduce_bandwidth=self.reduce_bandwidth * speed / over,
                       node_bandwidth=self.node_bandwidth * speed,
                       step_overhead=self.step_overhead * over,
                       call_overhead=self.call_overhead * over,
                       cache_speedup=1.0, cores_per_node=0, page_cost=0.0,
                       tcp_fraction=1.0, tcp_copy_bandwidth=0.0, tcp_message_overhead=0.0)

    def emulated(self) -> "FabricModel":
        """This fabric with all its nodes emulated on one host: they share its
        ``cores_per_node`` cores, its last-level cache (``cache_bytes``) and its memory
        (``node_bandwidth``), so each node gets its part of each."""
        n = self.nodes
        if n == 1:
            return self
        return replace(self, cores_per_node=max(1, self.cores_per_node // n)
                       if self.cores_per_node else 0,
                       cache_bytes=int(self.cache_bytes) // n,
                       node_bandwidth=self.node_bandwidth / n)

    def with_shape(self, ranks_per_node: int, nodes: int) -> "FabricModel":
        """The same links for a group of another shape."""
        return replace(self, ranks_per_node=int(ranks_per_node), nodes=int(nodes))


@dataclass(frozen=True)
class Request:
    """What the selector knows about one collective call, identical on every rank.

    ``nbytes`` follows nccl-tests' "size": the send buffer of AlltoAll(v)
    (bytes one rank sends in total), the input of ReduceScatter, the buffer
    of AllReduce and Broadcast, the output of AllGather, the payload per
    receiver of OneToMany, the bytes one rank sends in total in ManyToMany.
    ``max_block`` is the largest per-peer block in bytes (equal to
    ``nbytes / group_size`` for uniform operations). ``peers`` is the number
    of receivers of OneToMany or the largest number of peers of a rank in
    ManyToMany; ``identical`` says whether OneToMany sends one payload to all.
    ``uniform_nodes`` is False when the group's nodes hold different numbers of ranks.
    ``symmetric`` has bit 1 set when the send side (the input, or the buffer of an
    in-place call) is symmetric memory of the group (:mod:`collectives.symmetric`),
    bit 2 when the receive side is.
    """

    op: CollectiveOp
    nbytes: int
    itemsize: int = 4
    group_size: int = 1
    max_block: int = 0
    root: int = 0
    peers: int = 0
    identical: bool = True
    uniform: bool = True
    device: bool = False
    in_place: bool = False
    reduce_op: str = "sum"
    uniform_nodes: bool = True
    symmetric: int = 0
    extra: tuple[tuple[str, object], ...] = field(default=())

    def __post_init__(self):
        if self.nbytes < 0:
            raise ValueError(f"nbytes: expected bytes >= 0, got {self.nbytes}")
        if self.itemsize < 1:
            raise ValueError(f"itemsize: expected bytes >= 1, got {self.itemsize}")
        if self.group_size < 1:
            raise ValueError(f"group_size: expected ranks >= 1, got {self.group_size}")

    @property
    def working_set(self) -> float:
        """Bytes of buffers one rank's call touches: the one buffer of a Broadcast (or
        an in-place call), a block besides the whole for ReduceScatter and AllGather, a
        send and a receive buffer of the size otherwise."""
        op, p = self.op, max(1, self.group_size)
        if self.in_place or op is CollectiveOp.BROADCAST:
            return float(self.nbytes)
        if op in (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER):
            return self.nbytes * (1.0 + 1.0 / p)
        return 2.0 * self.nbytes


@dataclass(frozen=True)
class Layout:
    """Where the ranks of a group live: ``node[r]`` (0-based node position) and
    ``local[r]`` (position within its node) for every group rank ``r``;
    ``nodes`` lists the group ranks of each node in order."""

    nodes: tuple[tuple[int, ...], ...]
    node: tuple[int, ...]
    local: tuple[int, ...]

    @classmethod
    def from_nodes(cls, nodes) -> "Layout":
        nodes = tuple(tuple(int(r) for r in n) for n in nodes)
        size = sum(len(n) for n in nodes)
        node, local = [0] * size, [0] * size
        for i, members in enumerate(nodes):
            for j, r in enumerate(members):
                node[r], local[r] = i, j
        return cls(nodes, tuple(node), tuple(local))

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        return max(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)
