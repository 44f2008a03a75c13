"""The backstop for items owned by a session nobody lists any more.

Rule: a session that no longer exists streams nothing — it was forgotten only after its tombstone
and grace, and claims are made only under a session that exists — so its items may be freed (and
hinted) by anyone.  A dead owner is taken over through the normal path.  Owners are judged by a
consistent read; the cost is bounded: one of ``SEGMENTS`` segments of ``by_owner`` per sweep, at
most ``SWEEP_MAX`` keys.
"""

from __future__ import annotations

import logging
import random

from fleetd.aio import Guard, wait
from fleetd.lease import Fate
from fleetd.shard.context import Context
from fleetd.shard.freeing import disown
from fleetd.shard.reconcile import Reconciler
from fleetd.shard.session import SessionKeeper

log = logging.getLogger(__name__)
SEGMENTS = 16  # a sweep reads one of this many segments of `by_owner`
SWEEP_MAX = 5000  # keys one sweep reads at most (its cost bound)


class OrphanSweeper:
    """Every ``orphan_sweep_s`` (jittered), one segment of ``by_owner``: free the items of sessions
    that no longer exist, announce dead owners to the reconciler."""

    def __init__(self, ctx: Context, session: SessionKeeper, reconciler: Reconciler) -> None:
        self.ctx = ctx
        self.session = session
        self.reconciler = reconciler
        self._segment = random.randrange(SEGMENTS)  # the segment swept last
        self._guard = Guard("orphan_sweep", ctx.count_error, log)

    async def run(self) -> None:
        period = self.ctx.cfg.lease.orphan_sweep_s
        if period <= 0:
            return
        while not await wait(self.ctx.stopping, period * random.uniform(0.5, 1.5)):
            if self.session.may_claim():
                await self._guard.run(self.sweep, None)

    async def sweep(self) -> None:
        me = self.session.session_id
        by_owner: dict[str, list[str]] = {}
        self._segment = (self._segment + 1) % SEGMENTS  # the whole index every SEGMENTS sweeps
        for cid, owner in await self.ctx.leases.owned(self._segment, SEGMENTS, SWEEP_MAX):
            if owner != me:
                by_owner.setdefault(owner, []).append(cid)
        for owner, ids in by_owner.items():
            fate = (await self.ctx.leases.fate(owner)).fate
            if fate is Fate.DEAD and owner not in self.session.previous():
                self.reconciler.announce(owner)
            elif fate is Fate.GONE:
                await self._disown_orphans(owner, ids)

    async def _disown_orphans(self, owner: str, ids: list[str]) -> None:
        freed = await disown(self.ctx, ids, owner)
        if freed:
            self.ctx.stats.inc("orphans_freed_total", float(len(freed)))
            log.warning("freed items of a session that no longer exists", extra={"owner": owner, "count": len(freed)})
