"""Finding work: free items, dead sessions' items, and our own items we do not hold.

Rules: GSI reads only nominate candidates, the conditional claim decides.  A session's items are
taken over only once it is dead by a tombstone (``LeaseStore.fate``: a consistent read, and the
tombstone written if due), and the session is forgotten only when it owns nothing and its grace —
which covers a late claim with all its SDK retries — has passed.  Past the grace, what the session
still owns and we have no room for is freed (a full fleet must not keep a dead session, or a STOPPED
item no claim takes, for good).  Without a live session the loop reads nothing: a round that cannot
claim only loads the index.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random

from fleetd.aio import Guard, bounded, wait, wait_any
from fleetd.aws import Outcome
from fleetd.lease import Fate
from fleetd.shard.claims import Claimer
from fleetd.shard.context import Context
from fleetd.shard.freeing import disown
from fleetd.shard.holdings import Holdings
from fleetd.shard.session import SessionKeeper
from fleetd.shard.share import fair_share, mine_first
from fleetd.tracing import Span

log = logging.getLogger(__name__)
STRAYS_EVERY = 12  # reconcile rounds between scans for items we own but do not hold
# A shard's first claims wait this long after boot, so that shards started together (a deploy, a fleet
# restart) see each other before they split the backlog: one that claimed alone first would take a
# share it then has to hand over.
BOOT_GATHER_S = 0.5
# The free index is read up to this many times our room: a backlog that large fills every one of up
# to this many sessions, so each may take its whole room at once.
LOOKAHEAD = 8
SESSIONS_FRESH_S = 1.0  # the list of sessions sharing a backlog is reused this long (one read for many takeovers)
SHARE_LOADS_MAX = 10  # up to this many sessions, their loads are read: full and draining ones take no share


class Reconciler:
    """The reconcile loop: takeovers, own strays, and claiming free items in steps."""

    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings, claimer: Claimer) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings
        self.claimer = claimer
        self._wake = asyncio.Event()
        self._expiry_wake: asyncio.TimerHandle | None = None  # when the next dying session is dead
        self._announced: set[str] = set()  # dead sessions named to us (hint, sweep), taken over first
        self._strays_check_at = 0.0  # monotonic: look for items we own but do not hold (0: not due)
        self._adopting = asyncio.Lock()
        self._guard = Guard("reconcile", ctx.count_error, log)
        self._gather_until = 0.0  # monotonic: no claims of the backlog before (set when the loop starts)
        self._takers: tuple[float, list[str]] = (-SESSIONS_FRESH_S, [])  # (read at, sessions sharing a backlog)
        self._dead_left = False  # this round's shared takeovers left items for a quick next step

    # ----- what others tell us -----------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def announce(self, dead_session: str) -> None:
        """A session named dead (a DEAD_SESSION hint, the orphan sweep): take it over by name at once,
        decided by a consistent read, not through ``by_expiry``, whose view may not list it yet."""
        self._announced.add(dead_session)
        self._wake.set()

    def suspect_strays(self) -> None:
        """An ownership write of ours ended ambiguously (it may land after every check): look for items
        we own but do not hold once it can no longer land, instead of at the periodic scan."""
        aws = self.ctx.cfg.aws
        window = aws.aws_timeout_s * aws.aws_max_attempts
        self._strays_check_at = max(self._strays_check_at, self.ctx.clock.monotonic() + window)

    def _wake_at(self, at_ms: int) -> None:
        """One timer: the earliest wanted wins (a later one is re-armed by the round it wakes)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, (at_ms - self.ctx.clock.now_ms()) / 1000)
        pending = self._expiry_wake
        if pending is not None and not pending.cancelled() and loop.time() < pending.when() <= when:
            return
        if pending is not None:
            pending.cancel()
        self._expiry_wake = loop.call_at(when, self._wake.set)

    # ----- the loop ------------------------------------------------------------------------------------

    async def run(self) -> None:
        lease = self.ctx.cfg.lease
        self._gather_until = self.ctx.clock.monotonic() + BOOT_GATHER_S
        rounds = 0
        while not self.ctx.is_stopping():
            more = await self._guard.run(functools.partial(self._round, rounds), False)
            rounds += 1
            if more:
                # Free items remain: the next step follows at once (its load-proportional delay paces
                # it); the short pause bounds the loop if a stale index keeps offering held items.
                await wait(self.ctx.stopping, 0.05)
                continue
            jitter = 1 + random.uniform(-1, 1) * lease.reconcile_jitter
            await wait_any(self.ctx.stopping, self._wake, timeout_s=lease.reconcile_s * jitter)
            self._wake.clear()

    async def _round(self, rounds: int) -> bool:
        """One round; True when free items remain that we could take.  Traced only when it moved
        something (a quiet span: most rounds find nothing to do)."""
        with self.ctx.tracer.span("reconcile_round", quiet=True, held=len(self.holdings)) as span:
            more = await self._steps(rounds)
            span.set(held_after=len(self.holdings), more=more)
            return more

    async def _steps(self, rounds: int) -> bool:
        if not self.session.may_claim():
            return False
        for old in self.session.previous():
            if await self.take_over(old):
                self.session.forget_previous(old)
        while self._announced and self.holdings.free_capacity() > 0:
            await self.take_over(self._announced.pop())
        if self.holdings.free_capacity() <= 0:
            # Full, we claim nothing, but dead sessions must still end: what no shard has room for
            # is freed past their grace (see take_over).  A slow look: it only bounds how long.
            if self.ctx.cfg.lease.lease_mode == "session" and rounds % STRAYS_EVERY == STRAYS_EVERY - 1:
                await self._take_over_dead()
            return False
        # An emptier shard claims first: a delay proportional to load spreads streams evenly.
        load = len(self.holdings) / self.holdings.capacity
        if load > 0 and await wait(self.ctx.stopping, load * min(1.0, self.ctx.cfg.lease.reconcile_s / 5)):
            return False
        gather_s = self._gather_until - self.ctx.clock.monotonic()
        if gather_s > 0 and await wait(self.ctx.stopping, gather_s):
            return False
        self._dead_left = False
        if self.ctx.cfg.lease.lease_mode == "session":
            await self._take_over_dead()
        suspected = 0 < self._strays_check_at <= self.ctx.clock.monotonic()
        if suspected or rounds % STRAYS_EVERY == STRAYS_EVERY - 1:
            self._strays_check_at = 0.0
            await self.adopt_own_strays()
        return await self._claim_free() or self._dead_left

    # ----- dead sessions -------------------------------------------------------------------------------

    async def _take_over_dead(self) -> None:
        """Take over the dead sessions, and look again the moment the next dying one is dead for
        everyone (found only at the next round, its streams would wait up to a reconcile period more)."""
        lease = self.ctx.cfg.lease
        horizon_ms = int(lease.reconcile_s * (1 + lease.reconcile_jitter) * 1000)
        dead, dying_at_ms = await self.ctx.leases.dead_and_dying(horizon_ms)
        for sid in dead:
            if sid != self.session.session_id:
                await self.take_over(sid, shared=True)  # full, it only frees what nobody placed
        if dying_at_ms is not None:
            self._wake_at(dying_at_ms)

    async def take_over(self, dead: str, shared: bool = False) -> bool:
        """Claim a dead session's items (``shared``: our share of them, our partition first; else all
        we have room for, as for our own earlier session); forget it once it owns nothing.  True when done.

        Dead means a tombstone, written by us now (``fate``) if the session is expired without one:
        an expired session read from an index may have renewed since, and a renewal landing late
        may extend it, but never past a tombstone."""
        with self.ctx.tracer.span("takeover", quiet=True, dead_session=dead, shared=shared) as span:
            return await self._take_over(dead, shared, span)

    async def _take_over(self, dead: str, shared: bool, span: Span) -> bool:
        """``take_over``; ``span`` records what it did (kept when it claimed, freed or forgot anything)."""
        leases = self.ctx.leases
        death = await leases.fate(dead)
        if death.fate is Fate.GONE:
            return True  # a peer already forgot it
        if death.fate is not Fate.DEAD:
            return False
        owned = await leases.items_of(dead)
        ids = [cid for cid in owned if not self.claimer.skipped(cid)]
        await self._disown_unclaimable(dead, [cid for cid in owned if self.claimer.skipped(cid)])
        random.shuffle(ids)
        backlog = len(ids)
        room = max(0, self.holdings.free_capacity())
        ids = await self._our_part(ids) if shared else ids[:room]
        limit = self.ctx.cfg.lease.claim_concurrency
        outcomes = await bounded(ids, limit, lambda cid: self.claimer.claim(cid, dead_owner=dead))
        span.set(owned=backlog, tried=len(ids), claimed=sum(o is Outcome.WON for o in outcomes))
        if len(ids) < backlog and Outcome.WON in outcomes and self.holdings.free_capacity() > 0:
            self._dead_left = True  # our share taken, the rest is anyone's at the next step, soon
        # A claim loses on a STOPPED item, or one a peer took first: free those still the dead's (the
        # index says which, so that the many lost races of a takeover do not each cost a write).
        lost = [cid for cid, o in zip(ids, outcomes, strict=True) if o is Outcome.LOST]
        if lost:
            still = set(await leases.items_of(dead))
            lost = [cid for cid in lost if cid in still]
        freed = await bounded(lost, limit, lambda cid: leases.free_stopped(cid, dead))
        stopped_freed = sum(o is Outcome.WON for o in freed)
        self.ctx.stats.inc("dead_session_stopped_freed_total", float(stopped_freed))
        if stopped_freed:
            span.set(stopped_freed=stopped_freed)
            span.keep()
        if not leases.past_grace(death.dead_at_ms):
            return False  # keep looking until no late claim of the dead session can land
        if room == 0 and len(ids) < backlog:
            await self._disown_unplaced(dead, span)
        if await leases.items_of(dead, limit=1):
            return False
        deleted = await leases.delete_dead_session(dead)
        if deleted is Outcome.WON:
            span.event("forgotten")
        return deleted in (Outcome.WON, Outcome.LOST)  # LOST: a peer did

    async def _disown_unplaced(self, dead: str, span: Span) -> None:
        """Past its grace a dead session still owns items and we have no room for them: free them (with
        hints), so that they wait in the free index like any backlog and the session can be forgotten.
        Shards with room had the whole grace to claim them; a STOPPED one, which no claim takes, would
        otherwise stay owned by the dead session for good."""
        left = [cid for cid in await self.ctx.leases.items_of(dead) if not self.holdings.busy(cid)]
        freed = await disown(self.ctx, left, dead)
        self.ctx.stats.inc("dead_session_unplaced_freed_total", float(len(freed)))
        if freed:
            span.event("unplaced_freed", count=len(freed))

    async def _disown_unclaimable(self, dead: str, ids: list[str]) -> None:
        """Items no claim fits, owned by a dead session: made free (owned by nobody, unhinted), so that
        the session can be forgotten instead of staying listed, and read, by every round of every shard.
        Free, they cost what any bad free item costs: a failed claim per shard every few minutes."""
        if not ids:
            return
        outcomes = await bounded(ids, self.ctx.cfg.lease.claim_concurrency,
                                 lambda cid: self.ctx.leases.disown(cid, dead))
        self.ctx.stats.inc("dead_session_unclaimable_freed_total", float(sum(o is Outcome.WON for o in outcomes)))

    # ----- our own items ---------------------------------------------------------------------------------

    async def adopt_own_strays(self, source: str = "reconcile") -> None:
        """Items owned by our session that we do not hold: handed to us by a peer (rebalancing), or an
        ambiguous claim we reported as failed.  One scan at a time: this is the only path that claims
        an item we own, so an item it frees cannot be one a concurrent claim is adopting."""
        async with self._adopting:
            me = self.session.session_id
            strays = [cid for cid in await self.ctx.leases.items_of(me) if cid not in self.holdings]
            room = max(0, self.holdings.free_capacity())
            take, excess = strays[:room], strays[room:]
            limit = self.ctx.cfg.lease.claim_concurrency
            outcomes = await bounded(take, limit, lambda cid: self.claimer.claim(cid, dead_owner=me, source=source))
            # Stopped since it was handed to us: free it, or it stays ours and unstreamed for good.
            lost = [cid for cid, o in zip(take, outcomes, strict=True) if o is Outcome.LOST]
            await bounded(lost, limit, lambda cid: self.ctx.leases.free_stopped(cid, me))
            # Only what is still neither held nor being claimed (a concurrent claim may have won one).
            excess = [cid for cid in excess if not self.holdings.busy(cid)]
            if excess and self.session.may_claim() and me == self.session.session_id:
                await self.disown_excess(excess, me)

    async def disown_excess(self, ids: list[str], me: str) -> None:
        """Handed more than we have room for (a peer's view of our load was stale): free them, with hints."""
        freed = await disown(self.ctx, ids, me)
        self.ctx.stats.inc("rebalance_given_back_total", float(len(freed)))

    async def disown_strays(self) -> None:
        """At shutdown: streams a peer handed us as we began to stop (it read our load before we were
        draining) are freed now, with hints, rather than left to our session's end."""
        me = self.session.session_id
        strays = [cid for cid in await self.ctx.leases.items_of(me) if cid not in self.holdings]
        if strays:
            await self.disown_excess(strays, me)

    # ----- free items ------------------------------------------------------------------------------------

    def _step(self) -> int:
        """Claims of one step, when the backlog is not ours to take in one burst."""
        return min(self.holdings.free_capacity(), max(20, self.holdings.capacity // 20))

    async def _our_part(self, ids: list[str]) -> list[str]:
        """Of a backlog (shuffled), what we claim now: all that fits if it is no more than a step;
        else our share of it, our partition first (``fleetd.shard.share``)."""
        room = max(0, self.holdings.free_capacity())
        if room == 0 or len(ids) <= self._step():
            return ids[:room]
        me = self.session.session_id
        takers = await self._sharing()
        want = min(room, max(self._step(), fair_share(len(ids), takers, me)))
        return mine_first(ids, takers, me)[:want]

    async def _sharing(self) -> list[str]:
        """The sessions that share a backlog with us: renewed within their last two heartbeats (a dying
        session claims nothing), and, in a fleet small enough to read every load, neither full nor
        draining.  A stale view only makes a burst smaller or larger: the next steps correct it."""
        read_at, takers = self._takers
        now = self.ctx.clock.monotonic()
        if now - read_at < SESSIONS_FRESH_S:
            return takers
        lease = self.ctx.cfg.lease
        fresh_ms = int((lease.lease_ttl_s - 2 * lease.heartbeat_s) * 1000)
        takers = await self.ctx.leases.live_sessions(min_remaining_ms=fresh_ms)
        if len(takers) <= SHARE_LOADS_MAX:
            me = self.session.session_id
            takers = [load.session_id for load in await self.ctx.leases.loads_of(takers)
                      if load.session_id == me or (not load.draining and load.held < load.capacity)]
        self._takers = (now, takers)
        return takers

    async def _claim_free(self) -> bool:
        """Claim our share of the free items in one burst (a step, if the backlog is small); True if
        there may be more (reconcile again soon: each next step waits in proportion to our load)."""
        room = self.holdings.free_capacity()
        if room <= 0:
            return False
        # Unclaimable items we skip may sort first in the index: look past them.
        limit = room * LOOKAHEAD + 10 + self.claimer.skipped_count()
        candidates = await self.ctx.leases.free_items(limit=limit)
        ids = [cid for cid in candidates if cid not in self.holdings and not self.claimer.skipped(cid)]
        random.shuffle(ids)  # peers scanning the same index should not all race for the same items
        take = await self._our_part(ids)
        outcomes = await bounded(take, self.ctx.cfg.lease.claim_concurrency, self.claimer.claim)
        if any(o is None for o in outcomes):
            return False  # it stopped trying (full, stopping, or the session went): no quick next step
        return len(ids) > len(take) or len(candidates) >= limit
