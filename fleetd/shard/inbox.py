"""Hint intake: START hints (claim these now), OFFER hints (take these from a stopping peer now) and
DEAD_SESSION hints (take this session over now).

Rules: a hint only speeds work up — the claim or the consistent read decides — so a hint we cannot
use goes back to the queue at once (visible to peers), and a hint we use in part sends the rest on.
Once stopping, no new poll starts (it would take our own final hints), and the poll in flight is
not cancelled but answered and requeued: a cancelled long poll may still be handed messages, which
would then stay hidden from peers for the visibility timeout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass, field, replace

from fleetd.aio import Guard, bounded, wait
from fleetd.aws import Outcome
from fleetd.hints import Hint, Offer
from fleetd.lease import OffersOpen
from fleetd.shard.claims import Claimer
from fleetd.shard.context import Context
from fleetd.shard.holdings import Holdings
from fleetd.shard.reconcile import Reconciler

log = logging.getLogger(__name__)
BURST = 10  # messages in a full SQS receive: a peer is handing over many streams at once
POLL_GRACE_S = 1.0  # a poll still open when the shard has stopped may answer this long


@dataclass(frozen=True, slots=True)
class Offered:
    """One offer as received: the offering session and its token, and the stream."""

    session_id: str
    token: str
    offer: Offer


@dataclass(slots=True)
class Sorted:
    """What to do with one receive's hints."""

    claims: list[str] = field(default_factory=list)  # claim now
    leftover: list[str] = field(default_factory=list)  # named in a hint we took, no room: send on to peers
    offers: list[Offered] = field(default_factory=list)  # take now
    leftover_offers: list[Offered] = field(default_factory=list)  # no room: offer on to peers
    ours: list[str] = field(default_factory=list)  # held already: re-read (e.g. `ctl start` with a new URL)
    dead: list[str] = field(default_factory=list)  # dead sessions to take over by name
    taken: list[str] = field(default_factory=list)  # receipts to acknowledge
    requeue: list[str] = field(default_factory=list)  # receipts to make visible to peers again


def sort_hints(hints: Sequence[Hint], held: Container[str], room: int, stopping: bool) -> Sorted:
    """Split one receive: claims up to ``room``, the rest sent on; a hint with nothing for us requeued."""
    out = Sorted()
    for hint in hints:
        if hint.dead_session:
            # A supervisor buried a crashed shard whose successor is not booting: its streams are
            # ours to take at once (the takeover confirms the session is dead first).
            (out.requeue if stopping else out.taken).append(hint.receipt)
            if not stopping:
                out.dead.append(hint.dead_session)
            continue
        if hint.offered_by and stopping:
            out.requeue.append(hint.receipt)  # perhaps our own offers, taken by our last poll: for peers
            continue
        if not hint.offered_by:
            out.ours += [cid for cid in hint.connection_ids if cid in held]
        rest = [cid for cid in hint.connection_ids if cid not in held]
        free = 0 if stopping else room - len(out.claims) - len(out.offers)
        if rest and free <= 0 and len(rest) == len(hint.connection_ids):
            out.requeue.append(hint.receipt)  # nothing in it for us: visible to peers at once
            continue
        out.taken.append(hint.receipt)
        if hint.offered_by:  # an offer of a stream we hold is stale: dropped
            offers = [Offered(hint.offered_by, hint.offer_token, o) for o in hint.offers
                      if o.connection_id not in held]
            out.offers += offers[:max(0, free)]
            out.leftover_offers += offers[max(0, free):]
            continue
        out.claims += rest[:max(0, free)]
        out.leftover += rest[max(0, free):]
    return out


