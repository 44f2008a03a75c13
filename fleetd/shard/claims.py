"""Claiming one stream: the conditional write, and what its answer allows.

Rule: a won claim is streamed only if it was sent under the session generation that is still live
when the answer arrives (and, in item mode, before the lease it wrote reaches our fence deadline,
counted from the claim's send).  A win that arrives too late is disowned at once (epoch-conditional)
and hinted, so it is never left to an abandoned session.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fleetd.aws import Outcome
from fleetd.hints import Offer
from fleetd.lease import ClaimResult
from fleetd.shard.context import Context
from fleetd.shard.freeing import disown
from fleetd.shard.holdings import Holdings
from fleetd.shard.session import SessionKeeper, fence_deadline

log = logging.getLogger(__name__)
# An item no claim can succeed on (its attributes do not fit the claim) is skipped this long, then
# tried again in case it was fixed: without the skip, enough of them at the head of the index would
# take every claim of a round and starve the good free items behind them.
UNCLAIMABLE_RETRY_S = 300.0


class Claimer:
    """Claims streams for the holdings, and remembers items no claim can succeed on."""

    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings,
                 suspect_strays: Callable[[], None]) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings
        self.suspect_strays = suspect_strays
        self._unclaimable: dict[str, float] = {}  # connection id → monotonic time it may be tried again

    async def claim(self, cid: str, dead_owner: str | None = None, source: str = "reconcile") -> Outcome | None:
        """Try to take one stream and start streaming it.  None: did not try (held, being claimed,
        skipped, no room, or no live session); LOST: the condition failed, or the win came too late."""
        return await self._claim(cid, source, dead_owner or "", lambda me: self.ctx.leases.claim(cid, me, dead_owner))

    async def take(self, offer: Offer, offered_by: str) -> Outcome | None:
        """Take a stream a stopping peer offered (the caller checked its offers are open), as ``claim``."""
        cid = offer.connection_id
        return await self._claim(
            cid, "offer", offered_by, lambda me: self.ctx.leases.take(cid, me, offered_by, offer.epoch, offer.last_seq))

    async def _claim(self, cid: str, source: str, taken_from: str,
                     write: Callable[[str], Awaitable[ClaimResult]]) -> Outcome | None:
        if (self.holdings.busy(cid) or self.skipped(cid) or self.holdings.free_capacity() <= 0
                or not self.session.may_claim()):
            return None
        generation, me = self.session.generation, self.session.session_id
        with self.holdings.claiming(cid):
            result = await write(me)
        self.ctx.stats.inc("lease_claims_total", result=result.outcome.value)
        if result.outcome is Outcome.RETRYABLE:
            self.suspect_strays()  # the claim may still land, owned by us and held by nobody
        if result.bad_item:
            self._mark_unclaimable(cid, result.detail)
        if result.outcome is not Outcome.WON:
            return result.outcome
        if not self._usable(result, generation):
            self.ctx.stats.inc("lease_claims_orphaned_total")
            await self._disown_late(cid, me, result)
            return Outcome.LOST
        self.ctx.stats.inc(f"{source}_claims_total")  # reconcile, hint, handed or offer
        self.holdings.adopt(cid, result, source, taken_from=taken_from if taken_from != me else "")
        return Outcome.WON

    def _usable(self, result: ClaimResult, generation: int) -> bool:
        if not self.session.may_claim(generation):
            return False
        lease = self.ctx.cfg.lease
        return lease.lease_mode != "item" or self.ctx.clock.monotonic() < fence_deadline(lease, result.sent_at)

    async def _disown_late(self, cid: str, me: str, result: ClaimResult) -> None:
        epoch = result.item.lease_epoch if result.item is not None else None
        try:
            await disown(self.ctx, [cid], me, epoch)
        except Exception as e:  # the orphan sweep or the dead session's takeover frees it later
            log.warning("could not give back a late claim", extra={"connection_id": cid, "error": repr(e)})

    def may_claim(self) -> bool:
        """A claim could be tried now (a live session, not stopping)."""
        return self.session.may_claim()

    def skipped(self, cid: str) -> bool:
        until = self._unclaimable.get(cid)
        return until is not None and self.ctx.clock.monotonic() < until

    def skipped_count(self) -> int:
        return len(self._unclaimable)

    def _mark_unclaimable(self, cid: str, detail: str) -> None:
        if cid not in self._unclaimable:
            self.ctx.stats.inc("bad_items_total", reason="unclaimable")
            log.warning("item cannot be claimed: its attributes do not fit the claim",
                        extra={"connection_id": cid, "error": detail})
        self._unclaimable[cid] = self.ctx.clock.monotonic() + UNCLAIMABLE_RETRY_S
