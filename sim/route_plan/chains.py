"""Chains over a placement, and the exact pricing step of the path LP's column generation (``path_lp``).

A chain: from a gateway, hops covering blocks [0, B) in order, each entering its node at the boundary reached so
far (mid-span allowed) and leaving at its span's end, then back to the same gateway (as ``plan_route``'s routes
when they push). Its idle round T (seconds per token): the gateway's work, each link's one-way time and each hop's
step (``fixed + blocks x token_time``).

Pricing finds the chains of least ``f = A + T x M`` where, for dual prices ``a`` and ``m`` per node and block,
``A`` and ``M`` add ``a[n] x blocks`` and ``m[n] x blocks`` per hop. The product makes a plain shortest path wrong,
so this is a label-setting programme over nodes in order of span end (the state after a hop is its node), keeping
every label that no other dominates: a label (partial F = A + T x M, T, M) dominates another at the same node when
it is no worse in all three, because any completion (a', t', m' >= 0) adds ``a' + T m' + t' M + t' m'`` to F,
no more for the dominating label. Labels are also dropped when even the cheapest completion, each of a', t', m'
at its own minimum (a lower bound on the real one), reaches ``threshold``. Neither rule drops a label that leads
to a chain with ``f < threshold`` not matched by a kept one, so the least ``f`` returned is exact whenever it is
below the threshold (``tests/unit/sim/test_path_bound.py`` checks it against every chain enumerated by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
GATEWAY = -1  # the predecessor of a chain's first hop
CHUNK = 512  # labels compared at once in ``_undominated``
_EARLIER = np.triu(np.ones((CHUNK, CHUNK), dtype=bool), k=1)  # [i, j]: i before j in a block (made once)
Weight = Callable[[int, Ints, Floats], Floats]  # per hop into a node: (node, its predecessors, link + step) -> cost


@dataclass(frozen=True)
class Spans:
    """Nodes as arrays: span [start, end), and one step's cost: ``fixed + blocks x token_time`` seconds for a hop
    of ``blocks`` blocks."""

    starts: Ints
    ends: Ints
    fixed: Floats
    token_time: Floats


class TooManyLabels(RuntimeError):
    """Pricing kept more labels at one node than its limit: no exact answer within the time it was given."""


@dataclass(frozen=True)
class Chain:
    gateway: int  # which of the graph's gateways (an index)
    hops: tuple[tuple[int, int], ...]  # (node, entry boundary), each to its node's span end


@dataclass(frozen=True)
class Graph:
    """The chains of a placement as a DAG over nodes (a hop's state is its node: it leaves at its span end)."""

    placement: Spans
    blocks: int
    gateways: int
    work: float  # the gateway's seconds per token
    order: list[int]  # nodes by span end
    preds: list[Ints]  # per node, the nodes whose span ends inside its span (a chain may come from them)
    pred_time: list[Floats]  # per node and predecessor: the link's half RTT and the hop's step
    out: Floats  # [gateway, node]: the gateway's link to a first hop and its step (inf if not at block 0)
    back: Floats  # [gateway, node]: a last hop's link back to the gateway (inf if it does not end at B)
    rest_time: Floats  # [gateway, node]: the least seconds from the node's span end back to the gateway

    @staticmethod
    def of(placement: Spans, links: Floats, gateway_links: Floats, blocks: int, work: float) -> Graph:
        """``links[a, b]``: one-way seconds from node a to node b; ``gateway_links[g, n]``: between gateway g and
        node n (either way); ``work``: the gateway's seconds per token."""
        p = placement
        preds, pred_time = [], []
        for node in range(len(p.starts)):
            inside = np.flatnonzero((p.ends >= max(1, p.starts[node])) & (p.ends < p.ends[node]))
            preds.append(inside.astype(np.int64))
            step = p.fixed[node] + (p.ends[node] - p.ends[inside]) * p.token_time[node]
            pred_time.append(links[inside, node] + step)
        gateways = len(gateway_links)
        out = np.full((gateways, len(p.starts)), np.inf)
        back = np.full((gateways, len(p.starts)), np.inf)
        first, last = p.starts == 0, p.ends == blocks
        for g, legs in enumerate(gateway_links):
            out[g, first] = legs[first] + p.fixed[first] + p.ends[first] * p.token_time[first]
            back[g, last] = legs[last]
        order = [int(n) for n in np.argsort(p.ends, kind="stable")]
        graph = Graph(p, blocks, gateways, work, order, preds, pred_time, out, back, np.empty(0))
        rest = np.stack([graph.rest(back[g], lambda _n, _preds, t: t) for g in range(gateways)])
        return Graph(p, blocks, gateways, work, order, preds, pred_time, out, back, rest)

    def rest(self, at_end: Floats, weight: Weight) -> Floats:
        """Per node, the least total ``weight`` from its span end on (``at_end`` where it ends at the last block)."""
        last = self.placement.ends == self.blocks
        best = np.where(last, at_end, np.inf)
        for node in reversed(self.order):  # its successors end later: their values are final by now
            preds = self.preds[node]
            if len(preds) and np.isfinite(best[node]):
                np.minimum.at(best, preds, weight(node, preds, self.pred_time[node]) + best[node])
        return best

    def round(self, chain: Chain) -> float:
        """The chain's idle seconds per token."""
        (first, _), *hops = chain.hops
        total = self.work + self.out[chain.gateway, first]
        previous = first
        for node, _ in hops:
            total += float(self.pred_time[node][np.searchsorted(self.preds[node], previous)])
            previous = node
        return float(total + self.back[chain.gateway, previous])

    def holds(self, chain: Chain) -> bool:
        """Whether the chain runs on this placement: its gateway, every hop entered inside its span where the one
        before ended (the first at block 0), the last ending at the last block."""
        p, boundary = self.placement, 0
        if not 0 <= chain.gateway < self.gateways or not chain.hops:
            return False
        for node, entry in chain.hops:
            if not (0 <= node < len(p.starts) and entry == boundary and p.starts[node] <= entry < p.ends[node]):
                return False
            boundary = int(p.ends[node])
        return boundary == self.blocks

    def blocks_of(self, chain: Chain) -> list[tuple[int, int]]:
        """(node, blocks) per hop."""
        return [(n, int(self.placement.ends[n]) - entry) for n, entry in chain.hops]


class _Labels:
    """Every label one search kept, flat and growing: partial A, T, M, the node and the label it extends (an index
    here, ``GATEWAY`` for a first hop); per node, where its labels lie."""

    def __init__(self, nodes: int) -> None:
        self.a, self.t, self.m = np.empty(1024), np.empty(1024), np.empty(1024)
        self.node, self.parent = np.empty(1024, dtype=np.int64), np.empty(1024, dtype=np.int64)
        self.size = 0
        self.first, self.count = np.zeros(nodes, dtype=np.int64), np.zeros(nodes, dtype=np.int64)

    def add(self, node: int, a: Floats, t: Floats, m: Floats, parent: Ints) -> None:
        end = self.size + len(a)
        if end > len(self.a):
            grown = max(end, 2 * len(self.a))
            self.a, self.t, self.m = (np.resize(x, grown) for x in (self.a, self.t, self.m))
            self.node, self.parent = np.resize(self.node, grown), np.resize(self.parent, grown)
        self.a[self.size : end], self.t[self.size : end], self.m[self.size : end] = a, t, m
        self.node[self.size : end], self.parent[self.size : end] = node, parent
        self.first[node], self.count[node], self.size = self.size, len(a), end

    def at(self, node: int) -> slice:
        return slice(int(self.first[node]), int(self.first[node] + self.count[node]))


def price(
    graph: Graph,
    a: Floats,
    m: Floats,
    threshold: float,
    keep: int = 10**9,
    beam: int | None = None,
    limit: int = 20_000,
) -> tuple[float, list[tuple[float, Chain]]]:
    """(the least f of any chain, or ``threshold`` if none is below it; up to ``keep`` (f, chain) below it, least f
    first). ``a`` and ``m``: per node, the price of each block a hop runs there (both >= 0). ``beam``: keep only
    that many labels a node, those of least lower bound: fast, but then the least f found is not exact."""
    p = graph.placement
    a_rest = graph.rest(np.zeros(len(p.starts)), lambda n, preds, _t: a[n] * (p.ends[n] - p.ends[preds]))
    m_rest = graph.rest(np.zeros(len(p.starts)), lambda n, preds, _t: m[n] * (p.ends[n] - p.ends[preds]))
    found: list[tuple[float, int, int, _Labels]] = []
    for g in range(graph.gateways):
        labels = _search(graph, g, a, m, (a_rest, graph.rest_time[g], m_rest), threshold, beam, limit)
        for node in np.flatnonzero(np.isfinite(graph.back[g])).tolist():
            at = labels.at(node)
            f = labels.a[at] + (labels.t[at] + graph.back[g, node]) * labels.m[at]
            found += [(float(f[k]), g, at.start + k, labels) for k in np.flatnonzero(f < threshold).tolist()]
    found.sort(key=lambda item: item[0])
    least = found[0][0] if found else threshold
    return least, [(f, _chain(graph, labels, g, label)) for f, g, label, labels in found[:keep]]


def _search(
    graph: Graph,
    g: int,
    a: Floats,
    m: Floats,
    rest: tuple[Floats, Floats, Floats],
    threshold: float,
    beam: int | None,
    limit: int,
) -> _Labels:
    p = graph.placement
    labels = _Labels(len(p.starts))
    for node in graph.order:
        preds, times = graph.preds[node], graph.pred_time[node]
        counts = labels.count[preds]
        some = counts > 0
        preds, times, counts = preds[some], times[some], counts[some]
        total = int(counts.sum())
        # Every label of every predecessor, extended by this hop (offsets: each predecessor's labels in a row).
        parent = np.repeat(labels.first[preds] - (np.cumsum(counts) - counts), counts) + np.arange(total)
        blocks = np.repeat((p.ends[node] - p.ends[preds]).astype(float), counts)
        la, lt, lm = labels.a[parent], labels.t[parent] + np.repeat(times, counts), labels.m[parent]
        if np.isfinite(graph.out[g, node]):  # or a first hop, from the gateway
            parent = np.append(parent, GATEWAY)
            blocks = np.append(blocks, float(p.ends[node]))
            la, lt, lm = np.append(la, 0.0), np.append(lt, graph.work + graph.out[g, node]), np.append(lm, 0.0)
        if not len(parent):
            continue
        la, lm = la + a[node] * blocks, lm + m[node] * blocks
        with np.errstate(invalid="ignore"):  # inf x 0 where no completion exists: nan, dropped below
            low = la + rest[0][node] + (lt + rest[1][node]) * (lm + rest[2][node])
        keep = np.flatnonzero(low < threshold)
        if not len(keep):
            continue
        if beam is not None and len(keep) > beam:
            keep = keep[np.argpartition(low[keep], beam)[:beam]]
        keep = keep[_undominated(la[keep] + lt[keep] * lm[keep], lt[keep], lm[keep])]
        if len(keep) > limit:
            raise TooManyLabels(f"{len(keep)} labels at one node")
        labels.add(node, la[keep], lt[keep], lm[keep], parent[keep])
    return labels


def _undominated(f: Floats, t: Floats, m: Floats) -> Ints:
    """Indices of the labels no other is at least as good as in f, t and m (of equal ones, the first).

    Sorted by f (then t, m), a label is dominated exactly when an earlier one is no worse in t and m; compared as
    blocks of a pairwise matrix (a node keeps hundreds of labels at most: cheaper than a loop in Python). Earlier
    blocks count only their undominated labels: one that dominates is itself dominated by an undominated one or
    not at all (no worse in t and m is transitive), so the answer is the same with fewer comparisons."""
    order = np.lexsort((m, t, f))
    t, m = t[order], m[order]
    dominated = np.zeros(len(order), dtype=bool)
    for first in range(0, len(order), CHUNK):
        last = min(first + CHUNK, len(order))
        tj, mj = t[first:last], m[first:last]
        size = last - first
        inside = (t[first:last, None] <= tj) & (m[first:last, None] <= mj) & _EARLIER[:size, :size]
        dominated[first:last] = inside.any(axis=0)
        if first:
            front = np.flatnonzero(~dominated[:first])
            dominated[first:last] |= ((t[front, None] <= tj) & (m[front, None] <= mj)).any(axis=0)
    return np.sort(order[~dominated])


def _chain(graph: Graph, labels: _Labels, g: int, label: int) -> Chain:
    nodes = []
    while label != GATEWAY:
        nodes.append(int(labels.node[label]))
        label = int(labels.parent[label])
    nodes.reverse()
    ends = graph.placement.ends
    return Chain(g, tuple((n, 0 if i == 0 else int(ends[nodes[i - 1]])) for i, n in enumerate(nodes)))
