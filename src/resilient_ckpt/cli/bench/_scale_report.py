"""The tables of :mod:`.restore_scale`: restores, the census per world size, the projection.

Input: one result per world size from :func:`.restore_scale.run_world` (every rank's
recorded collectives, restore times and byte counts; the proxies' request logs; the sizes
of the objects written). Output: printed tables, and the JSON document ``--json`` writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ._s3_nodes import describe_limit, storage_ops
from ._scale_model import FORMULAS, Line, Network, Term, grows
from .common import human, print_table

PROJECT_TO = (1024, 16384)
STORAGE_OPS = ("PUT", "GET", "HEAD", "LIST", "DELETE")


# -- restores ------------------------------------------------------------------------------------


def _checkpoint_bytes(run: dict[str, Any], state: str) -> int:
    prefix = f"{run['key']}/restore/{state.replace(' ', '_')}/"
    return sum(n for k, n in run["sizes"].items() if k.startswith(prefix) and k.endswith(".distcp"))


def restore_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    world = run["world"]
    rows = []
    for state, readers in run["ranks"][0]["restores"].items():
        stored = _checkpoint_bytes(run, state)
        torch_ref, ours = readers["torch reader"], readers["read-once"]
        row = {
            "world": world,
            "state": state,
            "checkpoint_bytes": stored,
            "torch_s": statistics.median(torch_ref["seconds"]),
            "read_once_s": statistics.median(ours["seconds"]),
            "torch_bytes": sum(torch_ref["bytes"]),
            "read_once_bytes": sum(ours["bytes"]),
        }
        row["speedup"] = row["torch_s"] / row["read_once_s"]
        row["torch_ratio"] = row["torch_bytes"] / stored
        row["read_once_ratio"] = row["read_once_bytes"] / stored
        rows.append(row)
    return rows


def _print_restores(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        target = f">= {0.6 * r['world']:.1f}" if r["state"] == "pure DP" else ""
        table.append(
            [
                r["world"],
                r["state"],
                human(r["checkpoint_bytes"]),
                f"{r['torch_s']:.3f}",
                f"{r['read_once_s']:.3f}",
                f"{r['speedup']:.2f}x",
                target,
                f"{r['torch_ratio']:.2f}",
                f"{r['read_once_ratio']:.2f}",
                "<= 1.1" if r["state"] == "pure DP" else "",
            ]
        )
    print_table(
        f"Restore: dcp.load into a blank state, job time in s, median of {args.repeats}; "
        "bytes read from storage / the checkpoint's data bytes",
        [
            "W",
            "state",
            "checkpoint",
            "torch reader s",
            "read-once s",
            "speed-up",
            "target",
            "torch bytes/ckpt",
            "read-once bytes/ckpt",
            "target",
        ],
        table,
    )


# -- the census of one world size ----------------------------------------------------------------


@dataclass
class Census:
    """One world size's steady save: its collectives by phase, with payloads per call."""

    world: int
    steady_saves: list[int]
    consistent: bool  # every steady save made the same calls
    calls: dict[str, list[dict[str, Any]]]  # phase -> calls with payload/received per rank
    polls: list[int]  # finalize calls per save that found the write still running
    storage: dict[str, float] = field(default_factory=dict)  # per steady save, all nodes
    storage_node0: dict[str, float] = field(default_factory=dict)  # the coordinator's node
    objects: float = 0.0  # objects a steady save leaves
    metadata_bytes: int = 0
    restores: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def coordinator_received(self) -> int:
        return sum(c["received"][0] for p in ("plan", "commit") for c in self.calls[p])

    def other_received(self) -> int:
        return max(
            (sum(c["received"][r] for p in ("plan", "commit") for c in self.calls[p]))
            for r in range(1, self.world)
        )

    def per_rank(self, phase: str) -> int:
        return len(self.calls[phase])


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One phase's calls on every rank, position by position: the payload and received
    bytes of each rank (ranks make the same calls in the same order)."""
    lengths = {len(calls) for calls in per_rank}
    if len(lengths) != 1:
        raise RuntimeError(f"ranks made different numbers of collectives: {sorted(lengths)}")
    merged = []
    for position in zip(*per_rank, strict=True):
        first = position[0]
        merged.append(
            {
                "op": first["op"],
                "kind": first["kind"],
                "group": first["group"],
                "payload": [c["payload"] for c in position],
                "received": [c["received"] for c in position],
            }
        )
    return merged


def _shape(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["op"], c["group"]) for c in calls]


def census_of(run: dict[str, Any], saves: int) -> Census:
    ranks = run["ranks"]
    world = run["world"]
    finalize_calls = ranks[0]["finalize_calls"]

    def phase(name: str) -> list[dict[str, Any]]:
        return _merge([r["calls"].get(name, []) for r in ranks])

    steady = list(range(2, saves + 1))
    per_save = []
    for n in steady:
        last = finalize_calls[n - 1]
        per_save.append((phase(f"save {n} plan"), phase(f"save {n} call {last}")))
    plan, commit = per_save[-1]
    consistent = all(_shape(p) == _shape(plan) and _shape(c) == _shape(commit) for p, c in per_save)
    poll: list[dict[str, Any]] = []
    for n in range(1, saves + 1):  # a poll's calls are the same in any save
        if finalize_calls[n - 1] > 1:
            poll = phase(f"save {n} call 1")
            break
    census = Census(
        world,
        steady,
        consistent,
        {"plan": plan, "commit": commit, "poll": poll},
        [k - 1 for k in finalize_calls],
    )
    _storage(census, run, steady, saves)
    for name in ranks[0]["calls"]:
        if name.startswith("restore "):
            census.restores[name[len("restore ") :]] = phase(name)
    return census


def _storage(census: Census, run: dict[str, Any], steady: list[int], saves: int) -> None:
    pattern = rf"^{run['key']}/census/save(\d+)(?:/|$)"
    for node, requests in enumerate(run["requests"]):
        ops = storage_ops(requests, pattern)
        for n in steady:
            for op, count in ops.get(str(n), Counter()).items():
                share = count / len(steady)
                census.storage[op] = census.storage.get(op, 0.0) + share
                if node == 0:
                    census.storage_node0[op] = census.storage_node0.get(op, 0.0) + share
    prefix = f"{run['key']}/census/save"
    census.objects = statistics.mean(
        sum(1 for k in run["sizes"] if k.startswith(f"{prefix}{n}/")) for n in steady
    )
    census.metadata_bytes = run["sizes"].get(f"{prefix}{saves}/.metadata", 0)


def _print_census(c: Census) -> None:
    rows = []
    for phase in ("plan", "poll", "commit"):
        for i, call in enumerate(c.calls[phase], 1):
            others = call["received"][1:] or [0]
            rows.append(
                [
                    phase,
                    i,
                    call["op"],
                    call["group"],
                    max(call["payload"]),
                    call["received"][0],
                    max(others),
                ]
            )
    print_table(
        f"W={c.world}: the collectives of one steady-state save (saves {c.steady_saves[0]}-"
        f"{c.steady_saves[-1]}, the same calls in each: {'yes' if c.consistent else 'NO'}); "
        "bytes per rank",
        ["phase", "#", "collective", "group", "payload (largest)", "rank 0 receives", "others"],
        rows or [["-", "", "none", "", "", "", ""]],
    )
    ops = ", ".join(f"{op} {c.storage.get(op, 0):.1f}" for op in STORAGE_OPS)
    extra = sorted(set(c.storage) - set(STORAGE_OPS))
    if extra:
        ops += ", " + ", ".join(f"{op} {c.storage[op]:.1f}" for op in extra)
    node0 = ", ".join(f"{op} {n:.1f}" for op, n in sorted(c.storage_node0.items()))
    print(
        f"per rank: plan {c.per_rank('plan')}, commit {c.per_rank('commit')}, each poll "
        f"{c.per_rank('poll')} collectives (polls per save here: {c.polls}); coordinator "
        f"receives {c.coordinator_received()} B per save, others at most {c.other_received()} B"
    )
    print(
        f"object operations per save (all nodes): {ops}; on the coordinator's node: {node0}; "
        f"objects per save {c.objects:.0f}, .metadata {c.metadata_bytes} B"
    )


def _print_restore_census(census: list[Census]) -> None:
    rows = []
    for c in census:
        for name, calls in c.restores.items():
            kinds = Counter(call["kind"] for call in calls)
            p2p = [call for call in calls if call["kind"] == "p2p"]
            small = [call for call in calls if call["kind"] != "p2p"]
            rows.append(
                [
                    c.world,
                    name,
                    len(calls),
                    " ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
                    max((max(call["payload"]) for call in small), default=0),
                    sum(call["received"][0] for call in small),
                    human(max(sum(x["payload"][r] for x in p2p) for r in range(c.world))),
                ]
            )
    print_table(
        "Restore census: collectives per rank of one dcp.load (pure DP and half sharded)",
        [
            "W",
            "state: reader",
            "collectives",
            "by kind",
            "largest payload (B)",
            "rank 0 receives (B)",
            "data sent by a rank (p2p)",
        ],
        rows,
    )


# -- the projection --------------------------------------------------------------------------------


def terms(census: list[Census], phases: tuple[str, ...]) -> list[Term]:
    """Each collective of ``phases`` across the world sizes (keyed by phase, op, group and
    occurrence, so that a call made more often at a larger W shows as a growing count)."""
    keys: dict[tuple[str, str, str, int], str] = {}
    found: dict[tuple[str, str, str, int], dict[int, int]] = {}
    for c in census:
        for phase in phases:
            seen: Counter[tuple[str, str]] = Counter()
            for call in c.calls[phase]:
                seen[(call["op"], call["group"])] += 1
                key = (phase, call["op"], call["group"], seen[(call["op"], call["group"])])
                keys[key] = call["kind"]
                found.setdefault(key, {})[c.world] = max(call["payload"])
    out = []
    for key, kind in keys.items():
        phase, op, group, _ = key
        payloads = found[key]
        counts = tuple((c.world, 1 if c.world in payloads else 0) for c in census)
        out.append(Term(phase, op, kind, group, counts, tuple(sorted(payloads.items()))))
    return out


def _seconds(ts: list[Term], world: int, net: Network, ring: bool) -> float:
    return sum(t.seconds(world, net, ring) for t in ts)


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3f} ms"


def _print_projection(census: list[Census], net: Network, storage_rate: float) -> dict[str, Any]:
    worlds = [c.world for c in census]
    save_terms = terms(census, ("plan", "commit"))
    poll_terms = terms(census, ("poll",))
    print(
        f"\nProjection of a steady save's coordination time: a = alpha = {net.alpha * 1e6:g} us "
        f"per hop, b = beta = 1/({1 / net.beta / 1e9:g} GB/s) per byte; n = the largest rank's "
        f"payload per call, fitted n(W) = n0 + k*W over the measured W = {worlds} (a payload "
        "that does not grow is held at its value at the largest W)"
    )
    for kind in sorted({t.kind for t in save_terms + poll_terms}):
        print(f"  {kind:<15} {FORMULAS[kind]}")
    rows = []
    for t in save_terms + poll_terms:
        line = Line.fit(t.payloads)
        rows.append(
            [
                "each poll" if t.phase == "poll" else t.phase,
                t.op,
                t.group,
                f"{line.intercept:.0f} + {line.slope:.1f}*W",
                *(_fmt_s(t.seconds(w, net)) for w in PROJECT_TO),
                "yes" if t.payload_grows() or t.count_grows() else "no",
            ]
        )
    for ring in (False, True):
        for name, ts in (("steady save (plan + commit)", save_terms), ("each poll", poll_terms)):
            total = [_fmt_s(_seconds(ts, w, net, ring)) for w in PROJECT_TO]
            rows.append([f"{name}{', ring all-gathers' if ring else ''}", "", "", "", *total, ""])
    points = [(c.world, c.metadata_bytes) for c in census]
    metadata = Line.fit(points)
    rows.append(
        [
            "storage",
            f".metadata upload at {storage_rate / 1e9:g} GB/s",
            "coordinator",
            f"{metadata.intercept:.0f} + {metadata.slope:.1f}*W",
            *(_fmt_s(max(0.0, metadata.at(w)) / storage_rate) for w in PROJECT_TO),
            "yes" if grows(points, 64, 0.05) else "no",
        ]
    )
    print_table(
        "Per steady save, projected (tree model; rows marked ring: gloo's all-gather is a ring)",
        ["phase", "collective", "group", "n (B)", *(f"W={w}" for w in PROJECT_TO), "grows"],
        rows,
    )
    return {
        "alpha_s": net.alpha,
        "beta_s_per_byte": net.beta,
        "storage_bytes_per_s": storage_rate,
        "save_seconds": {w: _seconds(save_terms, w, net, False) for w in PROJECT_TO},
        "save_seconds_ring": {w: _seconds(save_terms, w, net, True) for w in PROJECT_TO},
        "poll_seconds": {w: _seconds(poll_terms, w, net, False) for w in PROJECT_TO},
        "poll_seconds_ring": {w: _seconds(poll_terms, w, net, True) for w in PROJECT_TO},
        "metadata_bytes": {w: max(0.0, metadata.at(w)) for w in PROJECT_TO},
        "terms": [
            {
                "phase": t.phase,
                "op": t.op,
                "kind": t.kind,
                "group": t.group,
                "counts": t.counts,
                "payloads": t.payloads,
                "grows": t.payload_grows() or t.count_grows(),
            }
            for t in save_terms + poll_terms
        ],
    }


def _growth(census: list[Census], net: Network) -> list[str]:
    """Sentences saying what grows with W and what does not."""
    worlds = [c.world for c in census]
    lines = []
    ts = terms(census, ("plan", "commit", "poll"))
    counts = {c.world: sum(c.per_rank(p) for p in ("plan", "commit")) for c in census}
    if len(set(counts.values())) == 1:
        lines.append(f"collectives per rank per steady save: {counts[worlds[0]]} at every W")
    else:
        lines.append(f"collectives per rank per steady save GROW: {counts}")
    growing = [t for t in ts if t.payload_grows() or t.count_grows()]
    for t in growing:
        lines.append(
            f"GROWS: {t.phase} {t.op} ({t.group}): payload {dict(t.payloads)}, "
            f"count {dict(t.counts)}"
        )
    if not growing:
        lines.append("no collective's per-rank payload grows with W")
    received = Line.fit([(c.world, c.coordinator_received()) for c in census])
    lines.append(
        f"coordinator receives per save: {received.intercept:.0f} + {received.slope:.1f}*W bytes "
        "(all-gathers' outputs and the gather of write results: linear, a constant per rank)"
    )
    meta = Line.fit([(c.world, c.metadata_bytes) for c in census])
    lines.append(
        f".metadata per save: {meta.intercept:.0f} + {meta.slope:.1f}*W bytes (the coordinator "
        "writes every rank's chunks and storage locations)"
    )
    objects = Line.fit([(c.world, c.objects) for c in census])
    puts = Line.fit([(c.world, c.storage.get("PUT", 0)) for c in census])
    lines.append(
        f"objects written per save: {objects.intercept:.1f} + {objects.slope:.2f}*W "
        f"(PUT requests {puts.intercept:.1f} + {puts.slope:.2f}*W): each rank writes its own, "
        "the coordinator one more; on a parallel file system each is a create, and these "
        "metadata operations grow with W in total while staying constant per rank"
    )
    gathers = [t for t in ts if t.kind == "all_gather" and t.phase != "poll"]
    polls = [t for t in ts if t.kind == "all_gather" and t.phase == "poll"]
    big = PROJECT_TO[-1]
    lines.append(
        f"latency: with log-depth collectives a save's hops grow as log2(W); gloo's all-gather "
        f"is a ring of W-1 hops, so each of the {len(gathers)} all-gathers per save (and the "
        f"{len(polls)} per poll, each training step while a save is in flight) costs "
        f"(W-1)*alpha, {_fmt_s((big - 1) * net.alpha)} at W={big}"
    )
    lines.extend(_restore_growth(census))
    return lines


def _restore_growth(census: list[Census]) -> list[str]:
    """What a restore's collectives carry at the smallest and the largest W."""
    first, last = census[0], census[-1]
    lines = []
    for name in first.restores:
        if name not in last.restores:
            continue
        a, b = first.restores[name], last.restores[name]
        largest = [
            max((max(c["payload"]) for c in r if c["kind"] != "p2p"), default=0) for r in (a, b)
        ]
        received = [sum(c["received"][0] for c in r if c["kind"] != "p2p") for r in (a, b)]
        lines.append(
            f"restore ({name}): {len(a)} -> {len(b)} collectives per rank, largest payload "
            f"{largest[0]} -> {largest[1]} B, rank 0 receives {received[0]} -> {received[1]} B "
            f"(W = {first.world} -> {last.world}; the coordinator gathers every rank's load plan)"
        )
    return lines


