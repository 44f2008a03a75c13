"""Invariants, checked on the simulation's true timeline.

Continuous checks
-----------------
``one_streamer_socket``
    At no instant two open upstream sockets for one connection among processes that
    are running (not paused, not crashed), nor two from one process (paused or not).
    "Instant" means: when virtual time is about to advance, i.e. after every loop has
    run what was due at that instant — running code takes no virtual time, so a
    socket a process opens and closes within one instant never coexists with another
    one over any interval.  A paused process's sockets count again from the instant
    it resumes: if it only drops them in the callbacks that run at that very instant
    (its overdue fence), that is not a violation; if it still holds them when time
    moves on, it is.
``stale_write``
    A BatchWriteItem to the messages table *sent* (checked at send time, against the
    connections table at that instant) with a message whose ``lease_epoch`` is below
    the item's current ``lease_epoch``, or whose ``session_id`` is not the item's
    ``lease_owner``: someone writes a stream after a peer may have claimed it.
    (Checkpoint, release and push are conditional on owner and epoch, so they cannot
    be applied by the wrong owner; they are not checked again here.)
``busy_loop``
    A process keeps scheduling work at one virtual instant (thousands of loop rounds): in
    real time, a spin that burns a CPU.  Virtual time is then charged as CPU time would be
    (see ``vloop.Scheduler._charge_spin``) so the run goes on.
``checkpoint_ahead``
    When a write that sets ``last_seq`` on a connection item is applied, every seq from
    the feed's first seq through that ``last_seq`` is already durable in the messages
    table (tracked from the BatchWriteItem requests applied, minus UnprocessedItems).

End checks (at ``end = faults_until + bound``)
---------------------------------------------
``bound = lease_ttl_s + safety_margin_s + 2 × reconcile_s × (1 + reconcile_jitter)
+ aws_timeout_s × aws_max_attempts + backoff_max_s + 3 s``: a session that stopped
renewing at the last fault expires within TTL + margin, a peer's reconcile finds it
within two rounds, the last faulty call finishes its SDK retries, and the upstream
reconnect backoff is bounded by ``backoff_max_s``.

``lost_seq``
    For every connection that stayed STARTED the whole run, every seq its feed
    produced up to ``end − TAIL_S`` is in the messages table (read from the table).
``not_streamed``
    Every STARTED connection has an open socket from a running shard at the end, or had
    one less than ``HANDOVER_S + aws_timeout_s`` ago (a rebalancing hand-over or an
    upstream reconnect in progress), as long as the running shards' capacity covers
    the STARTED connections (two sockets are ``one_streamer_socket``'s business).
``orphan``
    No connection item is owned by a session that does not exist or is dead (expired
    beyond the margin, or tombstoned) while no running shard has a socket for it.  An
    item whose own lease expired (item mode) is free whatever its ``lease_owner`` says.

``lost_seq``, ``not_streamed`` and ``orphan`` are only checked when the running shards'
capacity covers the STARTED connections (a fleet whose every task was killed recovers
nothing, by design).
``stopped_streaming``
    A connection STOPPED at ``t`` has no open socket after
    ``max(t, faults_until) + desired_state_s + 1 s + STOP_SLACK_S`` (GSI lag and the
    round trip of the stop read), until it is started again.

Not checked: message payload integrity, duplicates in the messages table (the key
collapses them), metrics.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.sim.net import Request

TAIL_S = 4.0
HANDOVER_S = 3.0
STOP_SLACK_S = 2.0
MAX_DETAILS = 20
MAX_PER_INVARIANT = 3  # details kept per invariant (the counts are complete)
_SETS_LAST_SEQ = re.compile(r"\blast_seq\s*=\s*(:\w+)")


@dataclass(frozen=True, slots=True)
class Violation:
    name: str
    t: float
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"invariant": self.name, "t": round(self.t, 3), "detail": self.detail}


class SockRec:
    """One upstream socket's life."""

    __slots__ = ("cid", "closed", "opened", "proc")

    def __init__(self, proc: str, cid: str, opened: float) -> None:
        self.proc = proc
        self.cid = cid
        self.opened = opened
        self.closed: float | None = None


@dataclass(slots=True)
class Timeline:
    """Desired-state changes of one connection, as applied to the table: (time, state)."""

    changes: list[tuple[float, str]] = field(default_factory=list)


