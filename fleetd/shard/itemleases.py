"""Item mode (the seed-compatible lease mode): each held stream has its own lease and deadline.

Rule: a stream is fenced at ``its last successful renewal's send + TTL − margin`` (monotonic); a
renewal answered at or past that deadline extends nothing, since the stream may already be fenced.
Each item is renewed on its own clock, not in rounds: one renewal the SDK retries for seconds must
not push every other item's renewal past its deadline.
"""

from __future__ import annotations

import asyncio

from fleetd.aio import wait
from fleetd.aws import Outcome
from fleetd.shard.context import Context
from fleetd.shard.holdings import Held, Holdings
from fleetd.shard.session import SessionKeeper, fence_deadline


class ItemLeases:
    """Renews held items' leases and fences each at its own deadline (item mode only)."""

    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings
        self._renewing: dict[str, asyncio.Task[None]] = {}
        self._sem = asyncio.Semaphore(ctx.cfg.lease.renew_concurrency)

    async def run(self) -> None:
        if self.ctx.cfg.lease.lease_mode != "item":
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._renew_loop(), name="item_renewals")
            tg.create_task(self._fence_loop(), name="item_fence")

    async def _renew_loop(self) -> None:
        """Each held item is due ``heartbeat_s`` after the send of its last successful renewal (or claim)."""
        lease = self.ctx.cfg.lease
        due_after_deadline = lease.heartbeat_s - (lease.lease_ttl_s - lease.safety_margin_s)
        try:
            while not await wait(self.ctx.stopping, min(0.25, lease.heartbeat_s / 4)):
                now = self.ctx.clock.monotonic()
                for cid, h in self.holdings.entries():
                    if cid not in self._renewing and not h.releasing and now >= h.deadline + due_after_deadline:
                        self._renewing[cid] = asyncio.get_running_loop().create_task(self._renew(cid, h))
        finally:
            for task in list(self._renewing.values()):
                task.cancel()
            await asyncio.gather(*self._renewing.values(), return_exceptions=True)

    async def _renew(self, cid: str, h: Held) -> None:
        clock = self.ctx.clock
        try:
            async with self._sem:
                started = clock.monotonic()
                outcome = await self.ctx.leases.renew_item(cid, h.owner(self.session.session_id), h.epoch)
        finally:
            self._renewing.pop(cid, None)  # due again at once if it failed: retried on the next tick
        self.ctx.stats.inc("lease_renewals_total", result=outcome.value)
        if outcome is Outcome.WON and clock.monotonic() < h.deadline:
            h.deadline = fence_deadline(self.ctx.cfg.lease, started)
        elif outcome is Outcome.LOST and self.holdings.get(cid) is h:
            self.holdings.fence(cid, "renewal_lost")

    async def _fence_loop(self) -> None:
        """Watchdog: fence each item at its deadline, however long its renewal hangs; through the shutdown
        too (until the session keeper's ``finished``), since item leases are not renewed once stopping."""
        while not await wait(self.session.finished, self._until_next_check()):
            await self._fence_expired()  # unguarded, as the session's fence loop: a failed fence ends the shard

    async def _fence_expired(self) -> None:
        now = self.ctx.clock.monotonic()
        for cid, h in self.holdings.entries():
            if now >= h.deadline:
                self.ctx.stats.inc("self_fence_total")
                self.holdings.fence(cid, "self_fence")

    def _until_next_check(self) -> float:
        entries = self.holdings.entries()
        if not entries:
            return 0.25
        return min(0.25, min(h.deadline for _, h in entries) - self.ctx.clock.monotonic())

    def next_deadline(self) -> float:
        """Item mode: the earliest deadline among held items (shutdown holds no socket past it)."""
        if self.ctx.cfg.lease.lease_mode != "item":
            return float("inf")
        return min((h.deadline for _, h in self.holdings.entries()), default=float("inf"))
