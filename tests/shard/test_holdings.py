"""Holdings (fleetd/shard/holdings.py): the held streams, their sockets and their sink cursors move together.

Rule under test: a stream is in ``held`` exactly while its cursor is active and its socket open; every
exit fences both.  Sockets are the fakes of ``support.Upstreams``.
"""

from __future__ import annotations

import asyncio

import pytest

from fleetd.aws import Outcome
from fleetd.config import Config
from fleetd.lease import ClaimResult, ConnItem
from fleetd.shard.holdings import Held, Holdings, resume_point
from fleetd.tracing import Attr
from tests.helpers import arun
from tests.shard.support import Recorder, Rig, rig, settle


def item(cid: str, epoch: int = 1, url: str = "ws://upstream.test/x", last_seq: int = -1) -> ConnItem:
    return ConnItem(cid, url, "STARTED", "", epoch, 0, last_seq)


def won(it: ConnItem | None, sent_at: float = 0.0) -> ClaimResult:
    return ClaimResult(Outcome.WON, it, sent_at=sent_at)


def consistent(h: Holdings, records: dict[str, Held]) -> None:
    """Held ⇔ its cursor active and its socket not being closed."""
    for cid, rec in records.items():
        held = h.get(cid) is rec
        assert rec.cursor.active is held, (cid, held, rec.cursor)
        if rec.conn is not None:
            assert rec.conn.closing is not held, (cid, held)


@pytest.mark.parametrize(("last_seq", "epoch", "expected"), [
    (41, 3, 41),  # a checkpoint: resume after it
    (-1, 1, None),  # a first tenure that never wrote: no from_seq (SPEC §5)
    (-1, 0, None),
    (-1, 2, -1),  # owned before, never checkpointed: ask for everything (from_seq=0)
    (0, 5, 0),
])
def test_resume_point(last_seq: int, epoch: int, expected: int | None) -> None:
    assert resume_point(item("c", epoch=epoch, last_seq=last_seq)) == expected