# -- the whole report --------------------------------------------------------------------------


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rate = float(args.node_rate)
    print(
        f"\nrestore_scale: W = {', '.join(str(r['world']) for r in runs)}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs; launch seconds per W: "
        + ", ".join(f"{r['world']}: {r['seconds']:.0f}" for r in runs)
    )
    print(describe_limit(rate, args.per_node))
    print(
        "reference: dcp.load with torch's FileSystemReader over the object store "
        "(multi-storage-client's MultiStorageFileSystemReader: torch's reader with MSC's file "
        "system, one thread; torch itself ships no public object-store reader); read-once: "
        "CachedMetadataFileSystemReader (read_once on, metadata not cached)"
    )
    rows = [row for run in runs for row in restore_rows(run)]
    _print_restores(args, rows)
    census = [census_of(run, args.saves) for run in runs]
    for c in census:
        _print_census(c)
    _print_restore_census(census)
    net = Network(args.alpha_us * 1e-6, 1.0 / (args.link_gbs * 1e9))
    projection = _print_projection(census, net, args.storage_gbs * 1e9)
    growth = _growth(census, net)
    print(f"\nWhat grows with W (from the census, W = {[c.world for c in census]}):")
    for line in growth:
        print(f"  - {line}")
    return _document(args, runs, rows, census, projection, growth)


