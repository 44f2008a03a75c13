"""The invariant checker (SPEC §6): what the messages table and the fake upstreams say.

It reads every message item (``connection_id``, ``seq``, ``session_id``,
``received_at_ms``) and, per connection, reports

* **missing** seqs: absent between 1 and the highest seq the upstream had produced
  (capped by what was written, so a stream still in flight is not "missing" its tail);
* **redelivered** frames: frames the upstream sent more than once (a replay after a
  resume from the checkpoint).  Each collapses onto its own (connection, seq) item,
  so the table holds no duplicates; the count says how much was written twice;
* **double streaming**: two sessions whose write windows overlap by more than
  ``margin_ms``, or an upstream stream that ever had two clients attached at once.
  A window is a *tenure*: runs of consecutive seqs last written by one session (first
  to last ``received_at_ms``), merged when less than ``margin_ms`` apart.  A stream
  handed from A to B and later back to A (rebalancing) is three tenures, one after the
  other; two sessions streaming at once leave the last writer of each seq alternating,
  in one tenure each that overlap.

Used by the integration tests, the fault suite and the bench's failover scenario.
``python -m bench.audit --messages-table T [--upstream URL ...]`` prints the report as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.procs import scan_all


@dataclass
class Audit:
    """What the messages table says about each connection."""

    seqs: dict[str, set[int]]
    # connection → run → (first, last) received_at_ms; a run is named by its session, "#2", "#3" …
    # appended when the session comes back to the stream (see ``windows``)
    writers: dict[str, dict[str, tuple[int, int]]]

    def missing(self, produced: Mapping[str, int] | None = None) -> dict[str, list[int]]:
        """Seqs absent between 1 and the last written (capped by ``produced``) one."""
        out: dict[str, list[int]] = {}
        for cid, got in self.seqs.items():
            if not got:
                continue
            top = max(got) if produced is None else min(produced.get(cid, max(got)), max(got))
            gaps = [s for s in range(1, top + 1) if s not in got]
            if gaps:
                out[cid] = gaps
        return out

    def overlaps(self, margin_ms: int) -> dict[str, list[tuple[str, str]]]:
        """Connections where two sessions wrote during overlapping windows (beyond ``margin_ms``)."""
        bad: dict[str, list[tuple[str, str]]] = {}
        for cid, runs in self.writers.items():
            spans = sorted(_tenures(runs, margin_ms), key=lambda t: t[1])
            for (s1, _, end1), (s2, start2, _) in itertools.pairwise(spans):
                if start2 < end1 - margin_ms:
                    bad.setdefault(cid, []).append((s1, s2))
        return bad

    @property
    def written(self) -> int:
        return sum(len(s) for s in self.seqs.values())


def audit(messages_table: str, ids: Iterable[str] | None = None) -> Audit:
    """Scan the messages table (only the attributes the checks need)."""
    wanted = set(ids) if ids is not None else None
    rows: dict[str, list[tuple[int, str, int]]] = {}
    projection = "connection_id, seq, session_id, received_at_ms"
    for item in scan_all(messages_table, ProjectionExpression=projection):
        cid = item["connection_id"]["S"]
        if wanted is not None and cid not in wanted:
            continue
        rows.setdefault(cid, []).append((int(item["seq"]["N"]), item["session_id"]["S"],
                                         int(item["received_at_ms"]["N"])))
    return Audit({cid: {seq for seq, _, _ in r} for cid, r in rows.items()},
                 {cid: windows(r) for cid, r in rows.items()})


def _tenures(runs: Mapping[str, tuple[int, int]], margin_ms: int) -> list[tuple[str, int, int]]:
    """Runs of one session less than ``margin_ms`` apart are one tenure: two sessions writing the same
    frames at once leave the last writer of each seq alternating in short runs, and their tenures
    then overlap; a session that got the stream back after a while starts a new tenure."""
    by_session: dict[str, list[tuple[int, int]]] = {}
    for key, window in runs.items():
        by_session.setdefault(key.split("#", 1)[0], []).append(window)
    out: list[tuple[str, int, int]] = []
    for sess, spans in by_session.items():
        spans.sort()
        first, last = spans[0]
        for start, end in spans[1:]:
            if start - last < margin_ms:
                last = max(last, end)
            else:
                out.append((sess, first, last))
                first, last = start, end
        out.append((sess, first, last))
    return out


def windows(rows: Iterable[tuple[int, str, int]]) -> dict[str, tuple[int, int]]:
    """(seq, session, received_at_ms) of one stream → its runs' write windows (see the module doc)."""
    out: dict[str, tuple[int, int]] = {}
    runs: dict[str, int] = {}
    key = ""
    previous: str | None = None
    for _, sess, at in sorted(rows):
        if sess != previous:
            runs[sess] = runs.get(sess, 0) + 1
            key = sess if runs[sess] == 1 else f"{sess}#{runs[sess]}"
            previous = sess
        first, last = out.get(key, (at, at))
        out[key] = (min(first, at), max(last, at))
    return out


@dataclass
class Verdict:
    """The invariants over a set of connections, with the offenders named."""

    connections: int = 0
    written: int = 0
    missing: dict[str, list[int]] = field(default_factory=dict)
    overlaps: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    concurrent: dict[str, int] = field(default_factory=dict)  # stream → max clients attached at once (> 1 only)
    redelivered: int = 0

    @property
    def missing_seqs(self) -> int:
        return sum(len(v) for v in self.missing.values())

    @property
    def double_streaming(self) -> int:
        return len(set(self.overlaps) | set(self.concurrent))

    @property
    def ok(self) -> bool:
        return not self.missing and not self.double_streaming

    def summary(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "written": self.written,
            "missing_seqs": self.missing_seqs,
            "double_streaming": self.double_streaming,
            "redelivered": self.redelivered,
            "examples": {
                "missing": {k: v[:5] for k, v in list(self.missing.items())[:3]},
                "overlaps": dict(list(self.overlaps.items())[:3]),
                "concurrent": dict(list(self.concurrent.items())[:3]),
            },
        }


def check(report: Audit, streams: Mapping[str, Mapping[str, Any]] | None, margin_ms: int) -> Verdict:
    """Judge ``report`` against the upstreams' per-stream stats (``produced``, ``sent``, ``max_concurrent``)."""
    streams = streams or {}
    produced = {sid: int(s["produced"]) for sid, s in streams.items()}
    v = Verdict(connections=len(report.seqs), written=report.written)
    v.missing = report.missing(produced if streams else None)
    v.overlaps = report.overlaps(margin_ms)
    v.concurrent = {sid: int(s["max_concurrent"]) for sid, s in streams.items() if int(s["max_concurrent"]) > 1}
    # sent counts every frame put on a socket; frames sent once each equal the highest seq delivered.
    v.redelivered = sum(max(0, int(s["sent"]) - max(report.seqs.get(sid, {0}) or {0})) for sid, s in streams.items())
    return v


def upstream_streams(controls: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Merge ``GET /stats`` of several fake upstreams' control endpoints."""
    merged: dict[str, dict[str, Any]] = {}
    for url in controls:
        with urllib.request.urlopen(url.rstrip("/") + "/stats", timeout=10) as resp:
            merged.update(orjson.loads(resp.read())["streams"])
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--messages-table", default="fleetd-messages")
    p.add_argument("--upstream", action="append", default=[], help="fake upstream control URL (repeatable)")
    p.add_argument("--margin-ms", type=int, default=2000)
    args = p.parse_args(argv)
    verdict = check(audit(args.messages_table), upstream_streams(args.upstream), args.margin_ms)
    sys.stdout.write(orjson.dumps(verdict.summary(), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
