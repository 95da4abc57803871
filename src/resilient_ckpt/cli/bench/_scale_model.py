"""An alpha-beta model of collective cost, and the projection of a census to large jobs.

The census (:mod:`._collectives`) measures, at a few small world sizes W, every collective
of one steady-state save: its kind, group and each rank's payload. This module fits how
each collective's count and payload change with W (a straight line through the measured
points: constant, or linear in W) and prices each with the classic alpha-beta model: a
message costs ``alpha`` (latency per hop) plus ``n * beta`` (seconds per byte), and a
collective over W ranks costs a number of hops set by its algorithm. Small collectives use
log-depth algorithms (trees, recursive doubling: ``ceil(log2 W)`` hops); what a collective
gathers still has to arrive, so the bytes of a gather or all-gather grow with ``W - 1``.
Gloo's all-gather is a ring, ``W - 1`` hops: the projection also prices that case.

Deliberately simple: one alpha and one beta for every link, no contention, no stragglers,
no software overhead per call. It answers which terms grow with W and roughly when they
matter, not what a particular cluster measures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# kind -> how one call over W ranks is priced, with n the per-rank payload.
FORMULAS = {
    "all_gather": "ceil(log2 W)*a + (W-1)*n*b   (recursive doubling; ring: (W-1)*a + ...)",
    "gather": "ceil(log2 W)*a + (W-1)*n*b   (binomial tree into the coordinator)",
    "scatter": "ceil(log2 W)*a + (W-1)*n*b   (binomial tree out of the coordinator)",
    "broadcast": "ceil(log2 W)*(a + n*b)      (binomial tree)",
    "reduce": "ceil(log2 W)*(a + n*b)      (binomial tree)",
    "all_reduce": "2*ceil(log2 W)*(a + n*b)    (reduce up a tree, broadcast down)",
    "reduce_scatter": "ceil(log2 W)*a + n*b",
    "all_to_all": "(W-1)*a + n*b",
    "barrier": "2*ceil(log2 W)*a",
    "p2p": "a + n*b",
}


@dataclass(frozen=True)
class Network:
    """``alpha``: seconds per hop (a message's latency); ``beta``: seconds per byte."""

    alpha: float
    beta: float


def hops(world: int) -> int:
    return max(1, math.ceil(math.log2(max(world, 2))))


def cost(kind: str, world: int, n: float, net: Network, ring: bool = False) -> float:
    """Seconds of one collective of ``kind`` over ``world`` ranks, ``n`` bytes per rank
    (``ring``: all-gathers are rings, as gloo's are)."""
    a, b, h = net.alpha, net.beta, hops(world)
    if kind == "all_gather":
        return (world - 1 if ring else h) * a + (world - 1) * n * b
    if kind in ("gather", "scatter"):
        return h * a + (world - 1) * n * b
    if kind in ("broadcast", "reduce"):
        return h * (a + n * b)
    if kind == "all_reduce":
        return 2 * h * (a + n * b)
    if kind == "reduce_scatter":
        return h * a + n * b
    if kind == "all_to_all":
        return (world - 1) * a + n * b
    if kind == "barrier":
        return 2 * h * a
    return a + n * b  # point to point


@dataclass(frozen=True)
class Line:
    """``y = intercept + slope * W``, least squares through the measured points."""

    intercept: float
    slope: float

    def at(self, world: float) -> float:
        return self.intercept + self.slope * world

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> Line:
        if not points:
            return cls(0.0, 0.0)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return cls(my, 0.0)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return cls(my - slope * mx, slope)


def _project(points: Sequence[tuple[int, int]], world: int) -> float:
    """The fitted line at ``world`` when the measured values grow with W; otherwise the value
    at the largest measured W (a value that shrinks, as a rank's share of deduplicated
    items does, is not extrapolated to zero)."""
    line = Line.fit(points)
    if line.slope > 0:
        return max(0.0, line.at(world))
    return float(max(points)[1]) if points else 0.0


def grows(points: Sequence[tuple[float, float]], absolute: float, relative: float) -> bool:
    """Whether the value at the largest W exceeds the value at the smallest by more than
    ``absolute`` and by more than ``relative`` of it (pickled integers may gain a byte)."""
    if len(points) < 2:
        return False
    ordered = sorted(points)
    first, last = ordered[0][1], ordered[-1][1]
    return last - first > max(absolute, relative * abs(first))


@dataclass(frozen=True)
class Term:
    """One collective of the steady save, across the measured world sizes."""

    phase: str
    op: str
    kind: str
    group: str
    counts: tuple[tuple[int, int], ...]  # (W, calls per save)
    payloads: tuple[tuple[int, int], ...]  # (W, the largest rank's payload per call)

    def count(self, world: int) -> float:
        return _project(self.counts, world)

    def payload(self, world: int) -> float:
        return _project(self.payloads, world)

    def seconds(self, world: int, net: Network, ring: bool = False) -> float:
        return self.count(world) * cost(self.kind, world, self.payload(world), net, ring)

    def count_grows(self) -> bool:
        return grows(self.counts, 0.5, 0.0)

    def payload_grows(self) -> bool:
        return grows(self.payloads, 16.0, 0.05)
