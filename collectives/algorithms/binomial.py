"""Binomial-tree Broadcast and OneToMany (identical payload), pipelined by chunks.

Members are numbered from the root (relative rank 0). A member receives
the payload from the member that differs in its lowest set bit and passes
it on to ``vr + 2^j`` for every ``2^j`` below that bit: ``ceil(log2 n)``
rounds. Each chunk is forwarded to the children as soon as it has arrived,
so large payloads stream down the tree instead of waiting at every level.
"""
from __future__ import annotations

import collections

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Binomial", "tree_broadcast", "tree_member", "payload", "tree_members",
           "binomial_seconds", "ALGORITHMS"]


def tree_members(req: Request, fab: FabricModel) -> int:
    """Ranks a tree broadcast reaches: the root and the receivers of OneToMany
    (``peers``, else everyone), the whole group for Broadcast."""
    if req.op is CollectiveOp.ONE_TO_MANY:
        return 1 + (req.peers if req.peers else fab.size - 1)
    return fab.size


def binomial_seconds(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    """``ceil(log2 members)`` rounds of one whole-payload message each.
    ``overhead=False``: steps issued by a library, not Python."""
    members = tree_members(req, fab)
    link = ab.link(fab, fab.nodes > 1, 1)
    return ab.log2ceil(members) * ab.stream(req.nbytes, link, fab, pipelined=False,
                                            overhead=overhead)


def payload(call: Call):
    """The buffer a member holds the broadcast payload in (root: its source)."""
    if call.op is CollectiveOp.BROADCAST or call.rank != call.root:
        return call.recvbuf
    return call.sendbuf


def tree_broadcast(call: Call, buf, parent: int | None, children, chunk: int, *, tag: int):
    """Generator: receive ``buf`` from ``parent`` (None at the root) in chunks of
    ``chunk`` elements and forward every chunk to each child as it arrives."""
    policy = call.policy
    depth, lanes = policy.depth, policy.lanes
    n = buf.size
    pieces = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    sends: collections.deque = collections.deque()
    posted: collections.deque = collections.deque()

    def forward(i, a, b):
        for child in children:
            sends.append(call.isend(buf[a:b], child, tag + i % lanes))
        while sends and sends[0].test():
            sends.popleft()

    if parent is None:
        for i, (a, b) in enumerate(pieces):
            forward(i, a, b)
            while len(sends) > depth * max(1, len(children)):
                yield (sends.popleft(),)
    else:
        def post(i):
            a, b = pieces[i]
            posted.append((i, a, b, call.irecv(buf[a:b], parent, tag + i % lanes)))

        for i in range(min(depth, len(pieces))):
            post(i)
        nxt = len(posted)
        while posted:
            i, a, b, h = posted.popleft()
            yield (h,)
            forward(i, a, b)
            if nxt < len(pieces):
                post(nxt)
                nxt += 1
    while sends:
        yield (sends.popleft(),)


def binomial_links(position: int, n: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` positions of ``position`` in a binomial tree of ``n``
    rooted at position 0 (children in sending order, largest subtree first)."""
    parent, mask = None, 1
    while mask < n:
        if position & mask:
            parent = position - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if position + mask < n:
            children.append(position + mask)
        mask >>= 1
    return parent, children


def members_from_root(call: Call) -> list[int]:
    """Participating group ranks, root first."""
    members = list(call.members)
    if call.root in members:
        members.remove(call.root)
    return [call.root] + members


def local_copy(call: Call) -> None:
    """OneToMany with the root among the receivers: the root keeps its own copy."""
    if (call.op is CollectiveOp.ONE_TO_MANY and call.rank == call.root
            and call.recvbuf is not None):
        if call.identical:
            call.recvbuf[:] = call.sendbuf
        else:
            i = list(call.members).index(call.root)
            a = int(call.send_displs[i])
            call.recvbuf[:] = call.sendbuf[a:a + int(call.send_counts[i])]


def tree_member(call: Call):
    """``(members root first, this rank's position, payload buffer)`` for a tree
    broadcast, after the root's own copy; None when this rank takes no part."""
    local_copy(call)
    members = members_from_root(call)
    if call.rank not in members:
        return None
    return members, members.index(call.rank), payload(call)


class _TreeBase(Algorithm):
    ops = frozenset({CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY})

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        reason = super().supports(request, fabric)
        if reason is None and request.op is CollectiveOp.ONE_TO_MANY and not request.identical:
            reason = "sends one payload to every receiver; distinct payloads need 'direct'"
        return reason


class Binomial(_TreeBase):
    """Pipelined binomial tree."""

    name = "binomial"
    order = 20

    def formula(self, request: Request, fabric: FabricModel) -> float:
        return binomial_seconds(request, fabric)

    def run(self, call: Call):
        found = tree_member(call)
        if found is None:
            return
        members, pos, buf = found
        parent, children = binomial_links(pos, len(members))
        chunk = min(call.policy.intra, call.policy.inter)
        yield from tree_broadcast(call, buf, None if parent is None else members[parent],
                                  [members[c] for c in children], chunk, tag=call.tags(0))


ALGORITHMS = (Binomial(),)
