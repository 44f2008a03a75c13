"""The hand-over at shutdown (session mode): a stopping shard's streams go to peers in one write each.

Rule: the shard first closes and flushes every stream it holds, then writes its offering mark on its
session with a fresh random token (from then on nothing of the session streams), then offers the
streams over SQS with the token, their epoch and final ``last_seq``.  A peer with room reads the mark
(consistently) and takes each offered stream with one write conditioned on our ownership and that
epoch, resuming after that ``last_seq`` (``LeaseStore.take``).  Only an offer whose token matches the
mark may set a resume point: a dead session's offers without it are taken from the item's own
``last_seq``, so a hint alone never writes data into an item.

So a stream changes hands with one write, not a release and a claim, and the peers that take it are
the ones with room, not the ones a rebalancing look picked.  Whatever no peer took within
``OFFER_WAIT_S`` (or everything, when no live peer has room or the mark cannot be written) is left to
the release phase: released with a START hint, as without offers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from fleetd.aio import retrying
from fleetd.aws import Outcome
from fleetd.hints import Offer
from fleetd.lease import STARTED, ConnItem
from fleetd.shard.context import Context
from fleetd.shard.holdings import Holdings
from fleetd.shard.session import SessionKeeper

log = logging.getLogger(__name__)
OFFER_WAIT_S = 2.0  # peers take offers within milliseconds of their long poll; the rest is released
OFFER_SEND_S = 1.0  # SQS answers a send in milliseconds: past this it is down, and releasing is faster
OFFER_POLL_S = 0.2  # how often we read which offers were taken (BatchGetItem, a read per 100 streams)
SAMPLE = 10  # live sessions sampled for a peer with room


class Handoff:
    """Offers the held streams to peers at shutdown; leaves the untaken ones held for the release phase."""

    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings

    async def run(self) -> None:
        """The shutdown's hand-over phase (nothing without streams, in item mode, or with no peer with room).
        Every socket is closed first, before any await for peers: a pause here must find nothing open."""
        me = self.session.session_id
        entries = self.holdings.entries()
        if not entries or self.ctx.cfg.lease.lease_mode != "session":
            return
        # Not offered: streams already being released, held under another owner string, or parked unreadable
        # (epoch 0: no claim of ours wrote it): the release phase hands those on.
        offered = [(cid, h) for cid, h in entries if not h.releasing and h.owner(me) == me and h.epoch >= 1]
        until = await self.holdings.quiesce(entries)  # every socket of the session closed, every write done
        if not offered or not await self._peer_with_room(me):
            return
        token = secrets.token_hex(16)
        outcome = await retrying(lambda: self.ctx.leases.mark_offering(me, token),
                                 lambda o: o is Outcome.RETRYABLE, until, self.ctx.clock)
        if outcome is not Outcome.WON:
            return  # without the mark peers refuse offers: the release phase hands everything on
        offers = {cid: Offer(cid, h.epoch, h.cursor.last_seq) for cid, h in offered}
        if not await self._send(me, token, list(offers.values())):
            return  # SQS unreachable: nobody hears of the offers; the release phase hands everything on
        taken = await self._wait_taken(me, offers)
        for cid, h in offered:
            if cid in taken:
                self.holdings.forget(cid, h, "offer_taken")
        self.ctx.stats.inc("handoff_total", float(len(taken)), result="taken")
        self.ctx.stats.inc("handoff_total", float(len(offers) - len(taken)), result="released")
        log.info("streams offered to peers", extra={"offered": len(offers), "taken": len(taken)})

    async def _send(self, me: str, token: str, offers: list[Offer]) -> bool:
        """Send the offers within ``OFFER_SEND_S``; False when none went out (then waiting is pointless)."""
        try:
            return await asyncio.wait_for(self.ctx.hints.send_offers(me, token, offers), OFFER_SEND_S) > 0
        except TimeoutError:
            log.info("offers not sent in time; releasing instead", extra={"count": len(offers)})
            return False

    async def _peer_with_room(self, me: str) -> bool:
        try:
            loads = await self.ctx.leases.live_loads(SAMPLE)
        except Exception as e:
            log.info("could not read peers' loads; releasing instead of offering", extra={"error": repr(e)})
            return False
        return any(p.session_id != me and not p.draining and p.held < p.capacity for p in loads)

    async def _wait_taken(self, me: str, offers: dict[str, Offer]) -> set[str]:
        """The offered streams peers took (no longer ours at the offered epoch), read until every offer is
        taken or untakeable (stopped: the release phase frees it) or ``OFFER_WAIT_S`` has passed."""
        taken: set[str] = set()
        waiting = set(offers)
        deadline = self.ctx.clock.monotonic() + OFFER_WAIT_S
        while waiting and self.ctx.clock.monotonic() < deadline:
            await asyncio.sleep(OFFER_POLL_S)  # shutting down: no stopping event to wait on
            try:
                states = await self.ctx.leases.desired_states(sorted(waiting), max_wait_s=OFFER_POLL_S * 5)
            except Exception as e:
                log.info("could not read which offers were taken", extra={"error": repr(e)})
                continue
            now_taken = {cid for cid in waiting if cid in states and _taken(states[cid], me, offers[cid])}
            taken |= now_taken
            # An item the read did not return (unparseable) is still waited for.
            waiting -= now_taken | {cid for cid in waiting if cid in states and _untakeable(states[cid])}
        return taken


def _taken(item: ConnItem | None, me: str, offer: Offer) -> bool:
    """A peer took the offered tenure: the item is no longer ours at that epoch (or no longer exists)."""
    return item is None or item.lease_owner != me or item.lease_epoch != offer.epoch


def _untakeable(item: ConnItem | None) -> bool:
    """No peer can take it (a take requires STARTED): waiting longer for it is pointless."""
    return item is not None and item.desired_state != STARTED
