"""Desired state: streams whose item was stopped, deleted, taken, or given a new URL.

Rule: the base table decides, read consistently; an answer older than what we hold (a lower epoch)
concludes nothing.  A stopped item is released without a hint (nobody should take it); a deleted or
taken one is fenced; a new URL restarts the socket on the same cursor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fleetd.aio import Guard, wait
from fleetd.lease import STOPPED
from fleetd.shard.context import Context
from fleetd.shard.holdings import Holdings

log = logging.getLogger(__name__)


class DesiredState:
    """Every ``desired_state_s`` a GSI query for STOPPED items still held (one read per shard); every
    ``desired_sweep_s`` a BatchGetItem of every held item (costlier: one read per stream)."""

    def __init__(self, ctx: Context, holdings: Holdings) -> None:
        self.ctx = ctx
        self.holdings = holdings
        self._guard = Guard("desired_state", ctx.count_error, log)
        self._last_sweep = 0.0

    async def run(self) -> None:
        self._last_sweep = self.ctx.clock.monotonic()
        while not await wait(self.ctx.stopping, self.ctx.cfg.lease.desired_state_s):
            await self._guard.run(self._round, None)

    async def _round(self) -> None:
        if self.ctx.clock.monotonic() - self._last_sweep >= self.ctx.cfg.lease.desired_sweep_s:
            self._last_sweep = self.ctx.clock.monotonic()
            await self.check()
            return
        stopped = [cid for cid in await self.ctx.leases.stopped_held() if cid in self.holdings]
        if stopped:
            await self.check(stopped)

    async def check(self, ids: Iterable[str] | None = None) -> None:
        """Read the held items ``ids`` (default: all) on the base table and act on what changed."""
        wanted = set(self.holdings.ids()) if ids is None else set(ids)
        snapshot = {cid: h for cid, h in self.holdings.entries() if not h.releasing and cid in wanted}
        states = await self.ctx.leases.desired_states(snapshot)
        to_release: list[str] = []
        for cid, item in states.items():
            h = snapshot[cid]
            if self.holdings.get(cid) is not h:
                continue  # changed while we were reading
            if item is None:
                self.holdings.fence(cid, "deleted")
            elif item.lease_epoch > h.epoch or (item.lease_epoch == h.epoch and item.lease_owner != h.item.lease_owner):
                self.holdings.fence(cid, "taken")
            elif item.lease_epoch < h.epoch:
                continue  # a stale (eventually consistent) read: nothing to conclude
            elif item.desired_state == STOPPED:
                to_release.append(cid)
            elif item.ws_url != h.item.ws_url:
                await self.holdings.restart(cid, h, item)
        if to_release:
            await self.holdings.release(to_release, hint=False, reason="stopped")