class Checker:
    """Collects violations; the world feeds it sockets, process states and requests."""

    def __init__(self, now: Callable[[], float], dynamo: Any, conns_table: str, msgs_table: str,
                 first_seq: dict[str, int]) -> None:
        self.now = now
        self.dynamo = dynamo
        self.conns_table = conns_table
        self.msgs_table = msgs_table
        self.first_seq = first_seq
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = {}
        self.running: dict[str, bool] = {}
        self.open: dict[str, list[SockRec]] = {}
        self.socks: list[SockRec] = []
        self.dirty: set[str] = set()
        self.durable: dict[str, set[int]] = {}
        self.contiguous: dict[str, int] = {}  # highest seq with every seq from first durable
        self.timelines: dict[str, Timeline] = {}
        self._items: dict[str, dict[str, Any]] = {}
        self.spinners: set[str] = set()
        self.origin = 0.0  # printed times are relative to it
        self.trace: Callable[[str], None] | None = None

    def fail(self, name: str, detail: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.counts[name] <= MAX_PER_INVARIANT and len(self.violations) < MAX_DETAILS:
            self.violations.append(Violation(name, self.now(), detail))
        if self.trace:
            self.trace(f"INVARIANT BROKEN {name}: {detail}")

    # ----- sockets and processes ----------------------------------------------------------------------

    def opened(self, proc: str, cid: str) -> SockRec:
        rec = SockRec(proc, cid, self.now())
        self.socks.append(rec)
        self.open.setdefault(cid, []).append(rec)
        self.dirty.add(cid)
        return rec

    def closed(self, rec: SockRec) -> None:
        if rec.closed is None:
            rec.closed = self.now()
            self.open[rec.cid].remove(rec)
            if self.trace:
                self.trace(f"socket close {rec.proc} {rec.cid} (opened at {rec.opened - self.origin:.4f})")

    def set_running(self, proc: str, running: bool) -> None:
        self.running[proc] = running
        if running:
            self.dirty.update(r.cid for recs in self.open.values() for r in recs if r.proc == proc)

    def before_advance(self) -> None:
        """Virtual time is about to move: no two live sockets for one connection."""
        if not self.dirty:
            return
        for cid in sorted(self.dirty):
            recs = self.open.get(cid, [])
            live = [r.proc for r in recs if self.running.get(r.proc, False)]
            procs = [r.proc for r in recs]
            if len(live) > 1 or len(set(procs)) < len(procs):
                self.fail("one_streamer_socket", f"{cid}: open sockets from {sorted(procs)} "
                                                 f"(running: {sorted(live)})")
        self.dirty.clear()

    def spinning(self, procs: list[str]) -> None:
        """A busy loop: some process scheduled work at one instant thousands of times (CPU burnt)."""
        for proc in procs:
            if proc not in self.spinners:
                self.spinners.add(proc)
                self.fail("busy_loop", f"{proc} keeps running callbacks without time passing (a spin)")

    # ----- requests ------------------------------------------------------------------------------------

    def on_send(self, req: Request) -> None:
        if req.op == "BatchWriteItem" and req.service == "dynamodb":
            self._check_writer(req)

    def _check_writer(self, req: Request) -> None:
        by_cid: dict[str, tuple[int, str]] = {}
        for w in req.params.get("RequestItems", {}).get(self.msgs_table, []):
            item = w.get("PutRequest", {}).get("Item", {})
            cid = item["connection_id"]["S"]
            epoch = int(item["lease_epoch"]["N"])
            sid = item.get("session_id", {}).get("S", "")
            if cid not in by_cid or epoch < by_cid[cid][0]:
                by_cid[cid] = (epoch, sid)
        for cid, (epoch, sid) in by_cid.items():
            cur = self.item(cid)
            owner = cur.get("lease_owner", {}).get("S", "")
            cur_epoch = int(cur.get("lease_epoch", {}).get("N", "0"))
            if epoch < cur_epoch or sid != owner:
                self.fail("stale_write", f"{req.proc} #{req.rid} writes {cid} as {sid} epoch {epoch}; "
                                         f"the item is {owner or '(free)'} epoch {cur_epoch}")

    def item(self, cid: str) -> dict[str, Any]:
        """The connection item now (cached until a write to it is applied)."""
        got = self._items.get(cid)
        if got is None:
            resp = self.dynamo.handle("GetItem", {"TableName": self.conns_table, "ConsistentRead": True,
                                                  "Key": {"connection_id": {"S": cid}}})
            got = self._items[cid] = dict(resp.get("Item", {}))
        return got

    def on_apply(self, req: Request, resp: dict[str, Any] | Exception) -> None:
        if req.service != "dynamodb":
            return
        if req.params.get("TableName") == self.conns_table and "Key" in req.params:
            self._items.pop(req.params["Key"]["connection_id"]["S"], None)
        if isinstance(resp, Exception):
            return
        if req.op == "BatchWriteItem":
            self._durable(req.params, resp)
        elif req.op == "UpdateItem" and req.params.get("TableName") == self.conns_table:
            self._applied_update(req, req.params)

    def _durable(self, params: dict[str, Any], resp: dict[str, Any]) -> None:
        left = {(i["PutRequest"]["Item"]["connection_id"]["S"], i["PutRequest"]["Item"]["seq"]["N"])
                for i in resp.get("UnprocessedItems", {}).get(self.msgs_table, [])}
        for w in params.get("RequestItems", {}).get(self.msgs_table, []):
            item = w["PutRequest"]["Item"]
            key = (item["connection_id"]["S"], item["seq"]["N"])
            if key not in left:
                self.add_durable(key[0], int(key[1]))

    def add_durable(self, cid: str, seq: int) -> None:
        got = self.durable.setdefault(cid, set())
        got.add(seq)
        top = self.contiguous.get(cid, self.first_seq.get(cid, 0) - 1)
        while top + 1 in got:
            top += 1
        self.contiguous[cid] = top

    def _applied_update(self, req: Request, params: dict[str, Any]) -> None:
        cid = params["Key"]["connection_id"]["S"]
        values = params.get("ExpressionAttributeValues", {})
        if req.proc == "ctl":
            state = values.get(":started", values.get(":stopped", {})).get("S")
            if state:
                self.timelines.setdefault(cid, Timeline()).changes.append((self.now(), state))
            return
        m = _SETS_LAST_SEQ.search(params.get("UpdateExpression", ""))
        if m is None or m.group(1) not in values:
            return
        last = int(values[m.group(1)]["N"])
        first = self.first_seq.get(cid, 0)
        top = self.contiguous.get(cid, first - 1)
        if last > top:
            self.fail("checkpoint_ahead", f"{req.proc} #{req.rid} {req.op} sets {cid} last_seq={last}, "
                                          f"durable contiguously only through {top} (first seq {first})")

    # ----- end checks ------------------------------------------------------------------------------------

    def messages_of(self, cid: str) -> set[int]:
        """Seqs in the messages table for ``cid`` (a real Query, every page)."""
        seqs: set[int] = set()
        start: dict[str, Any] | None = None
        while True:
            params: dict[str, Any] = {"TableName": self.msgs_table, "KeyConditionExpression": "connection_id = :c",
                                      "ExpressionAttributeValues": {":c": {"S": cid}}, "ConsistentRead": True}
            if start:
                params["ExclusiveStartKey"] = start
            resp = self.dynamo.handle("Query", params)
            seqs.update(int(i["seq"]["N"]) for i in resp.get("Items", []))
            start = resp.get("LastEvaluatedKey")
            if not start:
                return seqs

    def scan(self, table: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        start: dict[str, Any] | None = None
        while True:
            params: dict[str, Any] = {"TableName": table}
            if start:
                params["ExclusiveStartKey"] = start
            resp = self.dynamo.handle("Scan", params)
            items += resp.get("Items", [])
            start = resp.get("LastEvaluatedKey")
            if not start:
                return items

    def check_lost(self, cid: str, first: int, last: int) -> None:
        got = self.messages_of(cid)
        missing = [s for s in range(first, last + 1) if s not in got]
        if missing:
            self.fail("lost_seq", f"{cid}: {len(missing)} of seqs {first}..{last} missing, first {missing[:5]}")

    def check_streamed(self, started: Iterable[str], shard_procs: set[str], end: float, grace_s: float) -> None:
        """Each STARTED connection is streamed by a running shard at the end, or was until less than
        ``grace_s`` ago (a rebalancing hand-over or an upstream reconnect in progress is not a gap)."""
        for cid in started:
            live = [r.proc for r in self.open.get(cid, []) if r.proc in shard_procs and self.running.get(r.proc)]
            if live:
                continue
            last = max((r.closed for r in self.socks if r.cid == cid and r.closed is not None), default=None)
            if last is None or last < end - grace_s:
                since = "never streamed" if last is None else f"no socket since {last - self.origin:.3f}"
                self.fail("not_streamed", f"{cid}: no open socket from a running shard at the end ({since})")

    def check_orphans(self, items: list[dict[str, Any]], sessions_table: str, now_ms: int, margin_ms: int) -> None:
        for it in items:
            owner = it.get("lease_owner", {}).get("S", "")
            cid = it["connection_id"]["S"]
            expires = int(it.get("lease_expires_at_ms", {}).get("N", "0"))
            if not owner or expires < now_ms - margin_ms or any(self.running.get(r.proc)
                                                               for r in self.open.get(cid, [])):
                continue  # free, an expired item lease (claimable by anyone), or streamed
            resp = self.dynamo.handle("GetItem", {"TableName": sessions_table, "ConsistentRead": True,
                                                  "Key": {"session_id": {"S": owner}}})
            sess = resp.get("Item")
            if sess is None:
                self.fail("orphan", f"{cid} is owned by {owner}, which does not exist")
            elif "dead_at_ms" in sess or int(sess.get("expires_at_ms", {}).get("N", "0")) < now_ms - margin_ms:
                self.fail("orphan", f"{cid} is owned by dead session {owner} and nobody streams it")

    def check_stopped(self, faults_until: float, bound_s: float, end: float) -> None:
        for cid, tl in sorted(self.timelines.items()):
            for i, (t, state) in enumerate(tl.changes):
                if state != "STOPPED":
                    continue
                until = tl.changes[i + 1][0] if i + 1 < len(tl.changes) else end
                deadline = max(t, faults_until) + bound_s
                for r in self.socks:
                    closed = r.closed if r.closed is not None else end
                    if r.cid == cid and r.opened < until and closed > deadline and deadline < until:
                        self.fail("stopped_streaming", f"{cid} stopped at {t:.3f}: {r.proc}'s socket "
                                                       f"still open after {deadline:.3f}")
                        break

