"""One shard: one process, one uvloop event loop, up to ``max_connections_per_shard`` streams.

The shard owns a session lease (session mode) or its item leases (item mode), the
upstream connections it holds, the sink for their messages, and its share of the
fleet loops.  Every long-lived routine is a ``*_loop`` of the form ``while not
stopping``, all in one TaskGroup; shutdown is a sequence of timed phases
(STYLE.md items 4-7):

    stop taking work → close upstreams → flush the sink → release leases with their
    final ``last_seq`` → START hints → end the session → close the AWS clients.

Safety rule (SPEC §3): a connection is fenced — socket dropped, nothing more
written — before anyone else may claim it: at ``renewal sent + TTL − margin`` on
the monotonic clock if no renewal has succeeded since.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import random
import signal
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

import uvloop
from picows import ws_connect

from fleetd import exits, logs
from fleetd.aws import Clients, Outcome, classify, error_code, missing, open_clients
from fleetd.clock import Clock, SystemClock
from fleetd.config import Config
from fleetd.hints import Hints, HintStream
from fleetd.lease import STOPPED, ClaimResult, ConnItem, Fate, LeaseStore, SessionInfo
from fleetd.schema import SchemaError, verify_messages_table
from fleetd.sink import Cursor, Sink
from fleetd.stats import Stats
from fleetd.upstream import Connection, Connector
from fleetd.validation import validate_url

log = logging.getLogger("fleetd.shard")
Reporter = Callable[[dict[str, Any]], None]
_SELF_ADOPT_EVERY = 12  # reconcile rounds between scans for items we own but do not hold
HINT_BURST = 10  # messages in a full SQS receive: a peer is handing over many streams at once
# An item no claim can succeed on (its attributes do not fit the claim) is skipped this long, then tried
# again in case it was fixed.  Without the skip, every reconcile round spent claims on such items, and
# enough of them at the head of the index starved every good free item (fault suite, issue #7).
_UNCLAIMABLE_RETRY_S = 300.0
# Rebalancing compares our load with this many live sessions, picked at random: the read stays a few
# units however big the fleet is, and a sample of ten estimates the mean load well enough for a 10 % band.
REBALANCE_SAMPLE = 10
RECEIVE_POLL_S = 1.0  # a shard below its share looks this often for streams handed to it
# After a peer marks that it handed us streams, we look for them this long: `by_owner` may show them
# only after its lag, and a stream not found then waits for the periodic scan (12 reconcile rounds).
HANDED_WATCH_S = 10.0
POLL_GRACE_S = 1.0  # a hint poll still open when the shard has stopped may answer this long
ORPHAN_SEGMENTS = 16  # an orphan sweep reads one of this many segments of `by_owner`
ORPHAN_SWEEP_MAX = 5000  # keys one sweep reads at most (its cost bound)


@dataclass(frozen=True, slots=True)
class Environment:
    """What a shard takes from its process: AWS clients, sockets, signals, randomness.

    The defaults are the real ones; the deterministic simulation (``bench/sim``) passes
    simulated AWS clients, simulated upstream sockets and seeded ids, so it runs this
    module's code unchanged.
    """

    open_clients: Callable[[AsyncExitStack, Any], Awaitable[Clients]] = open_clients
    connect: Connector = ws_connect
    signals: bool = True  # install SIGTERM/SIGINT handlers (only on the main thread)
    nonce: Callable[[], str] = field(default=lambda: uuid.uuid4().hex[:12])


class BootError(Exception):
    """The shard cannot start (missing tables or queue, no credentials): exit BOOT_ERROR."""


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


@dataclass(slots=True)
class SessionState:
    """The shard's session.  ``generation`` changes whenever the session is opened or abandoned, and
    an answer is applied only under the generation it was sent in: an abandoned session is never
    used again, whatever answers for it arrive later (a renewal, a claim)."""

    session_id: str = ""
    deadline: float = 0.0  # monotonic fence deadline of the whole session
    generation: int = 0
    abandoned: bool = True  # no session open (before the first, or between abandon and replacement)
    previous: list[str] = field(default_factory=list)  # our own abandoned sessions, to adopt from
    handed_seen: int = 0  # the session's handed_count when we last looked for streams handed to us

    def live(self, now: float, generation: int | None = None) -> bool:
        """Open, not abandoned, within its deadline (and still ``generation``, if given)."""
        if generation is not None and generation != self.generation:
            return False
        return not self.abandoned and now < self.deadline

    def abandon(self) -> str:
        """Give the session up now: nothing sent under it is applied any more.  Returns its id."""
        self.abandoned = True
        self.deadline = 0.0
        self.generation += 1
        return self.session_id

    def open(self, session_id: str, deadline: float) -> None:
        if self.session_id:
            self.previous.append(self.session_id)
        self.session_id = session_id
        self.deadline = deadline
        self.abandoned = False
        self.generation += 1
        self.handed_seen = 0  # a new session item counts from zero


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True if ``event`` was set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
    except TimeoutError:
        return event.is_set()
    return True


async def _retrying(call: Callable[[], Awaitable[Outcome]], until: float, clock: Clock) -> Outcome:
    """``call()`` again, with jittered backoff, while it is RETRYABLE and ``until`` (monotonic) allows."""
    delay = 0.1
    while True:
        outcome = await call()
        if outcome is not Outcome.RETRYABLE or clock.monotonic() + delay >= until:
            return outcome
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 1.0)


async def _bounded(items: Iterable[Any], limit: int, fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(x: Any) -> Any:
        async with sem:
            return await fn(x)

    return list(await asyncio.gather(*(one(x) for x in items)))


class Shard:
    """A shard's state and loops (constructor is pure: no loop, client, socket or task)."""

    def __init__(self, cfg: Config, index: int = 0, clock: Clock | None = None,
                 reporter: Reporter | None = None, predecessor: str | None = None,
                 env: Environment | None = None) -> None:
        self.cfg = cfg
        self.env = env or Environment()
        self.index = index
        self.clock = clock or SystemClock(cfg.lease.clock_offset_ms)
        self.task_id = cfg.runtime.task_id or socket.gethostname()
        self.reporter = reporter
        self.predecessor = predecessor  # a crashed shard's session, handed over by the supervisor
        self.stats = Stats()
        self.held: dict[str, Held] = {}
        self.claiming: set[str] = set()
        self.unclaimable: dict[str, float] = {}  # connection id → monotonic time it may be tried again
        self.receiving_until = 0.0  # below our share until then: watch for streams handed to us
        self.handed_until = 0.0  # a peer marked it handed us streams: watch until then (a look never shortens it)
        self.orphan_segment = random.randrange(ORPHAN_SEGMENTS)  # the segment of `by_owner` swept last
        self.announced: set[str] = set()  # dead sessions named by DEAD_SESSION hints, taken over first
        self.tasks: set[asyncio.Task[None]] = set()  # see _spawn
        self.strays_check_at = 0.0  # monotonic: look for items we own but do not hold (0: not due)
        self.session = SessionState()
        self.capacity = cfg.runtime.max_connections_per_shard
        self.stopping: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.replacing = asyncio.Lock()
        self.adopting = asyncio.Lock()  # see _adopt_own_strays
        self.wake_reconcile: asyncio.Event | None = None
        self.expiry_wake: asyncio.TimerHandle | None = None  # when the next dying session is dead
        self.hints_done: asyncio.Event | None = None
        self.leases: LeaseStore
        self.sink: Sink
        self.hints: Hints
        self.ddb: Any = None
        self.sink_ddb: Any = None

    # ----- entry -------------------------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self.wake_reconcile = asyncio.Event()
        self.hints_done = asyncio.Event()
        self._install_signals()
        async with AsyncExitStack() as stack:
            clients = await self.env.open_clients(stack, self.cfg.aws)
            self.ddb = clients.dynamodb
            self.sink_ddb = clients.sink_dynamodb
            self.leases = LeaseStore(self.ddb, self.cfg.aws, self.cfg.lease, self.clock, self._count_request)
            self.sink = Sink(self.cfg, "", self.stats, self.clock, on_pressure=self._on_pressure,
                             may_write=self._lease_valid)
            self.hints = Hints(clients.sqs, self.cfg.aws.hints_queue, self.cfg.aws.hint_wait_s, self.stats)
            try:
                if not await self._boot():
                    return exits.OK  # asked to stop while still booting: nothing held, nothing to release
            except BootError as e:
                log.error("shard cannot boot", extra={"reason": str(e)})
                return exits.BOOT_ERROR
            log.info("shard started", extra={"capacity": self.capacity, "mode": self.cfg.lease.lease_mode})
            async with asyncio.TaskGroup() as tg:
                for loop in (self._heartbeat_loop, self._items_loop, self._fence_loop, self._reconcile_loop,
                             self._hints_loop, self._desired_loop, self._checkpoint_loop, self._report_loop,
                             self._orphan_loop,
                             *self._rebalance_loops()):
                    tg.create_task(loop(), name=loop.__name__)
                tg.create_task(self.sink.run(self.sink_ddb, self.stopping), name="sink")
                await self.stopping.wait()
                try:
                    await self._shutdown()
                finally:
                    self.hints_done.set()
        return exits.OK

    def _install_signals(self) -> None:
        if not self.env.signals or threading.current_thread() is not threading.main_thread():
            return  # an in-process test harness; it stops us with request_stop()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        assert self.stopping is not None
        if self.stopping.is_set():
            log.warning("second signal: exiting without graceful shutdown")
            os._exit(128 + sig)
        log.info("stopping", extra={"signal": signal.Signals(sig).name})
        self.stopping.set()

    def request_stop(self) -> None:
        """Thread-safe: begin the graceful shutdown."""
        if self.stopping is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)

    async def _boot(self) -> bool:
        """Fail fast on what a restart cannot fix, then open our first session.

        Only definitive errors (missing table or queue, no credentials, access denied) are
        boot errors, on which the supervisor halts the task.  Transient ones (throttling,
        5xx, timeouts, lost answers) are retried: halting for them turned a passing AWS
        hiccup at deploy time into an outage (fault suite, issue #7).  SQS carries only
        hints, so boot does not wait for an unreachable queue: the hints loop looks it up
        once it answers.  False if asked to stop before the first session was open.
        """
        for name in (self.cfg.aws.connections_table, self.cfg.aws.sessions_table, self.cfg.aws.messages_table):
            if not await self._boot_step(f"table {name}", functools.partial(self.ddb.describe_table, TableName=name)):
                return False
        try:
            await asyncio.wait_for(self.hints.resolve(), self.cfg.aws.aws_timeout_s)
        except Exception as e:
            if _definitive(e):
                raise BootError(_boot_reason(e, f"queue {self.cfg.aws.hints_queue}")) from None
            log.warning("hints queue unreachable at boot; running without hints until it answers",
                        extra={"error": f"{type(e).__name__}: {e}"})
        if not await self._boot_step("messages table", self._check_messages_table):
            return False
        if not await self._boot_step("session", self._create_first_session):
            return False
        if self.predecessor:
            self.session.previous.append(self.predecessor)
        return True

    async def _check_messages_table(self) -> None:
        """A messages table keyed otherwise would refuse every message: a boot error, not a stall."""
        try:
            await verify_messages_table(self.ddb, self.cfg.aws)
        except SchemaError as e:
            raise BootError(f"messages table: {e}") from None

    async def _create_first_session(self) -> None:
        outcome = await self._new_session()
        if outcome is Outcome.FATAL:
            raise BootError("could not create a session item")
        if outcome is not Outcome.WON:
            # RETRYABLE, or LOST: an SDK retry of a create whose answer was lost found our own item.
            # That session owns nothing and simply expires; the next attempt uses a fresh id.
            raise _Transient(f"session create {outcome.value}")

    async def _boot_step(self, what: str, step: Callable[[], Awaitable[Any]]) -> bool:
        """Run ``step`` until it succeeds, backing off on transient errors; False if stopping first."""
        assert self.stopping is not None
        delay = 0.5
        while True:
            try:
                await step()
                return True
            except BootError:
                raise
            except Exception as e:
                if _definitive(e):
                    raise BootError(_boot_reason(e, what)) from None
                log.warning("boot step failed, retrying", extra={"step": what, "error": f"{type(e).__name__}: {e}"})
            if await _wait(self.stopping, delay):
                return False
            delay = min(delay * 2, 5.0)

    # ----- sessions and renewal -----------------------------------------------------------------

    async def _new_session(self) -> Outcome:
        sid = f"{self.task_id}/{self.index}/{self.env.nonce()}"
        started = self.clock.monotonic()
        info = SessionInfo(sid, self.task_id, self.index, self.capacity, pid=os.getpid())
        outcome = await self.leases.create_session(info)
        if outcome is not Outcome.WON:
            return outcome
        self.session.open(sid, started + self.cfg.lease.lease_ttl_s - self.cfg.lease.safety_margin_s)
        self.sink.set_session(sid)
        logs.set_context(session=sid)
        log.info("session opened", extra={"session_id": sid})
        return Outcome.WON

    async def _heartbeat_loop(self) -> None:
        """Renew the session every ``heartbeat_s``; after a failure retry sooner (the fence loop guards safety)."""
        assert self.stopping is not None
        delay = self.cfg.lease.heartbeat_s
        while not await _wait(self.stopping, delay):
            ok = self.session.abandoned or await self._renew_session()  # abandoned: a replacement is under way
            delay = self.cfg.lease.heartbeat_s if ok else min(1.0, self.cfg.lease.heartbeat_s / 4)

    async def _items_loop(self) -> None:
        """Item mode: renew each held item ``heartbeat_s`` after its last renewal, each on its own clock.

        Neither in the session's heartbeat nor in rounds: a renewal the SDK retries (throttling, a
        lost answer) takes seconds, and waiting for the slowest of a round pushed every other item's
        renewal, and the session's, past their fence deadlines (fault suite, issue #7: dozens of
        item and whole-session self-fences a minute at 35 % lost answers).
        """
        assert self.stopping is not None
        if self.cfg.lease.lease_mode != "item":
            return
        lease = self.cfg.lease
        renewing: dict[str, asyncio.Task[None]] = {}
        sem = asyncio.Semaphore(lease.renew_concurrency)
        try:
            while not await _wait(self.stopping, min(0.25, lease.heartbeat_s / 4)):
                # Due: heartbeat_s after the start of its last successful renewal (or of its claim).
                due_at = lease.heartbeat_s - (lease.lease_ttl_s - lease.safety_margin_s)
                now = self.clock.monotonic()
                for cid, h in list(self.held.items()):
                    if cid not in renewing and not h.releasing and now >= h.deadline + due_at:
                        renewing[cid] = asyncio.get_running_loop().create_task(
                            self._renew_item(cid, h, sem, renewing))
        finally:
            for task in list(renewing.values()):
                task.cancel()
            await asyncio.gather(*renewing.values(), return_exceptions=True)

    async def _renew_item(self, cid: str, h: Held, sem: asyncio.Semaphore,
                          renewing: dict[str, asyncio.Task[None]]) -> None:
        try:
            async with sem:
                started = self.clock.monotonic()
                outcome = await self.leases.renew_item(cid, h.item.lease_owner or self.session.session_id, h.epoch)
        finally:
            renewing.pop(cid, None)  # due again at once if it failed: retried on the next tick
        self.stats.inc("lease_renewals_total", result=outcome.value)
        if outcome is Outcome.WON and self.clock.monotonic() < h.deadline:
            # Only a lease not yet at its deadline is extended: past it, the stream may already have
            # been fenced (by the fence loop or at a send), and a deadline is never revived.
            h.deadline = started + self.cfg.lease.lease_ttl_s - self.cfg.lease.safety_margin_s
        elif outcome is Outcome.LOST and self.held.get(cid) is h:
            self._lose(cid, "renewal_lost")

    async def _fence_loop(self) -> None:
        """Watchdog: fence whatever reaches its deadline, however long a renewal call hangs."""
        assert self.stopping is not None
        while not await _wait(self.stopping, self._until_next_check()):
            await self._enforce_deadlines()

    def _until_next_check(self) -> float:
        """At most 0.25 s; while the session is given up (deadline 0) a plain 0.25 s, not a spin."""
        if self.session.abandoned:
            return 0.25
        return min(0.25, self._next_deadline() - self.clock.monotonic())

    def _next_deadline(self) -> float:
        if self.cfg.lease.lease_mode == "session" or not self.held:
            return self.session.deadline
        return min(self.session.deadline, min(h.deadline for h in self.held.values()))

    async def _renew_session(self) -> bool:
        """One renewal.  Its deadline counts from before the send; its answer counts only for the
        generation it was sent in (after an abandon, a late WON must not revive the session)."""
        started = self.clock.monotonic()
        sid, generation = self.session.session_id, self.session.generation
        outcome, _, handed = await self.leases.renew_session(sid, held=len(self.held), draining=self._is_stopping())
        self.stats.inc("lease_renewals_total", result=outcome.value)
        if generation != self.session.generation:
            return False
        if handed > self.session.handed_seen:
            # A peer handed us streams while our own view of the fleet did not have us watching.
            self.session.handed_seen = handed
            self.handed_until = self.clock.monotonic() + HANDED_WATCH_S
        if outcome is Outcome.WON and self.clock.monotonic() < self.session.deadline:
            self.session.deadline = max(self.session.deadline,
                                        started + self.cfg.lease.lease_ttl_s - self.cfg.lease.safety_margin_s)
            return True
        if outcome is Outcome.WON:
            # Answered at or past the deadline: streams may already be fenced (at a send, or by the fence
            # loop), so the session is not revived; the fence loop replaces it.
            return False
        if outcome is Outcome.LOST:
            # Expired or declared dead (we were partitioned too long): it can never come back.
            log.warning("session lost", extra={"session_id": sid})
            await self._replace_session("session_lost")
        return False

    async def _enforce_deadlines(self) -> None:
        if self.session.abandoned:
            return  # a replacement is under way; nothing is held meanwhile
        now = self.clock.monotonic()
        if now >= self.session.deadline:
            if self.held:
                log.warning("self-fencing: session not renewed in time", extra={"held": len(self.held)})
                self.stats.inc("self_fence_total")
            await self._replace_session("self_fence")
            return
        if self.cfg.lease.lease_mode == "item":
            for cid in [cid for cid, h in self.held.items() if now >= h.deadline]:
                self.stats.inc("self_fence_total")
                self._lose(cid, "self_fence")

    def _fence_all(self, reason: str) -> None:
        for cid in list(self.held):
            self._lose(cid, reason)

    async def _replace_session(self, reason: str) -> None:
        """Abandon the current session and open a new one, retrying.

        The abandon is synchronous, before any await: every stream is fenced and the generation
        moves on, so no answer sent under the old session is applied from here on.  Then the
        tombstone (best effort: unwritten, the session expires and a peer writes it)."""
        old = self._abandon_now(reason)
        if old is not None:  # None: already being replaced (heartbeat vs. watchdog)
            await self._reopen(old)

    async def _reopen(self, old: str) -> None:
        """After an abandon: the tombstone, then a new session."""
        async with self.replacing:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.leases.expire_session(old), self.cfg.aws.aws_timeout_s)
            await self._open_replacement()

    def _abandon_now(self, reason: str) -> str | None:
        """Fence every stream and give the session up, synchronously; its id, or None if already given up."""
        if self.session.abandoned:
            return None
        self._fence_all(reason)
        return self.session.abandon()

    async def _open_replacement(self) -> None:
        assert self.stopping is not None
        delay = 0.5
        while not self.stopping.is_set():
            if await self._new_session() is Outcome.WON:
                assert self.wake_reconcile is not None
                self.wake_reconcile.set()  # reclaim what is still free, including our old items
                return
            if await _wait(self.stopping, delay):
                return
            delay = min(delay * 2, 5.0)

    def _lease_valid(self, cur: Cursor) -> bool:
        """The sink may send this cursor's messages now: its stream is held through it, under a live
        session, within its fence deadline (checked at send time, whatever the fence loop did)."""
        h = self.held.get(cur.connection_id)
        if h is None or h.cursor is not cur:
            return False
        now = self.clock.monotonic()
        if not self.session.live(now):
            old = self._abandon_now("send_deadline")  # past the deadline before the fence loop's tick
            if old is not None:
                self.stats.inc("self_fence_total")
                self._spawn(self._reopen(old))
            return False
        if self.cfg.lease.lease_mode == "item" and now >= h.deadline:
            self.stats.inc("self_fence_total")
            self._lose(cur.connection_id, "send_deadline")
            return False
        return True

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the shard keeps a reference to until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _forget(self, cid: str, h: Held) -> None:
        """A stream released or handed over: drop this record of it (never a newer one)."""
        if self.held.get(cid) is h:
            del self.held[cid]
        if h.conn is not None:
            h.conn.fence()  # already closed; a no-op unless a restart raced the release
        self.sink.deactivate(h.cursor)

    def _lose(self, cid: str, reason: str) -> None:
        """Lease lost or about to expire: fence the stream now, no release."""
        h = self.held.pop(cid, None)
        if h is None:
            return
        if h.conn is not None:
            h.conn.fence()
        else:
            self.sink.deactivate(h.cursor)
        self.stats.inc("lease_lost_total", reason=reason)
        log.info("connection fenced", extra={"connection_id": cid, "reason": reason})

    # ----- claiming ---------------------------------------------------------------------------------

    def free_capacity(self) -> int:
        return self.capacity - len(self.held) - len(self.claiming)

    async def claim(self, cid: str, dead_owner: str | None = None, source: str = "reconcile") -> Outcome | None:
        """Try to take one connection and start streaming it; None when it did not try (held, being
        claimed, skipped, no room, or no live session), LOST when the condition failed."""
        if (cid in self.held or cid in self.claiming or self._skipped(cid) or self.free_capacity() <= 0
                or not self._may_claim()):
            return None
        self.claiming.add(cid)
        generation, me = self.session.generation, self.session.session_id
        try:
            result = await self.leases.claim(cid, me, dead_owner)
        finally:
            self.claiming.discard(cid)
        self.stats.inc("lease_claims_total", result=result.outcome.value)
        if result.outcome is Outcome.RETRYABLE:
            self._suspect_strays()  # the claim may still land, owned by us and held by nobody
        if result.bad_item:
            self._mark_unclaimable(cid, result.detail)
        if result.outcome is Outcome.WON and not self._usable(result, generation):
            # Won too late to be used: the session was given up (or the shard is stopping) while the
            # claim was in flight, or its item lease is already past our fence deadline.  Give it
            # back at once, so that it is not left to an abandoned session.
            self.stats.inc("lease_claims_orphaned_total")
            await self._disown_late(cid, me, result)
            return Outcome.LOST
        if result.outcome is Outcome.WON:
            self.stats.inc(f"{source}_claims_total")  # reconcile, hint or handed
            self._adopt(cid, result)
        return result.outcome

    def _usable(self, result: ClaimResult, generation: int) -> bool:
        """A claim's win may be streamed: same live session generation, and (item mode) its lease,
        counted from the claim's send time, not yet at our fence deadline."""
        if not self._may_claim(generation):
            return False
        return self.cfg.lease.lease_mode != "item" or self.clock.monotonic() < self._item_deadline(result.sent_at)

    def _item_deadline(self, sent_at: float) -> float:
        """Item mode: the fence deadline of a lease written by a request first sent at ``sent_at``."""
        return sent_at + self.cfg.lease.lease_ttl_s - self.cfg.lease.safety_margin_s

    async def _disown_late(self, cid: str, me: str, result: ClaimResult) -> None:
        epoch = result.item.lease_epoch if result.item is not None else None
        try:
            await self._free([cid], me, epoch)
        except Exception as e:  # the orphan sweep or the dead session's takeover frees it later
            log.warning("could not give back a late claim", extra={"connection_id": cid, "error": repr(e)})

    def _suspect_strays(self) -> None:
        """An ownership write of ours ended ambiguously (it may land after every check): look for items
        we own but do not hold once it can no longer land, instead of at the periodic scan."""
        window = self.cfg.aws.aws_timeout_s * self.cfg.aws.aws_max_attempts
        self.strays_check_at = max(self.strays_check_at, self.clock.monotonic() + window)

    def _skipped(self, cid: str) -> bool:
        until = self.unclaimable.get(cid)
        return until is not None and self.clock.monotonic() < until

    def _mark_unclaimable(self, cid: str, detail: str) -> None:
        if cid not in self.unclaimable:
            self.stats.inc("bad_items_total", reason="unclaimable")
            log.warning("item cannot be claimed: its attributes do not fit the claim",
                        extra={"connection_id": cid, "error": detail})
        self.unclaimable[cid] = self.clock.monotonic() + _UNCLAIMABLE_RETRY_S

    def _is_stopping(self) -> bool:
        return self.stopping is None or self.stopping.is_set()

    def _may_claim(self, generation: int | None = None) -> bool:
        """Only a live session that is still the current one may take work."""
        return not self._is_stopping() and self.session.live(self.clock.monotonic(), generation)

    def _adopt(self, cid: str, result: ClaimResult) -> None:
        item = result.item
        unreadable = item is None
        if item is None:
            # Claimed but unreadable: hold it parked so it does not bounce around the fleet.
            self.stats.inc("bad_items_total", reason="unparseable")
            log.warning("claimed item is unreadable", extra={"connection_id": cid, "error": result.detail})
            item = ConnItem(cid, "", "STARTED", self.session.session_id, 0, 0, -1)
        cursor = self.sink.cursor(cid, item.lease_epoch, item.last_seq)  # -1: nothing written yet
        now = self.clock.monotonic()
        held = Held(item, item.lease_epoch, cursor, None, deadline=self._item_deadline(result.sent_at),
                    # A random phase: connections claimed together must not all reach their idle
                    # checkpoint in the same tick (a burst of one write per connection).
                    checkpointed_at=now - random.uniform(0, self.cfg.lease.checkpoint_idle_s))
        self.held[cid] = held
        # Parked (counted once, as unparseable: it has no URL to be bad) until a `ctl start` fixes it.
        held.conn = None if unreadable else self._connect(item, cursor, _resume_point(item))

    def _connect(self, item: ConnItem, cursor: Cursor, last_seq: int | None) -> Connection | None:
        try:
            url = validate_url(item.ws_url, self.cfg.upstream)
        except ValueError as e:
            self.stats.inc("bad_items_total", reason="bad_url")
            log.warning("connection parked: bad ws_url", extra={"connection_id": item.connection_id,
                                                               "error": str(e)})
            return None
        conn = Connection(item.connection_id, url, cursor, last_seq, self.sink, self.cfg.upstream,
                          self.stats, self.clock, self.env.connect)
        if self.sink.pressured:
            # Born paused: the pressure callback only paused the connections that existed when
            # the sink crossed its high watermark; a stream claimed afterwards read on unchecked
            # and the buffer grew without bound (bench throughput: 500k messages behind).
            conn.pause_reading()
        conn.start()
        return conn

    async def _reconcile_loop(self) -> None:
        assert self.stopping is not None and self.wake_reconcile is not None
        rounds = 0
        while not self.stopping.is_set():
            more = False
            try:
                more = await self._reconcile(rounds)
            except Exception as e:
                self.stats.inc("reconcile_errors_total")
                log.warning("reconcile failed", extra={"error": f"{type(e).__name__}: {e}"})
            rounds += 1
            if more:
                # Free items remain: the next step follows at once (its load-proportional delay
                # paces it), or 5,000 items would take 20 reconcile periods to claim.  The short
                # pause bounds the loop if a stale index keeps offering items others already hold.
                await _wait(self.stopping, 0.05)
                continue
            jitter = 1 + random.uniform(-1, 1) * self.cfg.lease.reconcile_jitter
            with suppress(TimeoutError):
                await asyncio.wait_for(self._either(self.stopping, self.wake_reconcile),
                                       self.cfg.lease.reconcile_s * jitter)
            self.wake_reconcile.clear()

    @staticmethod
    async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _reconcile(self, rounds: int) -> bool:
        """One round; True when free items remain that we could take.  Without a live session it
        reads nothing: the replacement wakes it (a round that cannot claim only loads the index)."""
        if not self._may_claim():
            return False
        for old in list(self.session.previous):
            if await self._take_over(old):
                self.session.previous.remove(old)
        while self.announced and self.free_capacity() > 0:
            await self._take_over(self.announced.pop())
        if self.free_capacity() <= 0:
            return False
        # An emptier shard claims first: delay proportional to load spreads connections evenly.
        assert self.stopping is not None
        load = len(self.held) / self.capacity
        if load > 0 and await _wait(self.stopping, load * min(1.0, self.cfg.lease.reconcile_s / 5)):
            return False
        if self.cfg.lease.lease_mode == "session":
            await self._take_over_dead()
        suspected = 0 < self.strays_check_at <= self.clock.monotonic()
        if suspected or rounds % _SELF_ADOPT_EVERY == _SELF_ADOPT_EVERY - 1:
            self.strays_check_at = 0.0
            await self._adopt_own_strays()
        return await self._claim_free()

    async def _take_over_dead(self) -> None:
        """Take over the dead sessions, and look again the moment the next dying one is dead for
        everyone.  A session that stopped renewing expires up to ``lease_ttl_s`` after it died;
        found only at the next reconcile, its streams also waited up to ``reconcile_s`` × 1.2
        more (bench task kill: p99 27.4 s, against 27)."""
        horizon_ms = int(self.cfg.lease.reconcile_s * (1 + self.cfg.lease.reconcile_jitter) * 1000)
        dead, dying_at_ms = await self.leases.dead_and_dying(horizon_ms)
        for sid in dead:
            if sid != self.session.session_id and self.free_capacity() > 0:
                await self._take_over(sid)
        if dying_at_ms is not None:
            self._wake_reconcile_at(dying_at_ms)

    def _wake_reconcile_at(self, at_ms: int) -> None:
        """One timer: the earliest wanted wins (a later one is re-armed by the round it wakes)."""
        assert self.loop is not None
        delay_s = max(0.0, (at_ms - self.clock.now_ms()) / 1000)
        when = self.loop.time() + delay_s
        pending = self.expiry_wake
        if pending is not None and not pending.cancelled() and self.loop.time() < pending.when() <= when:
            return
        if pending is not None:
            pending.cancel()
        wake = self.wake_reconcile
        self.expiry_wake = self.loop.call_at(when, lambda: wake.set() if wake is not None else None)

    async def _take_over(self, dead: str) -> bool:
        """Claim a dead session's items; forget it once it owns nothing.  True when done.

        Dead means a tombstone, written by us now (``fate``) if the session is expired without one:
        an expired session read from an index may have renewed since, and a renewal landing late
        may extend it, but never past a tombstone."""
        death = await self.leases.fate(dead)
        if death.fate is Fate.GONE:
            return True  # a peer already forgot it
        if death.fate is not Fate.DEAD:
            return False
        ids = [cid for cid in await self.leases.items_of(dead) if not self._skipped(cid)]
        random.shuffle(ids)
        ids = ids[: max(0, self.free_capacity())]
        outcomes = await _bounded(ids, self.cfg.lease.claim_concurrency, lambda cid: self.claim(cid, dead_owner=dead))
        # A claim loses on a STOPPED item, or one a peer took first: free those still the dead's.
        # Ask the index which those are: the successor and the woken peers race for a dead shard's
        # streams, and a free_stopped write for each of the many lost races loads the table for all.
        lost = [cid for cid, o in zip(ids, outcomes, strict=True) if o is Outcome.LOST]
        if lost:
            still = set(await self.leases.items_of(dead))
            lost = [cid for cid in lost if cid in still]
        freed = await _bounded(lost, self.cfg.lease.claim_concurrency,
                               lambda cid: self.leases.free_stopped(cid, dead))
        self.stats.inc("dead_session_stopped_freed_total", float(sum(o is Outcome.WON for o in freed)))
        if await self.leases.items_of(dead, limit=1) or not self.leases.past_grace(death.dead_at_ms):
            return False  # keep looking until no late claim of the dead session can land
        return await self.leases.delete_dead_session(dead) in (Outcome.WON, Outcome.LOST)  # LOST: a peer did

    async def _orphan_loop(self) -> None:
        """The backstop for items owned by a session nobody lists any more (see ``_sweep_orphans``)."""
        assert self.stopping is not None
        period = self.cfg.lease.orphan_sweep_s
        if period <= 0:
            return
        while not await _wait(self.stopping, period * random.uniform(0.5, 1.5)):
            if not self._may_claim():
                continue
            try:
                await self._sweep_orphans()
            except Exception as e:
                self.stats.inc("orphan_sweep_errors_total")
                log.warning("orphan sweep failed", extra={"error": f"{type(e).__name__}: {e}"})

    async def _sweep_orphans(self) -> None:
        """Read one random segment of ``by_owner`` and settle every owner that is not alive: a session
        that no longer exists streams nothing (it was forgotten only after its tombstone and grace,
        and claims are made only under a session that exists), so its items are freed and hinted; a
        dead one is taken over through the normal path.  Owners are judged by a consistent read."""
        me = self.session.session_id
        by_owner: dict[str, list[str]] = {}
        self.orphan_segment = (self.orphan_segment + 1) % ORPHAN_SEGMENTS  # the whole index every 16 sweeps
        for cid, owner in await self.leases.owned(self.orphan_segment, ORPHAN_SEGMENTS, ORPHAN_SWEEP_MAX):
            if owner != me:
                by_owner.setdefault(owner, []).append(cid)
        for owner, ids in by_owner.items():
            fate = (await self.leases.fate(owner)).fate
            if fate is Fate.DEAD and owner not in self.session.previous:
                self.announced.add(owner)
                self._wake()
            elif fate is Fate.GONE:
                await self._free_orphans(owner, ids)

    async def _free_orphans(self, owner: str, ids: list[str]) -> None:
        freed = await self._free(ids, owner)
        if freed:
            self.stats.inc("orphans_freed_total", float(len(freed)))
            log.warning("freed items of a session that no longer exists", extra={"owner": owner, "count": len(freed)})

    def _wake(self) -> None:
        if self.wake_reconcile is not None:
            self.wake_reconcile.set()

    async def _adopt_own_strays(self, source: str = "reconcile") -> None:
        """Items owned by our session that we do not hold: handed to us by a peer (rebalancing), or an
        ambiguous claim we reported as failed.  One scan at a time: this is the only path that claims
        an item we own, so an item it frees cannot be one a concurrent claim is adopting."""
        async with self.adopting:
            me = self.session.session_id
            strays = [cid for cid in await self.leases.items_of(me) if cid not in self.held]
            room = max(0, self.free_capacity())
            take, excess = strays[:room], strays[room:]
            outcomes = await _bounded(take, self.cfg.lease.claim_concurrency,
                                      lambda cid: self.claim(cid, dead_owner=me, source=source))
            # Stopped since it was handed to us: free it, or it stays ours and unstreamed for good.
            lost = [cid for cid, o in zip(take, outcomes, strict=True) if o is Outcome.LOST]
            await _bounded(lost, self.cfg.lease.claim_concurrency, lambda cid: self.leases.free_stopped(cid, me))
            # Only what is still neither held nor being claimed (a concurrent claim may have won one).
            excess = [cid for cid in excess if cid not in self.held and cid not in self.claiming]
            if excess and self._may_claim() and me == self.session.session_id:
                await self._give_back(excess, me)

    async def _give_back(self, ids: list[str], me: str) -> None:
        """Handed more than we have room for (a peer's view of our load was stale): free them, with hints."""
        freed = await self._free(ids, me)
        self.stats.inc("rebalance_given_back_total", float(len(freed)))

    async def _free(self, ids: list[str], owner: str, epoch: int | None = None) -> list[str]:
        """Make these items, owned by ``owner`` and streamed by nobody, free (conditioned on that owner, and
        on ``epoch`` if given), with START hints so a peer takes them in about a second; returns those freed."""
        outcomes = await _bounded(ids, self.cfg.lease.claim_concurrency,
                                  lambda cid: self.leases.disown(cid, owner, epoch=epoch))
        freed = [cid for cid, o in zip(ids, outcomes, strict=True) if o is Outcome.WON]
        if freed:
            stream = HintStream(self.hints)
            for cid in freed:
                stream.add(cid)
            await self._finish_hints(stream, self.cfg.aws.aws_timeout_s)
        return freed

    async def _claim_free(self) -> bool:
        """Claim one step of free items; True if there may be more (reconcile again soon).

        Claiming in steps, each after a delay proportional to our load, lets shards that
        start together split the free items instead of the first one taking them all.
        """
        want = min(self.free_capacity(), max(20, self.capacity // 20))
        if want <= 0:
            return False
        # Unclaimable items we skip may sort first in the index: look past them.
        candidates = await self.leases.free_items(limit=want * 2 + 10 + len(self.unclaimable))
        ids = [cid for cid in candidates if cid not in self.held and not self._skipped(cid)]
        random.shuffle(ids)  # peers scanning the same index should not all race for the same items
        outcomes = await _bounded(ids[:want], self.cfg.lease.claim_concurrency, self.claim)
        if any(o is None for o in outcomes):
            return False  # it stopped trying (full, stopping, or the session went): no quick next step
        return len(ids) > want or (len(ids) == want and all(o is Outcome.WON for o in outcomes))

    # ----- rebalancing -------------------------------------------------------------------------------

    def _rebalance_loops(self) -> tuple[Callable[[], Coroutine[Any, Any, None]], ...]:
        """Session mode only: an item-mode lease carries its own expiry, which a hand-over would have to renew."""
        if self.cfg.lease.lease_mode != "session" or self.cfg.lease.rebalance_s <= 0:
            return ()
        return self._rebalance_loop, self._receive_loop

    async def _rebalance_loop(self) -> None:
        """Every ``rebalance_s``, compare our load with a sample of live peers' and hand streams straight
        to the emptiest when we hold more than our share.  Without it a task started by a deploy or a
        scale-out stays empty while its peers run hot, and their next SIGTERM or crash hands over (and
        waits for) all those extra streams (bench failover: one task came to hold all 1,500)."""
        assert self.stopping is not None
        le = self.cfg.lease
        delay = random.uniform(0.5, min(5.0, le.rebalance_s))  # soon after boot: a new shard wants streams
        # A peer may hand us streams before our first look (we boot empty): watch until then.
        self.receiving_until = self.clock.monotonic() + delay + RECEIVE_POLL_S
        while not await _wait(self.stopping, delay):
            moved = False
            try:
                moved = await self._rebalance()
            except Exception as e:
                log.warning("rebalance failed", extra={"error": f"{type(e).__name__}: {e}"})
            delay = le.rebalance_s * (1 + random.uniform(-1, 1) * le.reconcile_jitter)
            if moved:
                delay = max(delay, self._settle_s())

    def _settle_s(self) -> float:
        """How long a session's recorded ``held`` may lag behind a burst of claims or adoptions: until
        it heartbeat twice after them.  A look before that sees the peer emptier than it is and hands
        it streams it then hands back (two shards booting together did so in CI)."""
        return 2 * self.cfg.lease.heartbeat_s + 2 * RECEIVE_POLL_S

    async def _rebalance(self) -> bool:
        """One look; True when streams were handed over."""
        le = self.cfg.lease
        me = self.session.session_id
        # A peer still booting has not recorded what it claimed yet: leave it out of the mean too.
        settled_before = self.clock.now_ms() - int(self._settle_s() * 1000)
        peers = [p for p in await self.leases.live_loads(REBALANCE_SAMPLE)
                 if p.session_id != me and not p.draining and p.capacity > 0 and p.started_at_ms <= settled_before]
        if not peers or not self._may_claim():
            self.receiving_until = 0.0
            return False
        share = (len(self.held) + sum(p.held for p in peers)) / (self.capacity + sum(p.capacity for p in peers))
        load = len(self.held) / self.capacity
        # Below the mean: peers may hand us streams until our next look (they target a wider margin).
        self.receiving_until = self.clock.monotonic() + 2 * le.rebalance_s if load < share else 0.0
        high, low = share * (1 + le.rebalance_tolerance), share * (1 - le.rebalance_tolerance)
        target = min(peers, key=lambda p: p.held / p.capacity)
        if load <= high or target.held / target.capacity >= low:
            return False
        # Every shard over the band may pick the same target in this round: split its room between them.
        over = 1 + sum(1 for p in peers if p.held / p.capacity > high)
        room = math.floor(share * target.capacity) - target.held
        n = min(len(self.held) - math.ceil(share * self.capacity), -(-room // over), le.rebalance_max_moves)
        if n <= 0:
            return False
        await self._hand_over(target.session_id, n)
        return True

    async def _hand_over(self, to: str, n: int) -> None:
        """Close ``n`` streams, flush them and make the live session ``to`` their owner, one write each
        (a release then a claim would be two, and whichever peer claimed first would get them, not the
        one with room).  ``to`` adopts them within ``RECEIVE_POLL_S``."""
        movable = [cid for cid, h in self.held.items() if not h.releasing and h.conn is not None]
        entries = [(cid, self.held[cid]) for cid in random.sample(movable, min(n, len(movable)))]
        until = await self._quiesce(entries)

        async def push(entry: tuple[str, Held]) -> bool:
            cid, h = entry
            outcome = await _retrying(lambda: self.leases.push(
                cid, h.item.lease_owner or self.session.session_id, h.epoch, h.cursor.last_seq, to), until, self.clock)
            self.stats.inc("rebalance_moves_total", result=outcome.value)
            if outcome is Outcome.WON:
                self._forget(cid, h)
            return outcome is Outcome.WON

        moved = await _bounded(entries, self.cfg.lease.claim_concurrency, push)
        if any(moved):
            # It watches for handed streams only while it sees itself below its share; its view of
            # the fleet may differ from ours.  Its next renewal takes this mark and it looks at once.
            with suppress(Exception):
                await self.leases.notify_handed(to)
        # Not moved, or not known to be: a conditional release and a hint are right whatever the push did.
        failed = [cid for (cid, _), ok in zip(entries, moved, strict=True) if not ok]
        if failed:
            await self._release_many(failed, hint=True)
        log.info("streams handed to a peer", extra={"to": to, "moved": len(entries) - len(failed),
                                                    "released": len(failed)})

    async def _receive_loop(self) -> None:
        """While below our share, adopt what peers handed us (``by_owner`` = our session) every second."""
        assert self.stopping is not None
        while not await _wait(self.stopping, RECEIVE_POLL_S):
            # Also when full: streams handed to us beyond our room are given back (a peer's view of our
            # load was stale), not left owned and unstreamed until the periodic scan.
            if self.clock.monotonic() < max(self.receiving_until, self.handed_until) and self._may_claim():
                try:
                    await self._adopt_own_strays(source="handed")
                except Exception as e:
                    log.warning("adopting handed streams failed", extra={"error": f"{type(e).__name__}: {e}"})

    # ----- hints -----------------------------------------------------------------------------------

    async def _hints_loop(self) -> None:
        """Long-poll START hints until the shutdown has sent its own hints.

        The poll in flight at ``stopping`` is not abandoned: a cancelled long poll may
        still be handed messages by SQS (they would then stay invisible to peers until
        their visibility timeout), so it runs on and gives back whatever it receives.
        """
        assert self.stopping is not None and self.hints_done is not None
        while not self.hints_done.is_set():
            if self.stopping.is_set():
                # No new polls once stopping: a poll would take our own final hints (or hints we
                # gave back) and, cancelled at exit, hide them from peers for the visibility timeout.
                await self.hints_done.wait()
                return
            if self.free_capacity() <= 0 and not self.stopping.is_set():
                await _wait(self.stopping, 1.0)  # full: leave hints for peers
                continue
            try:
                await self._handle_hints()
            except Exception as e:
                self.stats.inc("hints_total", kind="error")
                log.warning("hint poll failed", extra={"error": f"{type(e).__name__}: {e}"})
                await _wait(self.hints_done, 2.0)

    async def _handle_hints(self) -> None:
        assert self.hints_done is not None
        poll = asyncio.ensure_future(self.hints.receive(max(1, self.free_capacity())))
        done = asyncio.ensure_future(self.hints_done.wait())
        await asyncio.wait([poll, done], return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        if not poll.done():
            # Shut down.  Our own START hints went out moments ago and may have been handed to this
            # very poll: cancelled now, it would hide them from peers for VISIBILITY_S (a handover
            # of 0.1 s took 3.5 s).  Let it answer, and give back what it got, as we are stopping.
            await asyncio.wait([poll], timeout=POLL_GRACE_S)
            if not poll.done():
                poll.cancel()
                return
        hints = poll.result()
        taken: list[str] = []
        returned: list[str] = []
        ours: list[str] = []
        claims: list[str] = []
        leftover: list[str] = []
        for hint in hints:
            if hint.dead_session:
                # A supervisor buried a crashed shard whose successor is not booting now: its streams
                # are ours to take at once (the reconcile confirms the session is dead first).
                (returned if self._is_stopping() else taken).append(hint.receipt)
                if not self._is_stopping():
                    # Taken over by name at once (a consistent read decides), not through `by_expiry`,
                    # whose eventually consistent view may not list it yet.
                    log.info("dead session announced", extra={"dead_session": hint.dead_session})
                    self.announced.add(hint.dead_session)
                    self._wake()
                continue
            # `ctl start` of an item we hold (e.g. a new URL for a parked one): read it now
            # rather than at the next full sweep.
            ours += [cid for cid in hint.connection_ids if cid in self.held]
            rest = [cid for cid in hint.connection_ids if cid not in self.held]
            room = 0 if self._is_stopping() else self.free_capacity() - len(claims)
            if rest and room <= 0 and len(rest) == len(hint.connection_ids):
                returned.append(hint.receipt)  # nothing in it for us: visible to peers at once
                continue
            claims += rest[:max(0, room)]
            leftover += rest[max(0, room):]
            taken.append(hint.receipt)
        # Concurrently: a peer handing over 1,000 streams hints them a hundred at a time.
        await _bounded(claims, self.cfg.lease.claim_concurrency, lambda cid: self.claim(cid, source="hint"))
        if len(hints) >= HINT_BURST and self.wake_reconcile is not None:
            # A full receive means a burst (a peer released its streams): the reconcile's GSI
            # query picks up in bulk what the hints still queued name.
            self.wake_reconcile.set()
        if leftover:  # we took part of a message: the rest goes back to the queue for peers
            await self.hints.send_start(leftover)
        if taken:
            await self.hints.ack(taken)
        if returned:
            await self.hints.give_back(returned)
        if ours and not self._is_stopping():
            await self._check_desired(ours)

    # ----- desired state and checkpoints ------------------------------------------------------------

    async def _desired_loop(self) -> None:
        """Every ``desired_state_s`` a GSI query for STOPPED items still held (one read per shard);
        every ``desired_sweep_s`` a BatchGetItem of every held item.  The sweep alone, every 10 s,
        was a read unit per connection-minute more than everything else fleetd does (bench cost)."""
        assert self.stopping is not None
        last_sweep = self.clock.monotonic()
        while not await _wait(self.stopping, self.cfg.lease.desired_state_s):
            try:
                if self.clock.monotonic() - last_sweep >= self.cfg.lease.desired_sweep_s:
                    last_sweep = self.clock.monotonic()
                    await self._check_desired()
                else:
                    stopped = [cid for cid in await self.leases.stopped_held() if cid in self.held]
                    if stopped:
                        await self._check_desired(stopped)
            except Exception as e:
                log.warning("desired-state check failed", extra={"error": f"{type(e).__name__}: {e}"})

    async def _check_desired(self, ids: Iterable[str] | None = None) -> None:
        """Read the held items ``ids`` (default: all) on the base table and act on what changed."""
        wanted = set(self.held) if ids is None else set(ids)
        snapshot = {cid: h for cid, h in self.held.items() if not h.releasing and cid in wanted}
        states = await self.leases.desired_states(snapshot)
        to_release: list[str] = []
        for cid, item in states.items():
            h = snapshot[cid]
            if self.held.get(cid) is not h:
                continue  # changed while we were reading
            if item is None:
                self._lose(cid, "deleted")
            elif item.lease_epoch > h.epoch or (item.lease_epoch == h.epoch and item.lease_owner != h.item.lease_owner):
                self._lose(cid, "taken")
            elif item.lease_epoch < h.epoch:
                continue  # a stale (eventually consistent) read: nothing to conclude
            elif item.desired_state == STOPPED:
                to_release.append(cid)
            elif item.ws_url != h.item.ws_url:
                await self._restart(cid, h, item)
        if to_release:
            await self._release_many(to_release, hint=False)

    async def _restart(self, cid: str, h: Held, item: ConnItem) -> None:
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
        if self.held.get(cid) is not h or h.releasing:
            return
        h.item = item
        last = h.conn.last_received if h.conn is not None else _resume_point(item)
        h.conn = self._connect(item, h.cursor, last)  # same cursor: seqs keep increasing on it

    async def _quiesce(self, entries: list[tuple[str, Held]]) -> float:
        """Stop these streams before they change hands: close their sockets, flush their messages
        (bounded by one phase); returns the deadline for the writes that hand them on."""
        for _, h in entries:
            h.releasing = True
        await asyncio.gather(*(h.conn.close() for _, h in entries if h.conn is not None))
        phase_s = min(5.0, self.cfg.runtime.shutdown_budget_s / 4)
        await self.sink.wait_durable(self.sink_ddb, [h.cursor for _, h in entries], timeout_s=phase_s)
        # Nothing more is written for them once the write that hands them on may be sent: what is not
        # durable now is after their final last_seq, and the next owner resumes from it.
        for _, h in entries:
            self.sink.deactivate(h.cursor)
        return self.clock.monotonic() + phase_s

    async def _release_many(self, ids: list[str], hint: bool) -> None:
        """Close, flush and release these connections; optionally send START hints for them,
        each batch as soon as its releases are done (peers claim while the rest is released)."""
        entries = [(cid, self.held[cid]) for cid in ids if cid in self.held]
        # A release given up after a throttled call leaves the item owned until its lease (or our
        # session) expires: a TTL of outage instead of a hint's second.  Retry it for one phase.
        until = await self._quiesce(entries)
        stream = HintStream(self.hints) if hint else None

        async def release(entry: tuple[str, Held]) -> None:
            cid, h = entry
            outcome = await _retrying(lambda: self.leases.release(
                cid, h.item.lease_owner or self.session.session_id, h.epoch, h.cursor.last_seq), until, self.clock)
            self._forget(cid, h)
            if outcome is Outcome.RETRYABLE:
                self._suspect_strays()  # it may still be ours: then we adopt it again, or free it if stopping
            self.stats.inc("lease_releases_total", result=outcome.value)
            if stream is not None and outcome is Outcome.WON:
                stream.add(cid)

        try:
            await _bounded(entries, self.cfg.lease.claim_concurrency, release)
        except asyncio.CancelledError:  # out of shutdown budget: still hint what was released
            if stream is not None:
                await self._finish_hints(stream, 1.0)
            raise
        if stream is not None:
            await self._finish_hints(stream, self.cfg.aws.aws_timeout_s)

    async def _finish_hints(self, stream: HintStream, timeout_s: float) -> None:
        """Wait for the START hints, bounded like one AWS call: they only speed a handover up, and
        an unreachable SQS (whose client waits out a long-poll read timeout per attempt) would
        otherwise eat the whole shutdown budget.  Peers find unhinted items at their next reconcile."""
        unsent = await stream.close(timeout_s)
        if unsent:
            self.stats.inc("hints_total", float(unsent), kind="send_failed")
            log.warning("START hints not sent in time; peers will find the released items by reconcile",
                        extra={"count": unsent})

    async def _checkpoint_loop(self) -> None:
        assert self.stopping is not None
        while not await _wait(self.stopping, self.cfg.lease.checkpoint_s):
            await self.checkpoint_all()

    async def checkpoint_all(self) -> None:
        now = self.clock.monotonic()
        dirty = [(cid, h) for cid, h in self.held.items() if not h.releasing and self._checkpoint_due(h, now)]

        async def one(entry: tuple[str, Held]) -> None:
            cid, h = entry
            seq = h.cursor.last_seq
            outcome = await self.leases.checkpoint(cid, h.item.lease_owner or self.session.session_id, h.epoch, seq)
            if outcome is Outcome.WON:
                h.cursor.checkpointed_seq = seq
                h.checkpointed_at = now
            elif outcome is Outcome.LOST and self.held.get(cid) is h:
                self._lose(cid, "checkpoint_lost")

        await _bounded(dirty, self.cfg.lease.claim_concurrency, one)

    def _checkpoint_due(self, h: Held, now: float) -> bool:
        """Busy streams every ``checkpoint_s``, slow ones every ``checkpoint_idle_s``.

        A checkpoint only bounds the replay after a crash (the messages table dedupes
        by key), so a stream that advanced a few seqs gains little from one; for idle
        fleets the per-connection checkpoint writes were most of fleetd's DynamoDB
        calls and CPU (bench density: 2 of 3.3 calls per connection-minute).
        """
        advanced = h.cursor.last_seq - h.cursor.checkpointed_seq
        if advanced == 0:
            return False
        le = self.cfg.lease
        return advanced >= le.checkpoint_min_seqs or now - h.checkpointed_at >= le.checkpoint_idle_s

    # ----- metrics --------------------------------------------------------------------------------

    def _count_request(self, op: str, outcome: Outcome) -> None:
        self.stats.inc("dynamodb_requests_total", op=op, outcome=outcome.value)

    def _on_pressure(self, high: bool) -> None:
        self.stats.inc("sink_pressure_total", state="pause" if high else "resume")
        for h in self.held.values():
            if h.conn is not None:
                (h.conn.pause_reading if high else h.conn.resume_reading)()

    async def _report_loop(self) -> None:
        assert self.stopping is not None
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            before = loop.time()
            await _wait(self.stopping, 1.0)
            self.stats.set("event_loop_lag_seconds", max(0.0, loop.time() - before - 1.0))
            self.report()

    def report(self) -> None:
        connected = sum(1 for h in self.held.values() if h.conn is not None and h.conn.connected)
        self.stats.set("active_connections", len(self.held))
        self.stats.set("upstream_connected", connected)
        self.stats.set("sink_buffer_messages", self.sink.buffered)
        self.stats.set("session_live", 1.0 if self.clock.monotonic() < self.session.deadline else 0.0)
        if self.reporter is not None:
            snap = self.stats.snapshot()
            snap["session_id"] = self.session.session_id
            snap["held"] = len(self.held)
            self.reporter(snap)

    # ----- shutdown -------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        budget = self.cfg.runtime.shutdown_budget_s
        started = self.clock.monotonic()
        log.info("shutting down", extra={"held": len(self.held)})
        # Rebalancing peers must stop handing us streams; alongside the releases, it costs them no time.
        draining = asyncio.ensure_future(self._mark_draining())
        # Never hold a socket past our fence deadline, even while shutting down.
        limit = min(budget - 2.0, self._next_deadline() - started)
        try:
            await asyncio.wait_for(self._release_many(list(self.held), hint=True), max(0.5, limit))
        except TimeoutError:
            log.warning("shutdown budget exhausted; remaining leases expire on their own",
                        extra={"held": len(self.held)})
        for h in self.held.values():
            if h.conn is not None:
                h.conn.fence()
        await draining
        with suppress(Exception):  # best effort: otherwise peers take them over once our session ends
            await asyncio.wait_for(self._free_strays(), 2.0)
        sid = self.session.session_id
        with suppress(TimeoutError):  # expired now, peers take over what we could not release at once
            await asyncio.wait_for(_retrying(lambda: self.leases.expire_session(sid),
                                             self.clock.monotonic() + 1.5, self.clock), 1.5)
        self.report()
        log.info("shard stopped", extra={"seconds": round(self.clock.monotonic() - started, 3)})

    async def _free_strays(self) -> None:
        """Streams a peer handed us as we began to stop (it read our load before we were draining):
        free them now, with hints, rather than leave them to our session's expiry and the skew."""
        me = self.session.session_id
        strays = [cid for cid in await self.leases.items_of(me) if cid not in self.held]
        if strays:
            await self._give_back(strays, me)

    async def _mark_draining(self) -> None:
        with suppress(Exception):  # best effort: a peer that still hands us streams gets them back
            await asyncio.wait_for(self.leases.mark_draining(self.session.session_id), 1.0)


_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError"})


def _resume_point(item: ConnItem) -> int | None:
    """The last seq to resume after (from_seq = it + 1).  An item with no ``last_seq`` whose first tenure
    this is connects without ``from_seq`` (SPEC §5); one already owned before (epoch > 1) may have had
    messages written before any checkpoint, so it asks for everything the upstream still has (-1:
    from_seq=0, which also keeps seq 0 of an upstream numbering from 0)."""
    if item.last_seq >= 0:
        return item.last_seq
    return None if item.lease_epoch <= 1 else -1


class _Transient(Exception):
    """A boot step that failed in a way worth retrying (see ``Shard._boot_step``)."""


def _definitive(e: BaseException) -> bool:
    """An error a restart cannot fix (a boot error), as opposed to throttling, 5xx, timeouts."""
    return (missing(e) or type(e).__name__ in _NO_CREDENTIALS
            or classify(e) is Outcome.FATAL)


def _boot_reason(e: Exception, what: str) -> str:
    code = error_code(e)
    if missing(e):
        return f"{what} does not exist: run `fleetd init`"
    if type(e).__name__ in _NO_CREDENTIALS:
        return "no AWS credentials found"
    return f"{what}: {code or type(e).__name__}: {e}"


def main(cfg: Config, index: int = 0, reporter: Reporter | None = None, predecessor: str | None = None) -> int:
    """Run one shard in this process until SIGTERM/SIGINT; returns the exit code."""
    logs.setup(cfg.runtime.log_format, cfg.runtime.log_level)
    logs.set_context(shard=index)
    shard = Shard(cfg, index, reporter=reporter, predecessor=predecessor)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(shard.run())
