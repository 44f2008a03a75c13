"""The streams a shard holds, and the only code that adds or removes one.

Rule: a stream is in ``held`` exactly while this shard may stream it.  It enters by ``adopt`` (after
a won claim), leaves by ``fence`` (lease lost or about to be: socket dropped, no write) or by ``release`` /
``forget`` (handed on: closed, flushed, released or pushed).  Every exit fences the socket, so no
socket outlives its record; every send checks the record (``may_write``), so no message is written
for a stream that left.

A record's tenure (``fleetd.tracing``) begins in ``_enter`` and ends in ``_leave``, the only two places
that change ``held``, so every way in and out is traced by construction; a shutdown out of time ends the
tenures of the records it leaves behind (``fence_remaining``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fleetd.aio import bounded, retrying
from fleetd.aws import Outcome
from fleetd.hints import HintStream
from fleetd.lease import ClaimResult, ConnItem
from fleetd.shard.context import Context
from fleetd.shard.freeing import finish_hints
from fleetd.shard.session import SessionKeeper, fence_deadline
from fleetd.sink import Cursor
from fleetd.tracing import NO_TENURE, Attr, Tenure
from fleetd.upstream import Connection, Connector
from fleetd.validation import validate_url

log = logging.getLogger(__name__)
# Fences of our own making: the lease could not be confirmed in time (the others are a lease known lost,
# or an item deleted).  A tenure records them as an event before it ends.
SELF_FENCES = frozenset({"self_fence", "send_deadline"})
# A stream changing hands waits this long for its upstream's echo of our CLOSE, then drops the socket: the
# echo takes milliseconds, and one stalled upstream must not hold back every other stream's hand-over.
QUIESCE_CLOSE_S = 0.25


@dataclass(slots=True)
class Held:
    """A connection this shard owns."""

    item: ConnItem
    epoch: int
    cursor: Cursor
    conn: Connection | None  # None: parked (its ws_url is invalid)
    deadline: float = 0.0  # item mode: monotonic time at which we must fence it
    releasing: bool = False
    restarting: bool = False  # its socket is being replaced (a new ws_url)
    checkpointed_at: float = 0.0  # monotonic time of our last checkpoint of it (or a random phase)
    tenure: Tenure = NO_TENURE  # its trace span (fleetd.tracing), from _enter to _leave

    def owner(self, session_id: str) -> str:
        """The lease owner our writes for it are conditioned on (the item's, or our session's)."""
        return self.item.lease_owner or session_id


class Holdings:
    """The held streams: claiming slots, adopt, fence, restart, release; the only writer of ``held``."""

    def __init__(self, ctx: Context, session: SessionKeeper, connect: Connector, capacity: int,
                 suspect_strays: Callable[[], None]) -> None:
        self.ctx = ctx
        self.session = session
        self.connect = connect
        self.capacity = capacity
        self.suspect_strays = suspect_strays  # an ownership write ended ambiguously: look for strays
        self._held: dict[str, Held] = {}
        self._claiming: set[str] = set()

    # ----- views -------------------------------------------------------------------------------------

    def __contains__(self, cid: object) -> bool:
        return cid in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, cid: str) -> Held | None:
        return self._held.get(cid)

    def ids(self) -> list[str]:
        return list(self._held)

    def entries(self) -> list[tuple[str, Held]]:
        """A snapshot: the records stay shared, the list does not change under the caller."""
        return list(self._held.items())

    def busy(self, cid: str) -> bool:
        """Held, or a claim of it is in flight."""
        return cid in self._held or cid in self._claiming

    def free_capacity(self) -> int:
        return self.capacity - len(self._held) - len(self._claiming)

    def connected(self) -> int:
        return sum(1 for h in self._held.values() if h.conn is not None and h.conn.connected)

    @contextmanager
    def claiming(self, cid: str) -> Iterator[None]:
        """A claim of ``cid`` in flight takes a slot of our capacity."""
        self._claiming.add(cid)
        try:
            yield
        finally:
            self._claiming.discard(cid)

    # ----- entering and leaving --------------------------------------------------------------------------

    def adopt(self, cid: str, result: ClaimResult, source: str = "reconcile", taken_from: str = "") -> None:
        """Start streaming a stream whose claim we won (an unreadable item is held parked).  ``source``:
        what the claim came from (reconcile, hint, handed); ``taken_from``: the dead session it was taken
        from, if any (both only for its trace)."""
        item = result.item
        unreadable = item is None
        if item is None:
            # Claimed but unreadable: hold it parked so it does not bounce around the fleet.
            self.ctx.stats.inc("bad_items_total", reason="unparseable")
            log.warning("claimed item is unreadable", extra={"connection_id": cid, "error": result.detail})
            item = ConnItem(cid, "", "STARTED", self.session.session_id, 0, 0, -1)
        cursor = self.ctx.sink.cursor(cid, item.lease_epoch, item.last_seq)  # -1: nothing written yet
        now = self.ctx.clock.monotonic()
        held = Held(item, item.lease_epoch, cursor, None, deadline=fence_deadline(self.ctx.cfg.lease, result.sent_at),
                    # A random phase: connections claimed together must not all reach their idle
                    # checkpoint in the same tick (a burst of one write per connection).
                    checkpointed_at=now - random.uniform(0, self.ctx.cfg.lease.checkpoint_idle_s))
        resume = resume_point(item)
        self._enter(cid, held, resume, source=source, **({"taken_from": taken_from} if taken_from else {}))
        # Parked (counted once, as unparseable: it has no URL to be bad) until a `ctl start` fixes it.
        held.conn = None if unreadable else self._connect(item, cursor, resume, held.tenure)

    def _enter(self, cid: str, held: Held, resume: int | None, **attrs: Attr) -> None:
        """The only way into ``held``: the record's tenure begins with it."""
        self._held[cid] = held
        held.tenure = self.ctx.tracer.tenure(cid, self.session.session_id, held.epoch, resume, **attrs)

    def _leave(self, cid: str, h: Held, reason: str, **attrs: Attr) -> None:
        """The only way out of ``held``: this record leaves (never a newer one of the same stream) and its
        tenure ends, with the last seq durable for it (what a release or hand-over wrote)."""
        if self._held.get(cid) is h:
            del self._held[cid]
        h.tenure.end(reason, last_seq=h.cursor.last_seq, **attrs)

    def _connect(self, item: ConnItem, cursor: Cursor, last_seq: int | None, tenure: Tenure) -> Connection | None:
        try:
            url = validate_url(item.ws_url, self.ctx.cfg.upstream)
        except ValueError as e:
            self.ctx.stats.inc("bad_items_total", reason="bad_url")
            log.warning("connection parked: bad ws_url", extra={"connection_id": item.connection_id,
                                                               "error": str(e)})
            return None
        conn = Connection(item.connection_id, url, cursor, last_seq, self.ctx.sink, self.ctx.cfg.upstream,
                          self.ctx.stats, self.ctx.clock, self.connect, tenure)
        if self.ctx.sink.pressured:
            # Born paused: the pressure callback pauses only the connections that exist when the sink
            # crosses its high watermark, and one claimed afterwards must not read on unchecked.
            conn.pause_reading()
        conn.start()
        return conn

    def fence(self, cid: str, reason: str) -> None:
        """Lease lost or about to expire: fence the stream now, no release."""
        h = self._held.get(cid)
        if h is None:
            return
        if h.conn is not None:
            h.conn.fence()
        else:
            self.ctx.sink.deactivate(h.cursor)
        if reason in SELF_FENCES:
            h.tenure.event("self_fence", reason=reason)
        self._leave(cid, h, "fenced", fence_reason=reason)
        self.ctx.stats.inc("lease_lost_total", reason=reason)
        log.info("connection fenced", extra={"connection_id": cid, "reason": reason})

    def fence_all(self, reason: str) -> None:
        """Every stream, each on its own: one whose fence fails does not keep the others open.  The
        first failure is raised once all were tried (the fence loop then ends the shard)."""
        failed: Exception | None = None
        for cid in list(self._held):
            try:
                self.fence(cid, reason)
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def forget(self, cid: str, h: Held, reason: str, **attrs: Attr) -> None:
        """A stream released or handed over (``reason``, for its tenure): drop this record of it (never a
        newer one)."""
        self._leave(cid, h, reason, **attrs)
        if h.conn is not None:
            h.conn.fence()  # already closed; a no-op unless a restart raced the release
        self.ctx.sink.deactivate(h.cursor)

    def fence_remaining(self) -> None:
        """Shutdown out of time: no socket stays open (the leases expire on their own)."""
        for h in self._held.values():
            if h.conn is not None:
                h.conn.fence()
            h.tenure.end("unreleased", last_seq=h.cursor.last_seq)

    async def restart(self, cid: str, h: Held, item: ConnItem) -> None:
        """The item's ws_url changed (e.g. a parked item was fixed): reconnect to the new URL.

        One socket per held stream: one restart at a time per stream, and after closing the old
        socket a new one opens only if the stream is still held, by the same record, and not being
        released (a fence, release or hand-over during the close means another owner may be next)."""
        if h.restarting:
            return  # an overlapping check (the sweep and a `ctl start` hint) is already at it
        h.restarting = True
        try:
            if h.conn is not None:
                await h.conn.close(timeout_s=1.0)
        finally:
            h.restarting = False
        if self._held.get(cid) is not h or h.releasing:
            return
        h.item = item
        last = h.conn.last_received if h.conn is not None else resume_point(item)
        h.tenure.event("restart")  # a new ws_url: same tenure, new socket
        h.conn = self._connect(item, h.cursor, last, h.tenure)  # same cursor: seqs keep increasing on it

    def _within_deadline(self, h: Held, now: float) -> bool:
        """The stream may still be streamed now: its session (or, in item mode, its own lease) is live."""
        if self.ctx.cfg.lease.lease_mode == "item":
            return now < h.deadline
        return self.session.state.live(now)

    # ----- what the sink asks ----------------------------------------------------------------------------

    def may_write(self, cur: Cursor) -> bool:
        """The sink may send this cursor's messages now: its stream is held through it, under a live
        session, within its fence deadline (checked at send time, whatever the fence loops did)."""
        h = self._held.get(cur.connection_id)
        if h is None or h.cursor is not cur:
            return False
        if not self.session.check_send():
            return False
        if self.ctx.cfg.lease.lease_mode == "item" and self.ctx.clock.monotonic() >= h.deadline:
            self.ctx.stats.inc("self_fence_total")
            self.fence(cur.connection_id, "send_deadline")
            return False
        return True

    def on_pressure(self, high: bool) -> None:
        self.ctx.stats.inc("sink_pressure_total", state="pause" if high else "resume")
        for h in self._held.values():
            if h.conn is not None:
                (h.conn.pause_reading if high else h.conn.resume_reading)()

    # ----- handing on ------------------------------------------------------------------------------------

    async def quiesce(self, entries: list[tuple[str, Held]]) -> float:
        """Stop these streams before they change hands: close their sockets, flush their messages
        (bounded by one phase); returns the deadline for the writes that hand them on."""
        for _, h in entries:
            h.releasing = True
        # A polite close waits for the upstream's echo; past its deadline (a pause, a slow shutdown) a stream
        # is fenced instead: its lease may be someone else's by now.
        now = self.ctx.clock.monotonic()
        for _, h in entries:
            if h.conn is not None and not self._within_deadline(h, now):
                h.conn.fence()
        await asyncio.gather(*(h.conn.close(QUIESCE_CLOSE_S) for _, h in entries if h.conn is not None))
        phase_s = min(5.0, self.ctx.cfg.runtime.shutdown_budget_s / 4)
        await self.ctx.sink.wait_durable(self.ctx.sink_ddb, [h.cursor for _, h in entries], timeout_s=phase_s)
        # Nothing more is written for them once the write that hands them on may be sent: what is not
        # durable now is after their final last_seq, and the next owner resumes from it.
        for _, h in entries:
            self.ctx.sink.deactivate(h.cursor)
        return self.ctx.clock.monotonic() + phase_s

    async def release(self, ids: list[str], hint: bool, reason: str = "released") -> None:
        """Close, flush and release these streams (``reason``, for their tenures: released, stopped,
        shutdown); with ``hint``, START hints for them, sent as the releases complete (peers claim while
        the rest is still being released).  A release is retried for one phase: given up, the item stays
        owned until our session ends."""
        entries = [(cid, h) for cid in ids if (h := self._held.get(cid)) is not None]
        until = await self.quiesce(entries)
        stream = HintStream(self.ctx.hints) if hint else None
        clock, leases, me = self.ctx.clock, self.ctx.leases, self.session.session_id

        async def release(entry: tuple[str, Held]) -> None:
            cid, h = entry
            outcome = await retrying(lambda: leases.release(cid, h.owner(me), h.epoch, h.cursor.last_seq),
                                     lambda o: o is Outcome.RETRYABLE, until, clock)
            self.forget(cid, h, reason, release_result=outcome.value)
            if outcome is Outcome.RETRYABLE:
                self.suspect_strays()  # it may still be ours: then we adopt it again, or free it if stopping
            self.ctx.stats.inc("lease_releases_total", result=outcome.value)
            if stream is not None and outcome is Outcome.WON:
                stream.add(cid)

        try:
            await bounded(entries, self.ctx.cfg.lease.claim_concurrency, release)
        except asyncio.CancelledError:  # out of shutdown budget: still hint what was released
            if stream is not None:
                await finish_hints(self.ctx, stream, 1.0)
            raise
        if stream is not None:
            await finish_hints(self.ctx, stream, self.ctx.cfg.aws.aws_timeout_s)


def resume_point(item: ConnItem) -> int | None:
    """The last seq to resume after (from_seq = it + 1).  An item with no ``last_seq`` whose first tenure
    this is connects without ``from_seq`` (SPEC §5); one already owned before (epoch > 1) may have had
    messages written before any checkpoint, so it asks for everything the upstream still has (-1:
    from_seq=0, which also keeps seq 0 of an upstream numbering from 0)."""
    if item.last_seq >= 0:
        return item.last_seq
    return None if item.lease_epoch <= 1 else -1