def _document(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    census: list[Census],
    projection: dict[str, Any],
    growth: list[str],
) -> dict[str, Any]:
    figures = [
        {
            "metric": "restore",
            "unit": "s",
            "case": f"W={r['world']}, {r['state']}",
            "label": "dcp.load, read-once",
            "value": r["read_once_s"],
            "reference": "dcp.load, torch reader",
            "reference_value": r["torch_s"],
            "target": f">= {0.6 * r['world']:.1f}x" if r["state"] == "pure DP" else "",
        }
        for r in rows
    ]
    return {
        "benchmark": "restore_scale",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "node_rate": float(args.node_rate),
        "per_node": args.per_node,
        "size": args.size,
        "repeats": args.repeats,
        "restore": rows,
        "census": [
            {
                "world": c.world,
                "consistent": c.consistent,
                "collectives_per_rank": {p: c.per_rank(p) for p in ("plan", "poll", "commit")},
                "calls": c.calls,
                "coordinator_received": c.coordinator_received(),
                "storage_per_save": dict(c.storage),
                "objects_per_save": c.objects,
                "metadata_bytes": c.metadata_bytes,
                "restores": c.restores,
            }
            for c in census
        ],
        "projection": projection,
        "growth": growth,
        "seconds_per_world": {r["world"]: r["seconds"] for r in runs},
        "figures": figures,
    }
