"""The shard's session lease and its keeper.

Safety rule (SPEC §3): nothing is streamed past ``renewal sent + TTL − margin`` (monotonic) unless a
later renewal succeeded before that deadline.  The keeper enforces it three ways: the fence loop
fences everything at the deadline however long a renewal hangs; a renewal's answer counts only
for the session generation it was sent in and only before the deadline; and a send checks the
deadline itself (``check_send``), whatever the fence loop did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetd import logs
from fleetd.aio import Backoff, Guard, retrying, wait
from fleetd.aws import Outcome
from fleetd.config import LeaseConfig
from fleetd.lease import SessionInfo
from fleetd.shard.context import Context
from fleetd.shard.tasks import Tasks

log = logging.getLogger(__name__)
# After a peer marks that it handed us streams, we look for them this long: `by_owner` may show them
# only after its lag, and a stream not found then waits for the periodic scan of our own items.
HANDED_WATCH_S = 10.0
# Renewals in flight at once: enough that three hung requests do not stop the heartbeat, few enough that a
# DynamoDB in trouble is not sent a growing pile of them.
RENEWALS_IN_FLIGHT = 4


def fence_deadline(lease: LeaseConfig, sent_at: float) -> float:
    """The monotonic time at which whatever a lease write first sent at ``sent_at`` justified must be fenced."""
    return sent_at + lease.lease_ttl_s - lease.safety_margin_s


@dataclass(frozen=True, slots=True)
class Identity:
    """Who opens sessions: the session id is ``task/index/nonce``."""

    task_id: str
    index: int
    capacity: int
    nonce: Callable[[], str]


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


@dataclass(frozen=True, slots=True)
class SessionHooks:
    """What the keeper tells the rest of the shard (it reads none of their state)."""

    fence_all: Callable[[str], None]  # the session is given up: fence every stream now
    held_count: Callable[[], int]  # recorded in each renewal, for peers' rebalancing
    opened: Callable[[str], None]  # a session is open under this id
    replaced: Callable[[], None]  # a replacement opened: reclaim what is still free
    handed: Callable[[float], None]  # a peer handed us streams: watch for them until this monotonic time


class SessionKeeper:
    """Owns the session: open, renew (heartbeat loop), fence at the deadline (fence loop), replace,
    end.  An abandon is synchronous — every stream fenced and the generation moved on before any
    await — so no answer sent under the old session is applied after it."""

    def __init__(self, ctx: Context, who: Identity, hooks: SessionHooks, tasks: Tasks) -> None:
        self.ctx = ctx
        self.who = who
        self.hooks = hooks
        self.tasks = tasks
        self.state = SessionState()
        self.replacing = asyncio.Lock()
        self._heartbeat_guard = Guard("heartbeat", ctx.count_error, log)
        # Set by the shutdown once it has handed on or closed every stream (``finish``): the heartbeat and
        # the fence loop run until then, not until ``stopping``, so that a shutdown (a long release, a
        # pause in the middle of one) still renews the session and fences at its deadline.
        self._finished = asyncio.Event()

    # ----- views ---------------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def deadline(self) -> float:
        return self.state.deadline

    def may_claim(self, generation: int | None = None) -> bool:
        """Only a live session that is still the current one (``generation``, if given) may take work."""
        return not self.ctx.is_stopping() and self.state.live(self.ctx.clock.monotonic(), generation)

    def previous(self) -> list[str]:
        """Our own earlier sessions whose items we still have to take over."""
        return list(self.state.previous)

    def forget_previous(self, session_id: str) -> None:
        if session_id in self.state.previous:
            self.state.previous.remove(session_id)

    def inherit(self, predecessor: str) -> None:
        """A crashed shard's session, handed over by the supervisor: taken over like our own."""
        self.state.previous.append(predecessor)

    # ----- opening ---------------------------------------------------------------------------------

    async def open(self) -> Outcome:
        sid = f"{self.who.task_id}/{self.who.index}/{self.who.nonce()}"
        started = self.ctx.clock.monotonic()
        info = SessionInfo(sid, self.who.task_id, self.who.index, self.who.capacity, pid=os.getpid())
        outcome = await self.ctx.leases.create_session(info)
        if outcome is not Outcome.WON:
            return outcome
        self.state.open(sid, fence_deadline(self.ctx.cfg.lease, started))
        self.hooks.opened(sid)
        logs.set_context(session=sid)
        log.info("session opened", extra={"session_id": sid})
        return Outcome.WON

    async def _open_replacement(self) -> None:
        backoff = Backoff(0.5, 5.0)
        while not self.ctx.is_stopping():
            if await self.open() is Outcome.WON:
                self.hooks.replaced()
                return
            if await wait(self.ctx.stopping, backoff.next()):
                return

    # ----- loops -----------------------------------------------------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeat_loop(), name="heartbeat")
            tg.create_task(self._fence_loop(), name="fence")

    async def _heartbeat_loop(self) -> None:
        """Renew every ``heartbeat_s`` counted from each send, so a slow answer does not stretch the
        period; a renewal still unanswered a third of a heartbeat after its send does not hold the next
        back (at most ``RENEWALS_IN_FLIGHT`` at once), so a hung request costs a third of a heartbeat,
        not a read timeout.  After a failure the next goes after a sixth of a heartbeat (renewals have no
        SDK retries: this loop is their retry policy).  Renewals may land out of order: the store never
        lets the expiry move back, and each answer extends the deadline from its own send.  Both this
        and the fence loop run until the shutdown is done with every stream (``finish``)."""
        pending: set[asyncio.Task[bool]] = set()
        delay = self.ctx.cfg.lease.heartbeat_s
        try:
            while not await wait(self._finished, delay):
                delay = await self._beat(pending)
        finally:
            for task in pending:
                task.cancel()

    async def _beat(self, pending: set[asyncio.Task[bool]]) -> float:
        """One heartbeat; returns the wait until the next."""
        beat = self.ctx.cfg.lease.heartbeat_s
        retry = min(1.0, beat / 6)  # ~10 tries left in a default fence window after a missed beat
        if self.state.abandoned:
            return beat  # a replacement is under way
        if len(pending) >= RENEWALS_IN_FLIGHT:
            return retry
        sent = self.ctx.clock.monotonic()
        task = asyncio.ensure_future(self._heartbeat_guard.run(self.renew, False))
        pending.add(task)
        task.add_done_callback(pending.discard)
        done, _ = await asyncio.wait({task}, timeout=beat / 3)
        if task not in done:
            # Unanswered a third of a heartbeat on, where an answer takes milliseconds: perhaps lost.  The
            # next goes now (it may still answer; each answer counts from its own send).
            return 0.0
        if not task.result():
            return retry
        return max(0.0, sent + beat - self.ctx.clock.monotonic())

    async def _fence_loop(self) -> None:
        """Watchdog: fence everything at the session's deadline, however long a renewal call hangs.
        Unguarded on purpose: a fence that fails ends the shard process (its sockets die with it)
        rather than leave a stream open past its deadline."""
        while not await wait(self._finished, self._until_next_check()):
            await self._enforce_deadline()

    def _until_next_check(self) -> float:
        """At most 0.25 s; while the session is given up (deadline 0) a plain 0.25 s, not a spin."""
        if self.state.abandoned:
            return 0.25
        return min(0.25, self.state.deadline - self.ctx.clock.monotonic())

    async def _enforce_deadline(self) -> None:
        if self.state.abandoned:
            return  # a replacement is under way; nothing is held meanwhile
        if self.ctx.clock.monotonic() >= self.state.deadline:
            held = self.hooks.held_count()
            if held:
                log.warning("self-fencing: session not renewed in time", extra={"held": held})
                self.ctx.stats.inc("self_fence_total")
            await self.replace("self_fence")

    async def renew(self) -> bool:
        """One renewal.  Its deadline counts from before the send; its answer counts only for the
        generation it was sent in (after an abandon, a late WON must not revive the session)."""
        clock = self.ctx.clock
        started = clock.monotonic()
        sid, generation = self.state.session_id, self.state.generation
        outcome, _, handed = await self.ctx.leases.renew_session(
            sid, held=self.hooks.held_count(), draining=self.ctx.is_stopping())
        self.ctx.stats.inc("lease_renewals_total", result=outcome.value)
        if generation != self.state.generation:
            return False
        if handed > self.state.handed_seen:
            # A peer handed us streams while our own view of the fleet did not have us watching.
            self.state.handed_seen = handed
            self.hooks.handed(clock.monotonic() + HANDED_WATCH_S)
        if outcome is Outcome.WON and clock.monotonic() < self.state.deadline:
            self.state.deadline = max(self.state.deadline, fence_deadline(self.ctx.cfg.lease, started))
            return True
        if outcome is Outcome.WON:
            # Answered at or past the deadline: streams may already be fenced (at a send, or by the fence
            # loop), so the session is not revived; the fence loop replaces it.
            return False
        if outcome is Outcome.LOST:
            # Expired or declared dead (we were partitioned too long): it can never come back.
            log.warning("session lost", extra={"session_id": sid})
            await self.replace("session_lost")
        return False

    # ----- giving up ---------------------------------------------------------------------------------

    async def replace(self, reason: str) -> None:
        """Abandon the current session and open a new one, retrying.  The tombstone in between is best
        effort: unwritten, the session expires and a peer writes it."""
        old = self.abandon_now(reason)
        if old is not None:  # None: already being replaced (heartbeat vs. watchdog)
            await self._reopen(old, reason)

    def abandon_now(self, reason: str) -> str | None:
        """Fence every stream and give the session up, synchronously; its id, or None if already given up."""
        if self.state.abandoned:
            return None
        old = self.state.abandon()  # first: from here every send is refused, whatever fencing does
        self.hooks.fence_all(reason)
        return old

    async def _reopen(self, old: str, reason: str) -> None:
        """After an abandon: the old session's tombstone (best effort), then a new session.  One trace
        span from the abandon's end to the new session (or the shard stopping)."""
        with self.ctx.tracer.span("session_replace", old_session=old, reason=reason) as span:
            async with self.replacing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ctx.leases.expire_session(old), self.ctx.cfg.aws.aws_timeout_s)
                await self._open_replacement()
            span.set(session_id="" if self.state.abandoned else self.state.session_id)

    def check_send(self) -> bool:
        """A send may go out under the session now.  Past the deadline before the fence loop's tick,
        the session is given up here (and replaced in the background)."""
        if self.state.live(self.ctx.clock.monotonic()):
            return True
        old = self.abandon_now("send_deadline")
        if old is not None:
            self.ctx.stats.inc("self_fence_total")
            self.tasks.spawn(self._reopen(old, "send_deadline"))
        return False

    # ----- shutdown ----------------------------------------------------------------------------------

    async def mark_draining(self) -> None:
        """Peers stop handing us streams (best effort: one that still does gets them back)."""
        await self.ctx.leases.mark_draining(self.state.session_id)

    def finish(self) -> None:
        """The shutdown holds no stream any more: the heartbeat and the fence loops end (idempotent)."""
        self._finished.set()

    @property
    def finished(self) -> asyncio.Event:
        """Set once the shutdown is done with every stream: the fence loops wait on it, not on ``stopping``."""
        return self._finished

    async def end(self) -> None:
        """Expire our session now: peers take over at once whatever we could not release.  Renewing ends
        first, so no renewal of ours meets the tombstone."""
        self.finish()
        sid = self.state.session_id
        clock = self.ctx.clock
        await retrying(lambda: self.ctx.leases.expire_session(sid), lambda o: o is Outcome.RETRYABLE,
                       clock.monotonic() + 1.5, clock)

    def live_gauge(self) -> float:
        return 1.0 if self.ctx.clock.monotonic() < self.state.deadline else 0.0
