"""MPI hostfiles: what they say, and where ``neocomm run`` puts each rank.

A hostfile names one host a line, optionally with its slots (the ranks it should take):

    node-a slots=8
    node-b slots=8      # comments and blank lines are ignored

``neocomm run --hostfile`` asks the MPI launcher to map by slot: ranks fill each host's
slots in the file's order (ranks 0-7 on node-a, 8-15 on node-b above). A job of more
ranks than slots spreads the extra ranks evenly over the hosts, the first hosts taking
one more when they do not divide (Open MPI's rule). A host without ``slots`` gets as
many as it has cores, which only that host knows.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostSlots", "read_hostfile", "placement", "describe_placement", "layout_hostfile"]


@dataclass(frozen=True)
class HostSlots:
    """One line of a hostfile: the host and its slots (None: as many as its cores)."""

    host: str
    slots: int | None = None


def read_hostfile(path: str) -> list[HostSlots]:
    """The hosts of the hostfile at ``path``, in order (a host named twice adds its slots).
    ValueError naming the file and line for what cannot be read."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ValueError(f"--hostfile: cannot read {path!r}: {exc.strerror or exc}") from None
    hosts: dict[str, int | None] = {}
    for number, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        host, slots = words[0], None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots"):
                try:
                    n = int(value)
                except ValueError:
                    n = -1
                if n < 1:
                    raise ValueError(f"--hostfile {path}, line {number}: {word!r}: expected "
                                     f"{key}=N with N a positive whole number")
                if key == "slots":
                    slots = n
        if host in hosts:
            old = hosts[host]
            hosts[host] = None if old is None or slots is None else old + slots
        else:
            hosts[host] = slots
    if not hosts:
        raise ValueError(f"--hostfile {path}: names no host")
    return [HostSlots(h, s) for h, s in hosts.items()]


def placement(hosts: list[HostSlots], nprocs: int) -> list[tuple[str, range]] | None:
    """The ranks each host takes under map-by-slot, or None when a host's slots are not
    given (they are then its cores, known only there)."""
    if any(h.slots is None for h in hosts):
        return None
    total = sum(h.slots for h in hosts)
    extra = max(0, nprocs - total)
    each, rest = divmod(extra, len(hosts))
    out, first = [], 0
    for i, h in enumerate(hosts):
        take = min(h.slots, nprocs - first) if extra == 0 else \
            h.slots + each + (1 if i < rest else 0)
        if take > 0:
            out.append((h.host, range(first, first + take)))
        first += max(take, 0)
        if first >= nprocs:
            break
    return out


def _ranks(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def describe_placement(hosts: list[HostSlots], nprocs: int) -> str:
    """One line for the user: where the ranks go."""
    plan = placement(hosts, nprocs)
    if plan is None:
        named = ", ".join(h.host + (f" ({h.slots} slots)" if h.slots else "") for h in hosts)
        return (f"{nprocs} rank(s) over {named}: each host's slots filled in order, a host "
                f"without slots= taking as many ranks as it has cores")
    total = sum(h.slots for h in hosts)
    where = ", ".join(f"{host} ranks {_ranks(r)}" for host, r in plan)
    over = f"; {nprocs - total} more than the {total} slots, spread over the hosts" \
        if nprocs > total else ""
    return f"{nprocs} rank(s) on {len(plan)} host(s): {where}{over}"


def layout_hostfile(path: str, nodes: int, ranks_per_node: int, out: str) -> str:
    """Write to ``out`` a hostfile of the first ``nodes`` hosts of the hostfile at ``path``,
    ``ranks_per_node`` slots each, and return ``out``: the file that places a job of
    ``nodes x ranks_per_node`` ranks that many to a host, whatever slots ``path`` gives
    (mapped by slot, one hostfile cannot place 2 ranks on 2 hosts and 4 ranks 2 to a
    host alike). ValueError when ``path`` names fewer hosts than ``nodes``."""
    hosts = read_hostfile(path)
    if len(hosts) < nodes:
        raise ValueError(f"--hostfile {path}: {nodes} nodes wanted, but it names "
                         f"{len(hosts)} host(s) ({', '.join(h.host for h in hosts)})")
    with open(out, "w") as fh:
        for h in hosts[:nodes]:
            fh.write(f"{h.host} slots={int(ranks_per_node)}\n")
    return out
