"""The session keeper (fleetd/shard/session.py) against dynalite, on a ManualClock.

A renewal is wrapped so the test acts between its send and its answer: moves the clock past the
fence deadline, abandons the session, or replaces it.  The fast profile's first deadline is
``open + TTL − margin`` = 5 s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetd.aws import Outcome
from fleetd.config import Config, LeaseConfig
from fleetd.lease import Fate
from fleetd.shard.session import SessionState, fence_deadline
from tests.helpers import arun
from tests.shard.support import Rig, rig, wrap


def test_fence_deadline_counts_from_the_send() -> None:
    lease = LeaseConfig(lease_ttl_s=20.0, safety_margin_s=2.0)
    assert fence_deadline(lease, 100.0) == 118.0


def test_session_state_generations() -> None:
    s = SessionState()
    assert not s.live(0.0) and s.generation == 0
    s.open("a", deadline=5.0)
    assert s.live(4.9) and s.live(4.9, generation=1)
    assert not s.live(5.0), "the deadline itself is past"
    assert not s.live(1.0, generation=0), "an older generation is never live"
    assert s.abandon() == "a"
    assert s.generation == 2 and s.deadline == 0.0 and not s.live(0.0)
    s.open("b", deadline=9.0)
    assert s.generation == 3 and s.previous == ["a"] and s.handed_seen == 0


def test_open_records_the_session_and_its_deadline(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            r.clock.advance(2.0)
            sid = await r.open()
            assert sid == "task/0/n1"
            assert r.parts.session.deadline == 2.0 + 5.0
            assert r.parts.session.may_claim()
            rec = await r.session_record(sid)
            assert int(rec["expires_at_ms"]["N"]) == r.clock.now_ms() + 6000
            assert rec["capacity"]["N"] == "10"

    arun(body())


def test_renewal_extends_the_deadline_from_its_send_not_its_answer(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            r.clock.advance(2.0)

            async def slow(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                r.clock.advance(1.5)  # answered at 3.5, still before the deadline (5)
                return answer

            wrap(r.leases, "renew_session", slow)
            assert await r.parts.session.renew() is True
            assert r.parts.session.deadline == 2.0 + 5.0
            assert r.count("lease_renewals_total", result="won") == 1

    arun(body())


def test_a_renewal_won_after_the_deadline_does_not_revive_the_session(tables: Config) -> None:
    """Sent at 4 (deadline 5), answered WON at 5.5: the streams may be fenced already; the session stays
    past its deadline, may not claim, and the fence loop replaces it with a new one."""
    async def body() -> None:
        async with rig(tables) as r:
            old = await r.open()
            await r.put_items("c1")
            assert await r.parts.claimer.claim("c1") is Outcome.WON
            r.clock.advance(4.0)

            async def late(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                r.clock.advance(1.5)
                return answer

            wrap(r.leases, "renew_session", late)
            assert await r.parts.session.renew() is False
            assert r.parts.session.deadline == 5.0, "a late WON extended the deadline"
            assert not r.parts.session.may_claim()
            assert r.parts.holdings.may_write(r.parts.holdings.get("c1").cursor) is False  # type: ignore[union-attr]
            assert len(r.parts.holdings) == 0, "the send check fences at the deadline"
            await r.background()  # the send check abandoned it and opens a replacement
            assert r.me == "task/0/n2" and r.parts.session.may_claim()
            assert r.parts.session.previous() == [old]
            assert (await r.leases.fate(old)).fate is Fate.DEAD, "the abandoned session is tombstoned"

    arun(body())


def test_a_renewal_answer_from_an_abandoned_generation_is_ignored(tables: Config) -> None:
    """Abandoned while its renewal was in flight: the WON answer must not bring the deadline back."""
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            generation = r.parts.session.generation

            async def abandoned_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                assert r.parts.session.abandon_now("test") is not None
                return answer

            wrap(r.leases, "renew_session", abandoned_meanwhile)
            assert await r.parts.session.renew() is False
            assert r.parts.session.deadline == 0.0
            assert r.parts.session.generation == generation + 1
            assert not r.parts.session.may_claim()

    arun(body())


def test_a_lost_renewal_of_an_old_generation_does_not_replace_the_new_session(tables: Config) -> None:
    """The session was replaced while its renewal was in flight, and the renewal then fails (the old session
    is tombstoned): only the current generation may react, so the replacement is kept, not replaced again."""
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()

            async def replaced_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                await r.parts.session.replace("test")
                answer = await original(*args, **kwargs)  # the old session's id, as sent
                assert answer[0] is Outcome.LOST
                return answer

            wrap(r.leases, "renew_session", replaced_meanwhile)
            assert await r.parts.session.renew() is False
            assert r.me == "task/0/n2", "replaced again by a stale LOST"
            assert r.parts.session.may_claim()

    arun(body())


def test_a_handed_mark_read_by_an_old_generation_is_not_taken_for_the_new_session(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            old = await r.open()
            assert await r.leases.notify_handed(old) is Outcome.WON

            async def replaced_after(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                assert answer[0] is Outcome.WON and answer[2] == 1  # the handed mark was read
                await r.parts.session.replace("test")
                return answer

            wrap(r.leases, "renew_session", replaced_after)
            assert await r.parts.session.renew() is False
            assert r.me == "task/0/n2" and r.parts.session.state.handed_seen == 0
            assert r.parts.rebalancer._handed_until == 0.0, "the rebalancer was told to watch for the old mark"

    arun(body())


def test_a_handed_mark_makes_the_rebalancer_watch(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            sid = await r.open()
            assert await r.leases.notify_handed(sid) is Outcome.WON
            assert await r.parts.session.renew() is True
            assert r.parts.session.state.handed_seen == 1
            assert r.parts.rebalancer._handed_until == 10.0  # now + HANDED_WATCH_S
            assert await r.parts.session.renew() is True  # the same count: no new watch
            assert r.parts.session.state.handed_seen == 1

    arun(body())


def test_a_lost_renewal_replaces_the_session_and_remembers_the_old_one(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            old = await r.open()
            assert await r.leases.expire_session(old) is Outcome.WON  # e.g. declared dead by a peer
            r.clock.advance(1.0)
            assert await r.parts.session.renew() is False
            assert r.me == "task/0/n2"
            assert r.parts.session.deadline == 1.0 + 5.0
            assert r.parts.session.previous() == [old], "its items are ours to take over"

    arun(body())


async def _held(r: Rig, *ids: str) -> None:
    await r.put_items(*ids)
    for cid in ids:
        assert await r.parts.claimer.claim(cid) is Outcome.WON


def test_abandon_fences_every_held_stream_and_bumps_the_generation(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            sid = await r.open()
            await _held(r, "a", "b", "c")
            records = [h for _, h in r.parts.holdings.entries()]
            assert all(h.cursor.active and h.conn is not None for h in records)
            generation = r.parts.session.generation
            assert r.parts.session.abandon_now("test") == sid
            assert len(r.parts.holdings) == 0
            assert not any(h.cursor.active for h in records)
            assert all(h.conn is not None and h.conn.closing for h in records)
            assert r.upstreams.open() == []
            assert r.count("lease_lost_total", reason="test") == 3
            assert r.parts.session.generation == generation + 1
            assert r.parts.session.abandon_now("again") is None, "a second abandon is a no-op"
            assert r.parts.session.generation == generation + 1

    arun(body())


def test_the_fence_watchdog_replaces_a_session_past_its_deadline(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            old = await r.open()
            await _held(r, "a")
            r.clock.advance(4.9)
            await r.parts.session._enforce_deadline()
            assert r.me == old and len(r.parts.holdings) == 1, "fenced before its deadline"
            r.clock.advance(0.1)
            await r.parts.session._enforce_deadline()
            assert len(r.parts.holdings) == 0
            assert r.count("self_fence_total") == 1
            assert r.me == "task/0/n2" and r.parts.session.deadline == 5.0 + 5.0
            assert (await r.leases.fate(old)).fate is Fate.DEAD

    arun(body())


def test_check_send_past_the_deadline_gives_the_session_up_at_once(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await _held(r, "a")
            r.clock.advance(4.99)
            assert r.parts.session.check_send()
            r.clock.advance(0.01)
            assert not r.parts.session.check_send()
            assert len(r.parts.holdings) == 0 and r.count("self_fence_total") == 1
            assert not r.parts.session.check_send()
            assert r.count("self_fence_total") == 1, "counted once per session"
            await r.background()
            assert r.me == "task/0/n2" and r.parts.session.check_send()

    arun(body())


def test_a_fence_round_that_fails_does_not_leave_streams_held_past_the_deadline(tables: Config) -> None:
    """A fence that fails ends the fence loop (and with it the shard process, whose sockets die with it):
    never a loop that goes on while a stream stays open past its deadline.  The session is given up
    before the fencing, so every send is refused even then."""
    async def body() -> None:
        async with rig(tables, capacity=10) as r:
            await r.open()
            await r.put_items("a")
            assert await r.parts.claimer.claim("a") is Outcome.WON
            calls = 0
            real = r.parts.holdings.fence_all

            def failing(reason: str) -> None:  # e.g. a transport whose disconnect raises
                nonlocal calls
                calls += 1
                raise RuntimeError("disconnect failed")

            r.parts.holdings.fence_all = failing  # type: ignore[method-assign]
            r.clock.advance(6.0)  # past the session's fence deadline (open + 5 s)
            loop_task = asyncio.ensure_future(r.parts.session._fence_loop())
            await asyncio.sleep(0.3)
            alive = not loop_task.done()
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)
            r.parts.holdings.fence_all = real  # type: ignore[method-assign]
            state = (alive, r.parts.session.state.abandoned, "a" in r.parts.holdings, calls)
            assert not alive, (f"fence loop alive={alive}, session abandoned={state[1]}, stream still held={state[2]}, "
                               f"fence attempts in 0.3 s={calls}")
            assert r.parts.session.state.abandoned and calls == 1

    arun(body())