def test_adopt_lose_forget_fence_all_keep_held_and_cursors_consistent(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            h = r.parts.holdings
            for cid in "abcd":
                h.adopt(cid, won(item(cid, epoch=2, last_seq=7)))
            records = {cid: rec for cid, rec in h.entries()}
            await settle()
            assert sorted(h.ids()) == list("abcd") and len(r.upstreams.open()) == 4
            assert all(rec.cursor.lease_epoch == 2 and rec.cursor.last_seq == 7 for rec in records.values())
            consistent(h, records)

            h.fence("a", "test")
            assert "a" not in h and r.count("lease_lost_total", reason="test") == 1
            h.fence("a", "test")  # not held: nothing happens, nothing counted
            assert r.count("lease_lost_total", reason="test") == 1
            consistent(h, records)

            h.forget("b", records["b"], "released")
            assert "b" not in h
            consistent(h, records)

            # A stale record (the stream was lost and claimed again meanwhile) never drops the newer one.
            h.fence("c", "test")
            h.adopt("c", won(item("c", epoch=3)))
            newer = h.get("c")
            assert newer is not None
            h.forget("c", records["c"], "released")
            assert h.get("c") is newer and newer.cursor.active
            records["c2"] = newer

            h.fence_all("all")
            assert len(h) == 0 and r.count("lease_lost_total", reason="all") == 2  # c (newer) and d
            consistent(h, records)
            await settle()
            assert r.upstreams.open() == []

    arun(body())


def test_unreadable_and_bad_url_items_are_held_parked(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            h = r.parts.holdings
            h.adopt("unreadable", won(None))
            h.adopt("badurl", won(item("badurl", url="http://not-a-ws-url/")))
            await settle()
            assert r.upstreams.sockets == [], "a parked stream opens no socket"
            for cid in ("unreadable", "badurl"):
                rec = h.get(cid)
                assert rec is not None and rec.conn is None and rec.cursor.active
            assert h.connected() == 0 and len(h) == 2
            assert r.count("bad_items_total", reason="unparseable") == 1
            assert r.count("bad_items_total", reason="bad_url") == 1
            parked = h.get("unreadable")
            assert parked is not None
            h.fence("unreadable", "test")
            assert not parked.cursor.active, "a parked stream's cursor is fenced too"

    arun(body())


def test_claiming_slots_count_against_capacity(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=3) as r:
            h = r.parts.holdings
            h.adopt("a", won(item("a")))
            with h.claiming("b"):
                assert h.busy("b") and not h.busy("c") and h.free_capacity() == 1
            assert not h.busy("b") and h.free_capacity() == 2

    arun(body())


def test_may_write_only_a_held_streams_current_cursor_under_a_live_session(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            h = r.parts.holdings
            h.adopt("a", won(item("a")))
            h.adopt("b", won(item("b")))
            a, b = h.get("a"), h.get("b")
            assert a is not None and b is not None
            assert h.may_write(a.cursor) and h.may_write(b.cursor)

            h.forget("b", b, "released")
            assert not h.may_write(b.cursor)
            h.fence("a", "test")
            h.adopt("a", won(item("a", epoch=2)))
            assert not h.may_write(a.cursor), "the cursor of an earlier tenure"
            newer = h.get("a")
            assert newer is not None and h.may_write(newer.cursor)

            r.clock.advance(5.0)  # the session's fence deadline
            assert not h.may_write(newer.cursor)
            assert len(h) == 0 and not newer.cursor.active, "past the deadline the session is given up"

    arun(body())


def test_item_mode_may_write_refuses_past_the_items_own_deadline(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, lease_mode="item") as r:
            await r.open()
            h = r.parts.holdings
            h.adopt("a", won(item("a"), sent_at=0.0))  # its fence deadline: 5
            r.clock.advance(3.0)
            assert await r.parts.session.renew()  # the session lives to 8
            h.adopt("b", won(item("b"), sent_at=r.clock.monotonic()))  # deadline 8
            r.clock.advance(2.0)
            a, b = h.get("a"), h.get("b")
            assert a is not None and b is not None
            assert not h.may_write(a.cursor)
            assert "a" not in h and not a.cursor.active
            assert r.count("lease_lost_total", reason="send_deadline") == 1
            assert h.may_write(b.cursor), "the other item and the session are within their deadlines"

    arun(body())


async def _connected(r: Rig, cid: str) -> Held:
    r.parts.holdings.adopt(cid, won(item(cid, url="ws://upstream.test/old", last_seq=4)))
    await settle()
    rec = r.parts.holdings.get(cid)
    assert rec is not None and rec.conn is not None and rec.conn.connected
    return rec


def test_restart_reconnects_to_the_new_url_on_the_same_cursor(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            rec = await _connected(r, "a")
            cursor, old = rec.cursor, rec.conn
            await r.parts.holdings.restart("a", rec, item("a", url="ws://upstream.test/new", last_seq=4))
            await settle()
            assert r.upstreams.urls()[0] == "ws://upstream.test/old?from_seq=5"
            assert r.upstreams.open() == ["ws://upstream.test/new?from_seq=5"]
            assert rec.cursor is cursor and rec.conn is not old and cursor.active
            assert rec.item.ws_url == "ws://upstream.test/new"

    arun(body())


@pytest.mark.parametrize("exit_", ["lose", "forget", "releasing"])
def test_restart_opens_no_socket_for_a_stream_that_left_during_the_close(tables: Config, exit_: str) -> None:
    """The old socket's CLOSE is not echoed until the test says so; meanwhile the stream is fenced,
    handed on, or starts being released: the restart must not connect it again."""
    async def body() -> None:
        async with rig(tables, echo_close=False) as r:
            await r.open()
            h = r.parts.holdings
            rec = await _connected(r, "a")
            restart = asyncio.ensure_future(h.restart("a", rec, item("a", url="ws://upstream.test/new")))
            await settle()
            sock = r.upstreams.sockets[0]
            assert sock.is_close_frame_sent and not restart.done()
            if exit_ == "lose":
                h.fence("a", "test")
            elif exit_ == "forget":
                h.forget("a", rec, "released")
            else:
                rec.releasing = True
            sock.disconnect()  # the echo
            await restart
            await settle()
            assert r.upstreams.urls() == ["ws://upstream.test/old?from_seq=5"], "reopened for a stream that left"
            if exit_ != "releasing":
                assert not rec.cursor.active

    arun(body())


def test_overlapping_restarts_open_one_socket(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, echo_close=False) as r:
            await r.open()
            h = r.parts.holdings
            rec = await _connected(r, "a")
            new = item("a", url="ws://upstream.test/new")
            first = asyncio.ensure_future(h.restart("a", rec, new))
            await settle()
            await h.restart("a", rec, new)  # returns at once: one restart at a time
            r.upstreams.sockets[0].disconnect()
            await first
            await settle()
            assert len(r.upstreams.urls()) == 2 and len(r.upstreams.open()) == 1

    arun(body())


def test_release_frees_the_items_records_last_seq_and_hints(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            me = await r.open()
            await r.put_items("a", "b", "keep")
            for cid in ("a", "b", "keep"):
                assert await r.parts.claimer.claim(cid) is Outcome.WON
            h = r.parts.holdings
            a = h.get("a")
            assert a is not None
            a.cursor.last_seq = 12  # as if the sink had made seqs up to 12 durable
            records = {cid: rec for cid, rec in h.entries()}
            await h.release(["a", "b"], hint=True)
            assert h.ids() == ["keep"]
            consistent(h, records)
            for cid, seq in (("a", 12), ("b", -1)):
                it = await r.item(cid)
                assert it.lease_owner == "" and it.lease_expires_at_ms == 0 and it.last_seq == seq
            assert await r.owner("keep") == me
            assert r.count("lease_releases_total", result="won") == 2
            assert await r.hinted_ids() == ["a", "b"]

    arun(body())


def test_release_of_a_stream_taken_meanwhile_does_not_free_it(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a")
            assert await r.parts.claimer.claim("a") is Outcome.WON
            await r.peer_session("peer")
            await r.update("a", "SET lease_owner = :p ADD lease_epoch :one", p="peer", one=1)
            await r.parts.holdings.release(["a"], hint=True)
            assert "a" not in r.parts.holdings
            assert await r.owner("a") == "peer"
            assert r.count("lease_releases_total", result="lost") == 1
            assert await r.queued_hints() == 0, "a stream we did not free is not hinted"

    arun(body())


def test_every_way_in_and_out_of_held_begins_and_ends_exactly_one_tenure(tables: Config) -> None:
    """The tenures the tracer is told of (fleetd.tracing): one per record, begun by ``adopt`` with the
    lease it was claimed at, ended by whatever removed the record, with why."""
    async def body() -> None:
        rec = Recorder()
        async with rig(tables, echo_close=True, tracer=rec) as r:
            me = await r.open()
            h = r.parts.holdings
            await r.put_items("claimed", "stopped")
            assert await r.parts.claimer.claim("claimed", source="hint") is Outcome.WON
            assert await r.parts.claimer.claim("stopped") is Outcome.WON
            for cid in ("self", "taken", "handed", "moved", "left"):
                h.adopt(cid, won(item(cid, epoch=3, last_seq=9)))
            await settle()
            (claimed,) = rec.of("claimed")
            assert (claimed.session_id, claimed.epoch, claimed.resume_seq) == (me, 1, None)
            assert claimed.attrs == {"source": "hint"}
            (left,) = rec.of("left")
            assert (left.epoch, left.resume_seq, left.attrs) == (3, 9, {"source": "reconcile"})

            h.fence("self", "self_fence")
            h.fence("taken", "taken")
            handed = h.get("handed")
            assert handed is not None
            handed.cursor.last_seq = 15
            h.forget("handed", handed, "handed_over", handed_to="peer/0/x")
            await h.release(["claimed"], hint=False, reason="shutdown")
            await h.release(["stopped"], hint=False, reason="stopped")
            moved = h.get("moved")
            assert moved is not None
            await h.restart("moved", moved, item("moved", epoch=3, url="ws://upstream.test/new"))
            h.fence_remaining()  # "moved" and "left" are still held: shutdown out of time
            left_rec = h.get("left")
            assert left_rec is not None
            h.forget("left", left_rec, "released")  # after the fact: the tenure has ended already

            def first_end(cid: str) -> tuple[str, dict[str, Attr]]:
                (t,) = rec.of(cid)
                return t.ends[0]

            assert first_end("self") == ("fenced", {"last_seq": 9, "fence_reason": "self_fence"})
            assert rec.of("self")[0].events == [("self_fence", {"reason": "self_fence"})]
            assert first_end("taken") == ("fenced", {"last_seq": 9, "fence_reason": "taken"})
            assert rec.of("taken")[0].events == [], "a lease known lost is no self-fence"
            assert first_end("handed") == ("handed_over", {"last_seq": 15, "handed_to": "peer/0/x"})
            assert first_end("claimed") == ("shutdown", {"last_seq": -1, "release_result": "won"})
            assert first_end("stopped") == ("stopped", {"last_seq": -1, "release_result": "won"})
            assert rec.of("moved")[0].events == [("restart", {})]
            assert first_end("moved") == ("unreleased", {"last_seq": 9})
            assert first_end("left") == ("unreleased", {"last_seq": 9})
            once = [t.connection_id for t in rec.tenures if len(t.ends) != 1]
            assert once == ["left"], f"ended more than once, or never: {once}"
            assert len(rec.tenures) == 7

    arun(body())


def test_a_session_given_up_ends_every_tenure_as_a_self_fence_and_a_takeover_names_its_dead_session(
        tables: Config) -> None:
    async def body() -> None:
        rec = Recorder()
        async with rig(tables, tracer=rec) as r:
            await r.open()
            await r.put_items("x", "y")
            await r.claim_as("dead/0/z", "x")
            assert await r.parts.claimer.claim("x", dead_owner="dead/0/z") is Outcome.WON
            assert await r.parts.claimer.claim("y") is Outcome.WON
            assert rec.of("x")[0].attrs == {"source": "reconcile", "taken_from": "dead/0/z"}
            assert rec.of("x")[0].epoch == 2, "the dead session's claim, then ours"
            assert r.parts.session.abandon_now("self_fence") is not None
            for cid in "xy":
                (t,) = rec.of(cid)
                assert t.events == [("self_fence", {"reason": "self_fence"})]
                assert [reason for reason, _ in t.ends] == ["fenced"]

    arun(body())
