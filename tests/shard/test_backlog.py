"""Shared takeovers of a dead session's streams (fleetd/shard/reconcile.py, share.py): a round takes our
share, and when streams remain that we have room for, it asks for a quick next step rather than leave
them a whole reconcile period.  Sessions that renewed late (dying), are full or draining take no share."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, cast

from fleetd.aws import Outcome, open_clients
from fleetd.clock import ManualClock
from fleetd.config import Config
from fleetd.shard.runtime import assemble
from fleetd.shard.session import Identity
from fleetd.stats import Stats
from fleetd.upstream import Connector
from tests.helpers import arun
from tests.shard.support import AIO, Rig, Upstreams, fast, rig


@asynccontextmanager
async def named_rig(cfg: Config, task: str, clock: ManualClock, capacity: int = 100,
                    **overrides: Any) -> AsyncIterator[Rig]:
    """As ``support.rig``, but with our own task name and a shared clock: two shards on the same tables."""
    c = fast(cfg, **overrides)
    stats = Stats()
    nonces = itertools.count(1)
    ups = Upstreams()
    async with AsyncExitStack() as stack:
        clients = await open_clients(stack, c.aws, AIO)
        parts = assemble(c, clock, stats, clients, asyncio.Event(),
                         Identity(task, 0, capacity, lambda: f"n{next(nonces)}"), cast(Connector, ups.connect))
        await parts.ctx.hints.resolve()
        try:
            yield Rig(c, clock, stats, clients, parts, ups)
        finally:
            parts.ctx.stopping.set()
            parts.holdings.fence_all("test_end")
            for t in list(parts.session.tasks._tasks):
                t.cancel()


async def _dead_session(r: Rig, sid: str, ids: list[str]) -> None:
    await r.put_items(*ids)
    await r.peer_session(sid)
    await r.claim_as(sid, *ids)
    assert await r.leases.expire_session(sid) is Outcome.WON


def test_one_round_takes_over_every_dead_stream_that_fits_even_with_a_dying_peer_listed(tables: Config) -> None:
    """Task kill: a task with two shards dies.  Its first session is dead for everyone, its second is
    still listed as live by ``by_expiry``.  The only survivor, with room for everything, takes every
    stream in this round or asks for a quick next step."""
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            await r.open()
            ids = [f"d{n:02d}" for n in range(60)]
            await _dead_session(r, "killed-task/0/x", ids)
            await r.peer_session("killed-task/1/y")  # killed too, but not expired yet: listed as live
            more = await r.parts.reconciler._round(0)
            left = await r.leases.items_of("killed-task/0/x")
            # Taken now, or at least a quick next step asked (not a whole reconcile period later).
            assert not left or more, (
                f"after one round: {len(r.parts.holdings)} taken over, {len(left)} left to the dead session "
                f"(next step soon: {more})")

    arun(body())


def test_one_round_of_two_survivors_takes_over_every_dead_stream(tables: Config) -> None:
    """Two survivors with room for everything; a dead session's 60 streams fall 40 / 20 into their
    partitions.  Each takes ceil(60 / 2) = 30, its partition first: what is left (10 of the big
    partition) is taken now or a quick next step is asked for."""
    async def body() -> None:
        random.seed(12345)
        clock = ManualClock(time.time_ns() // 1_000_000)
        async with named_rig(tables, "ta", clock) as a, named_rig(tables, "tb", clock) as b:
            await a.open()
            await b.open()
            ranked = sorted([a.me, b.me])
            pool = (f"d{n:03d}" for n in itertools.count())
            part_a = list(itertools.islice((c for c in pool if zlib.crc32(c.encode()) % 2 == ranked.index(a.me)), 40))
            part_b = list(itertools.islice((c for c in pool if zlib.crc32(c.encode()) % 2 == ranked.index(b.me)), 20))
            await _dead_session(a, "dead/0/z", part_a + part_b)
            more = await asyncio.gather(a.parts.reconciler._round(0), b.parts.reconciler._round(0))
            left = await a.leases.items_of("dead/0/z")
            taken = len(a.parts.holdings) + len(b.parts.holdings)
            assert not left or any(more), (
                f"after one round of each survivor: {taken} taken over, {len(left)} left to the dead session; "
                f"quick next step asked: {more}")

    arun(body())


def test_rounds_needed_when_listed_peers_do_not_claim(tables: Config) -> None:
    """Peers listed as live that take nothing (here: created with no renewal since, capacity 10, held 0 —
    so they do count): no round leaves streams we had room for without asking for a quick next step."""
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            await r.open()
            for n in range(4):
                await r.peer_session(f"full-{n}")
            await _dead_session(r, "dead/0/q", [f"d{n:03d}" for n in range(100)])
            rounds = slow = 0  # slow: rounds that left streams and asked for no quick next step
            while await r.leases.items_of("dead/0/q", limit=1) and rounds < 20:
                quick = await r.parts.reconciler._round(rounds)
                rounds += 1
                if not quick and await r.leases.items_of("dead/0/q", limit=1):
                    slow += 1
            assert slow == 0, (f"{rounds} rounds to take over one dead session's 100 streams, {slow} of them "
                               f"followed by a whole reconcile period")

    arun(body())
