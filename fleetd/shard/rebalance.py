"""Rebalancing (session mode): a shard over its share hands streams straight to the emptiest peer.

Rules: a hand-over is one conditional write per stream (``push``: owner → the receiver's live
session, conditioned on our ownership and epoch), after the stream is closed and flushed, so the
receiver resumes from the final ``last_seq``; a stream whose push is not known to have landed is
released with a hint instead.  The receiver adopts what it was handed (``by_owner`` = its session)
while it is below its share or told it was handed streams; what it has no room for it gives back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from fleetd.aio import Guard, bounded, retrying, wait
from fleetd.aws import Outcome
from fleetd.lease import SessionLoad
from fleetd.shard.context import Context
from fleetd.shard.holdings import Held, Holdings
from fleetd.shard.reconcile import Reconciler
from fleetd.shard.session import SessionKeeper

log = logging.getLogger(__name__)
# A look compares our load with this many live sessions, picked at random: the read stays a few
# units however big the fleet is, and ten estimate the mean load well enough for a 10 % band.
SAMPLE = 10
RECEIVE_POLL_S = 1.0  # a shard below its share looks this often for streams handed to it


@dataclass(frozen=True, slots=True)
class Plan:
    """What one look decided: whether we are below the fleet's mean (peers may hand us streams),
    and how many streams to hand to whom (``n`` = 0: none)."""

    below_share: bool
    to: str = ""
    n: int = 0


def plan(me: str, held: int, capacity: int, loads: Sequence[SessionLoad], settled_before_ms: int,
         tolerance: float, max_moves: int) -> Plan:
    """Hand streams over only when we are above the band around the sampled mean and the emptiest
    peer below it; never more than brings us to the mean, nor more than the target's room split
    between every shard over the band (they may all pick the same target in this round)."""
    # A peer still booting has not recorded what it claimed yet: leave it out of the mean too.
    peers = [p for p in loads if p.session_id != me and not p.draining and p.capacity > 0
             and p.started_at_ms <= settled_before_ms]
    if not peers:
        return Plan(below_share=False)
    share = (held + sum(p.held for p in peers)) / (capacity + sum(p.capacity for p in peers))
    load = held / capacity
    high, low = share * (1 + tolerance), share * (1 - tolerance)
    target = min(peers, key=lambda p: p.held / p.capacity)
    if load <= high or target.held / target.capacity >= low:
        return Plan(below_share=load < share)
    over = 1 + sum(1 for p in peers if p.held / p.capacity > high)
    room = math.floor(share * target.capacity) - target.held
    n = min(held - math.ceil(share * capacity), -(-room // over), max_moves)
    return Plan(below_share=False, to=target.session_id, n=max(0, n))


class Rebalancer:
    """The rebalancing look, the hand-over, and the receive watch."""

    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings, reconciler: Reconciler) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings
        self.reconciler = reconciler
        self._receiving_until = 0.0  # below our share until then: watch for streams handed to us
        self._handed_until = 0.0  # a peer marked it handed us streams: watch until then
        self._guard = Guard("rebalance", ctx.count_error, log)
        self._receive_guard = Guard("receive", ctx.count_error, log)

    def enabled(self) -> bool:
        """Session mode only: an item-mode lease carries its own expiry, which a hand-over would have to renew."""
        le = self.ctx.cfg.lease
        return le.lease_mode == "session" and le.rebalance_s > 0

    def watch_handed(self, until: float) -> None:
        """A peer marked that it handed us streams: look for them until ``until``; a look never shortens it."""
        self._handed_until = max(self._handed_until, until)

    def settle_s(self) -> float:
        """How long a session's recorded ``held`` may lag behind a burst of claims or adoptions: until
        it heartbeat twice after them.  A look before that sees the peer emptier than it is."""
        return 2 * self.ctx.cfg.lease.heartbeat_s + 2 * RECEIVE_POLL_S

    async def run(self) -> None:
        if not self.enabled():
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._look_loop(), name="rebalance")
            tg.create_task(self._receive_loop(), name="receive")

    async def _look_loop(self) -> None:
        """Every ``rebalance_s`` (jittered), one look; after a move, at least ``settle_s`` before the next."""
        le = self.ctx.cfg.lease
        delay = random.uniform(0.5, min(5.0, le.rebalance_s))  # soon after boot: a new shard wants streams
        # A peer may hand us streams before our first look (we boot empty): watch until then.
        self._receiving_until = self.ctx.clock.monotonic() + delay + RECEIVE_POLL_S
        while not await wait(self.ctx.stopping, delay):
            moved = await self._guard.run(self._look, False)
            delay = le.rebalance_s * (1 + random.uniform(-1, 1) * le.reconcile_jitter)
            if moved:
                delay = max(delay, self.settle_s())

    async def _look(self) -> bool:
        """One look; True when streams were handed over."""
        le, clock = self.ctx.cfg.lease, self.ctx.clock
        loads = await self.ctx.leases.live_loads(SAMPLE)
        if not self.session.may_claim():
            self._receiving_until = 0.0
            return False
        settled_before = clock.now_ms() - int(self.settle_s() * 1000)
        p = plan(self.session.session_id, len(self.holdings), self.holdings.capacity, loads, settled_before,
                 le.rebalance_tolerance, le.rebalance_max_moves)
        # Below the mean: peers may hand us streams until our next look (they target a wider margin).
        self._receiving_until = clock.monotonic() + 2 * le.rebalance_s if p.below_share else 0.0
        if p.n <= 0:
            return False
        await self.hand_over(p.to, p.n)
        return True

    async def hand_over(self, to: str, n: int) -> None:
        """Close ``n`` streams, flush them and make the live session ``to`` their owner, one write each
        (a release then a claim would be two, and whichever peer claimed first would get them)."""
        with self.ctx.tracer.span("hand_over", to=to, n=n) as span:
            moved = await self._hand_over(to, n)
            span.set(moved=moved)

    async def _hand_over(self, to: str, n: int) -> int:
        """``hand_over``; returns how many streams were moved (the rest were released)."""
        movable = [cid for cid, h in self.holdings.entries() if not h.releasing and h.conn is not None]
        picked = random.sample(movable, min(n, len(movable)))
        entries = [(cid, h) for cid in picked if (h := self.holdings.get(cid)) is not None]
        until = await self.holdings.quiesce(entries)
        leases, clock, me = self.ctx.leases, self.ctx.clock, self.session.session_id

        async def push(entry: tuple[str, Held]) -> bool:
            cid, h = entry
            outcome = await retrying(lambda: leases.push(cid, h.owner(me), h.epoch, h.cursor.last_seq, to),
                                     lambda o: o is Outcome.RETRYABLE, until, clock)
            self.ctx.stats.inc("rebalance_moves_total", result=outcome.value)
            if outcome is Outcome.WON:
                self.holdings.forget(cid, h, "handed_over", handed_to=to)
            return outcome is Outcome.WON

        moved = await bounded(entries, self.ctx.cfg.lease.claim_concurrency, push)
        if any(moved):
            # The receiver watches for handed streams only while it sees itself below its share; its
            # view of the fleet may differ from ours.  Its next renewal takes this mark and it looks.
            try:
                await leases.notify_handed(to)
            except Exception as e:
                log.info("could not mark the receiver as handed streams", extra={"to": to, "error": repr(e)})
        # Not moved, or not known to be: a conditional release and a hint are right whatever the push did.
        failed = [cid for (cid, _), ok in zip(entries, moved, strict=True) if not ok]
        if failed:
            await self.holdings.release(failed, hint=True)
        log.info("streams handed to a peer", extra={"to": to, "moved": len(entries) - len(failed),
                                                    "released": len(failed)})
        return len(entries) - len(failed)

    async def _receive_loop(self) -> None:
        """While watching, adopt what peers handed us (``by_owner`` = our session) every second; also
        when full: what we have no room for is given back, not left owned and unstreamed."""
        while not await wait(self.ctx.stopping, RECEIVE_POLL_S):
            watching = self.ctx.clock.monotonic() < max(self._receiving_until, self._handed_until)
            if watching and self.session.may_claim():
                await self._receive_guard.run(lambda: self.reconciler.adopt_own_strays(source="handed"), None)
