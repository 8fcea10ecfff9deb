"""Collective and point-to-point times from the alpha-beta model on the cluster's link hierarchy.

Formulas (docs/cost-model.md, ring algorithms; M is the bytes of the whole tensor, n the
group size): all-reduce 2(n-1)alpha + 2(n-1)/n M/beta; all-gather and reduce-scatter
(n-1)alpha + (n-1)/n M/beta; all-to-all (n-1)alpha + (n-1)/n M/beta_bisection; p2p alpha + M/beta.

A group spanning several nodes with k members on each runs hierarchically, as NCCL does: the
members of a node exchange over the in-node link while only 1/k of the data crosses nodes per
device (an all-reduce is an in-node reduce-scatter, an all-reduce of M/k across nodes and an
in-node all-gather). When the across-node link is a node's total bandwidth (`Link.per_node`), it is
shared by all devices of the node, because every device of a node talks across nodes at the same
time in the collectives the plans here make (each tensor-parallel rank in its own data-parallel
group; each device of a stage sending to the next stage).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nnscaler_plugins.search.cluster import ClusterSpec


@dataclass(frozen=True)
class Span:
    """How a device group lies on the cluster: its size, the nodes it touches, members per node."""

    size: int
    nodes: int
    per_node: int

    @property
    def local(self) -> bool:
        return self.nodes <= 1


def span_of(cluster: ClusterSpec, devices: Sequence[int]) -> Span:
    per: dict[int, int] = {}
    for d in devices:
        node = d // cluster.devices_per_node
        per[node] = per.get(node, 0) + 1
    return Span(len(devices), len(per), max(per.values(), default=1))


class Network:
    """Times of communication on one cluster (seconds)."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        eff = cluster.efficiency.network
        self.alpha_in = cluster.intra_node.latency
        self.beta_in = cluster.intra_node.bandwidth * eff
        self.alpha_x = cluster.inter_node.latency
        inter = cluster.inter_node.bandwidth * eff
        self.beta_x = inter / cluster.devices_per_node if cluster.inter_node.per_node else inter

    # -- building blocks -----------------------------------------------------------------------------
    def _ring(self, n: int, data: float, alpha: float, beta: float, rounds: int = 1) -> float:
        """`rounds` passes of a ring over n members, each moving (n-1)/n of `data`."""
        if n <= 1 or data <= 0:
            return 0.0
        return rounds * ((n - 1) * alpha + (n - 1) / n * data / beta)

    def all_reduce(self, nbytes: float, span: Span) -> float:
        if span.size <= 1 or nbytes <= 0:
            return 0.0
        if span.local:
            return self._ring(span.size, nbytes, self.alpha_in, self.beta_in, 2)
        k = span.per_node
        inner = self._ring(k, nbytes, self.alpha_in, self.beta_in, 2)  # reduce-scatter + all-gather
        return inner + self._ring(span.nodes, nbytes / k, self.alpha_x, self.beta_x, 2)

    def all_gather(self, nbytes: float, span: Span) -> float:
        """`nbytes`: the gathered (whole) tensor."""
        if span.size <= 1 or nbytes <= 0:
            return 0.0
        if span.local:
            return self._ring(span.size, nbytes, self.alpha_in, self.beta_in)
        k = span.per_node
        return self._ring(k, nbytes, self.alpha_in, self.beta_in) + \
            self._ring(span.nodes, nbytes / k, self.alpha_x, self.beta_x)

    reduce_scatter = all_gather  # the same traffic in the other direction

    def all_to_all(self, nbytes: float, span: Span) -> float:
        """`nbytes`: the whole tensor; each device sends (n-1)/n of its 1/n share."""
        n = span.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        share = nbytes / n
        if span.local:
            return (n - 1) * self.alpha_in + (n - 1) / n * share / self.beta_in
        k = span.per_node
        return (n - 1) * self.alpha_x + share * ((k - 1) / n / self.beta_in + (n - k) / n / self.beta_x)

    def p2p(self, nbytes: float, cross_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        if cross_node:
            return self.alpha_x + nbytes / self.beta_x
        return self.alpha_in + nbytes / self.beta_in

    def collective(self, kind: str, nbytes: float, span: Span) -> float:
        if kind == "all-reduce":
            return self.all_reduce(nbytes, span)
        if kind in ("all-gather", "reduce-scatter"):
            return self.all_gather(nbytes, span)
        if kind == "all-to-all":
            return self.all_to_all(nbytes, span)
        if kind in ("permute", "send"):
            return self.p2p(nbytes, not span.local)
        return 0.0
