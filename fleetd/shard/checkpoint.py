"""Checkpoints: ``last_seq`` written to the connection item, conditioned on our ownership and epoch.

Rule: a checkpoint only bounds the replay after a crash (the messages table dedupes by key), so
busy streams are checkpointed every ``checkpoint_s`` and slow ones every ``checkpoint_idle_s``: for an
idle fleet, per-stream checkpoints would be most of fleetd's writes.  A checkpoint refused for
ownership means the stream was taken: it is fenced.
"""

from __future__ import annotations

import logging

from fleetd.aio import Guard, bounded, wait
from fleetd.aws import Outcome
from fleetd.shard.context import Context
from fleetd.shard.holdings import Held, Holdings
from fleetd.shard.session import SessionKeeper

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, ctx: Context, session: SessionKeeper, holdings: Holdings) -> None:
        self.ctx = ctx
        self.session = session
        self.holdings = holdings
        self._guard = Guard("checkpoint", ctx.count_error, log)

    async def run(self) -> None:
        while not await wait(self.ctx.stopping, self.ctx.cfg.lease.checkpoint_s):
            await self._guard.run(self.checkpoint_all, None)

    async def checkpoint_all(self) -> None:
        now = self.ctx.clock.monotonic()
        dirty = [(cid, h) for cid, h in self.holdings.entries() if not h.releasing and self._due(h, now)]
        me = self.session.session_id

        async def one(entry: tuple[str, Held]) -> None:
            cid, h = entry
            seq = h.cursor.last_seq
            outcome = await self.ctx.leases.checkpoint(cid, h.owner(me), h.epoch, seq)
            if outcome is Outcome.WON:
                h.cursor.checkpointed_seq = seq
                h.checkpointed_at = now
            elif outcome is Outcome.LOST and self.holdings.get(cid) is h:
                self.holdings.fence(cid, "checkpoint_lost")

        await bounded(dirty, self.ctx.cfg.lease.claim_concurrency, one)

    def _due(self, h: Held, now: float) -> bool:
        advanced = h.cursor.last_seq - h.cursor.checkpointed_seq
        if advanced == 0:
            return False
        le = self.ctx.cfg.lease
        return advanced >= le.checkpoint_min_seqs or now - h.checkpointed_at >= le.checkpoint_idle_s