class Inbox:
    """Long-polls hints until the shutdown has sent its own (``close``)."""

    def __init__(self, ctx: Context, holdings: Holdings, claimer: Claimer, reconciler: Reconciler,
                 recheck: Callable[[list[str]], Awaitable[None]]) -> None:
        self.ctx = ctx
        self.holdings = holdings
        self.claimer = claimer
        self.reconciler = reconciler
        self.recheck = recheck
        self._closed = asyncio.Event()
        self._guard = Guard("hints", ctx.count_error, log)

    def close(self) -> None:
        """The shutdown's own hints are out: the poll in flight may end."""
        self._closed.set()

    async def run(self) -> None:
        while not self._closed.is_set():
            if self.ctx.is_stopping():
                await self._closed.wait()  # no new polls once stopping
                return
            if self.holdings.free_capacity() <= 0 or not self.claimer.may_claim():
                # Full, or no live session (being replaced): leave hints for peers rather than take and
                # drop them (a received hint we cannot use would come straight back to us).
                await wait(self.ctx.stopping, 1.0)
                continue
            if not await self._guard.run(self._poll, False):  # failed: wait before polling again
                await wait(self._closed, 2.0)

    async def _poll(self) -> bool:
        hints_q = self.ctx.hints
        poll = asyncio.ensure_future(hints_q.receive(max(1, self.holdings.free_capacity())))
        closed = asyncio.ensure_future(self._closed.wait())
        await asyncio.wait([poll, closed], return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if not poll.done():
            # Shut down: our own START hints may have been handed to this very poll.  Let it answer,
            # and requeue what it got.
            await asyncio.wait([poll], timeout=POLL_GRACE_S)
            if not poll.done():
                poll.cancel()
                return True
        hints = poll.result()
        stopping = self.ctx.is_stopping()
        todo = sort_hints(hints, self.holdings, self.holdings.free_capacity(), stopping)
        for dead in todo.dead:
            log.info("dead session announced", extra={"dead_session": dead})
            self.reconciler.announce(dead)
        # Concurrently: a peer handing over 1,000 streams hints them a hundred at a time.
        await bounded(todo.claims, self.ctx.cfg.lease.claim_concurrency,
                      lambda cid: self.claimer.claim(cid, source="hint"))
        await self._take_offers(todo.offers)
        if len(hints) >= BURST:
            # A full receive means a burst (a peer released its streams): the reconcile's index query
            # picks up in bulk what the hints still queued name.
            self.reconciler.wake()
        if todo.leftover:
            await hints_q.send_start(todo.leftover)
        for (sid, token), offers in _by_session(todo.leftover_offers).items():
            await hints_q.send_offers(sid, token, offers)
        if todo.taken:
            await hints_q.ack(todo.taken)
        if todo.requeue:
            await hints_q.requeue(todo.requeue)
        if todo.ours and not self.ctx.is_stopping():
            await self.recheck(todo.ours)
        return True

    async def _take_offers(self, offers: list[Offered]) -> None:
        """Take offers of sessions whose offers are open (their mark read consistently, once per session):
        an offer alone never takes a stream its session might still stream.  An offer we could not use
        (its session unreadable, no live session of ours) is not sent on: a shard in that state would
        receive it back at once, and the stopper releases what nobody took."""
        for (sid, token), mine in _by_session(offers).items():
            state = await self.ctx.leases.offers_open(sid, token)
            if state is OffersOpen.UNKNOWN:
                continue
            if state is OffersOpen.NO:
                self.ctx.stats.inc("hints_total", float(len(mine)), kind="offer_refused")
                log.warning("offers refused: their session has not closed its streams",
                            extra={"offered_by": sid, "count": len(mine)})
                continue
            # A dead session's offer without its mark proves no resume point: resume from the item's own.
            take = functools.partial(self._take, sid, state is OffersOpen.WITH_SEQ)
            await bounded(mine, self.ctx.cfg.lease.claim_concurrency, take)

    async def _take(self, offered_by: str, with_seq: bool, offer: Offer) -> Outcome | None:
        return await self.claimer.take(offer if with_seq else replace(offer, last_seq=-1), offered_by)


def _by_session(offers: list[Offered]) -> dict[tuple[str, str], list[Offer]]:
    out: dict[tuple[str, str], list[Offer]] = {}
    for o in offers:
        out.setdefault((o.session_id, o.token), []).append(o.offer)
    return out
