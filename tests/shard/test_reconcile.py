"""The reconciler (fleetd/shard/reconcile.py): takeovers decided by tombstones and grace on the ManualClock,
strays, and free items claimed in steps when our share is small (bursts: test_share.py).

The fast profile keeps the product's ``dead_session_grace_s`` (60 s) and a 1 s safety margin: a dead
session is forgotten only once its tombstone is more than 61 s old.
"""

from __future__ import annotations

import asyncio

from fleetd.aws import Outcome
from fleetd.config import Config
from fleetd.lease import Fate
from tests.helpers import arun
from tests.shard.support import Rig, rig


async def _dead_session(r: Rig, sid: str, *ids: str) -> None:
    """A peer session owning ``ids``, tombstoned now (as its supervisor or its own end does)."""
    await r.put_items(*ids)
    await r.peer_session(sid)
    await r.claim_as(sid, *ids)
    assert await r.leases.expire_session(sid) is Outcome.WON


def test_take_over_claims_a_dead_sessions_items_and_forgets_it_only_after_grace(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            me = await r.open()
            await _dead_session(r, "dead", "a", "b")
            assert await r.parts.reconciler.take_over("dead") is False, "forgotten before its grace"
            assert sorted(r.parts.holdings.ids()) == ["a", "b"]
            assert [await r.owner(cid) for cid in ("a", "b")] == [me, me]
            assert (await r.item("a")).lease_epoch == 2
            r.clock.advance(61.0)  # the tombstone is exactly grace + margin old
            assert await r.parts.reconciler.take_over("dead") is False
            assert await r.session_record("dead")
            r.clock.advance(0.001)
            assert await r.parts.reconciler.take_over("dead") is True
            assert await r.session_record("dead") == {}
            assert (await r.leases.fate("dead")).fate is Fate.GONE
            assert await r.parts.reconciler.take_over("dead") is True, "a forgotten session is done"

    arun(body())


def test_take_over_of_an_expired_session_writes_its_tombstone_first(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.put_items("a")
            await r.peer_session("expired")  # expires 6 s from now; dead for everyone 1 s later
            await r.claim_as("expired", "a")
            r.clock.advance(7.0)
            await r.open()
            assert await r.parts.reconciler.take_over("expired") is False
            assert r.parts.holdings.ids() == [], "an expired session is not dead until past the margin"
            assert "dead_at_ms" not in await r.session_record("expired")
            r.clock.advance(0.1)
            assert await r.parts.reconciler.take_over("expired") is False
            assert "dead_at_ms" in await r.session_record("expired")
            assert r.parts.holdings.ids() == ["a"]

    arun(body())


def test_take_over_of_a_live_session_claims_nothing(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a")
            await r.peer_session("alive")
            await r.claim_as("alive", "a")
            assert await r.parts.reconciler.take_over("alive") is False
            assert r.parts.holdings.ids() == [] and await r.owner("a") == "alive"
            assert "dead_at_ms" not in await r.session_record("alive")

    arun(body())


def test_take_over_frees_a_dead_sessions_stopped_items_and_respects_room(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=2) as r:
            await r.open()
            await _dead_session(r, "dead", "stopped", "x", "y", "z")
            await r.stop_item("stopped")
            # Room for two: a STOPPED item may be among those tried (then freed), so take over twice.
            assert await r.parts.reconciler.take_over("dead") is False
            r.parts.holdings.fence_all("test")  # make room again
            assert await r.parts.reconciler.take_over("dead") is False
            r.parts.holdings.fence_all("test")
            assert await r.parts.reconciler.take_over("dead") is False
            assert len(await r.leases.items_of("dead")) == 0
            stopped = await r.item("stopped")
            assert stopped.lease_owner == "" and stopped.desired_state == "STOPPED"
            assert r.count("dead_session_stopped_freed_total") == 1

    arun(body())


def test_take_over_claims_no_more_than_the_free_capacity(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=2) as r:
            await r.open()
            await _dead_session(r, "dead", "a", "b", "c")
            assert await r.parts.reconciler.take_over("dead") is False
            assert len(r.parts.holdings) == 2
            assert len(await r.leases.items_of("dead")) == 1
            assert r.count("lease_claims_total", result="won") == 2, "claims beyond the room were sent"

    arun(body())


def test_claim_free_claims_one_step_when_our_share_is_smaller(tables: Config) -> None:
    """A step is max(20, capacity / 20) items: with five live peers our share of 30 free items is 5, so
    capacity 100 takes them in two steps (a step, then the 10 that remain, no more than a step)."""
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            await r.open()
            for n in range(5):
                await r.peer_session(f"peer-{n}")
            await r.put_items(*(f"i{n:02d}" for n in range(30)))
            assert await r.parts.reconciler._claim_free() is True, "more remain"
            assert len(r.parts.holdings) == 20
            assert await r.parts.reconciler._claim_free() is False
            assert len(r.parts.holdings) == 30
            assert await r.parts.reconciler._claim_free() is False
            assert r.count("reconcile_claims_total") == 30

    arun(body())


def test_claim_free_stops_at_capacity(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=5) as r:
            await r.open()
            await r.put_items(*(f"i{n}" for n in range(8)))
            await r.parts.reconciler._claim_free()
            assert len(r.parts.holdings) == 5
            assert await r.parts.reconciler._claim_free() is False
            assert len(r.parts.holdings) == 5 and len(await r.leases.free_items(100)) == 3

    arun(body())


def test_a_round_without_a_live_session_reads_nothing(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a")
            r.clock.advance(5.0)
            before = dict(r.stats.counters)
            assert await r.parts.reconciler._round(0) is False
            assert dict(r.stats.counters) == before and r.parts.holdings.ids() == []

    arun(body())


def test_adopt_own_strays_adopts_what_fits_and_gives_back_the_rest(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=2) as r:
            me = await r.open()
            await r.put_items("s1", "s2", "s3", "stopped")
            await r.claim_as(me, "s1", "s2", "s3", "stopped")  # e.g. handed to us by a peer
            await r.stop_item("stopped")
            await r.parts.reconciler.adopt_own_strays(source="handed")
            # by_owner has no order: the stopped stray is either among the two tried (its claim loses and
            # it is freed) or among the two beyond our room (given back).  Either way two are given back.
            held = r.parts.holdings.ids()
            assert "stopped" not in held and 1 <= len(held) == r.count("handed_claims_total") <= 2
            left = {cid: await r.owner(cid) for cid in ("s1", "s2", "s3", "stopped") if cid not in held}
            assert set(left.values()) == {""}, f"strays left owned and unstreamed: {left}"
            assert r.count("rebalance_given_back_total") == 2
            hinted = await r.hinted_ids()
            assert len(hinted) == 2 and not set(hinted) & set(held)

    arun(body())


def test_a_dying_session_arms_a_wake_for_when_it_is_dead_for_everyone(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.peer_session("dying")  # expires 6 s from now
            r.clock.advance(5.0)  # within the reconcile horizon (1.2 s) of expiring
            await r.parts.reconciler._take_over_dead()
            wake = r.parts.reconciler._expiry_wake
            assert wake is not None
            # expiry (1 s away) + margin (1 s) + 50 ms, on the loop's clock
            assert abs(wake.when() - asyncio.get_running_loop().time() - 2.05) < 0.05

    arun(body())


def test_a_dead_sessions_unclaimable_item_is_freed_so_the_session_can_be_forgotten(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await _dead_session(r, "dead", "good", "bad")
            await r.update("bad", "SET lease_epoch = :x", x="not a number")
            assert await r.parts.reconciler.take_over("dead") is False  # the bad one failed its claim
            assert r.parts.claimer.skipped("bad") and "good" in r.parts.holdings
            assert await r.parts.reconciler.take_over("dead") is False  # grace: not forgotten yet
            assert await r.leases.items_of("dead") == [], "the unclaimable item was freed"
            assert await r.owner("bad") == "" and r.count("dead_session_unclaimable_freed_total") == 1
            r.clock.advance(62)
            assert await r.parts.reconciler.take_over("dead") is True, "forgotten once it owns nothing"
            assert await r.leases.fate("dead") is not None and (await r.leases.fate("dead")).fate is Fate.GONE

    arun(body())
