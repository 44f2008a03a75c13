"""Desired state (fleetd/shard/desired.py): what the base table says of a held stream decides, unless the read
is older than our tenure."""

from __future__ import annotations

from typing import Any

from fleetd.aws import Outcome
from fleetd.config import Config
from tests.helpers import arun
from tests.shard.support import Rig, rig, settle, wrap


async def _holding(r: Rig, *ids: str) -> str:
    me = await r.open()
    await r.put_items(*ids)
    for cid in ids:
        assert await r.parts.claimer.claim(cid) is Outcome.WON
    await settle()
    return me


def test_a_stopped_item_is_released_without_a_hint(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            me = await _holding(r, "a", "b")
            rec = r.parts.holdings.get("a")
            assert rec is not None
            rec.cursor.last_seq = 9
            await r.stop_item("a")
            await r.parts.desired.check()
            assert r.parts.holdings.ids() == ["b"] and not rec.cursor.active
            it = await r.item("a")
            assert it.lease_owner == "" and it.lease_expires_at_ms == 0 and it.last_seq == 9
            assert await r.owner("b") == me
            assert await r.queued_hints() == 0, "nobody should take a stopped stream"
            assert r.upstreams.open() == ["ws://upstream.test/b"]

    arun(body())


def test_the_quick_round_finds_stopped_items_through_the_index(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a", "b")
            await r.stop_item("b")
            await r.parts.desired._round()  # not a full sweep: the GSI query of STOPPED items still held
            assert r.parts.holdings.ids() == ["a"] and await r.owner("b") == ""

    arun(body())


def test_a_deleted_item_is_fenced(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a", "b")
            rec = r.parts.holdings.get("a")
            assert rec is not None
            await r.ddb.delete_item(TableName=r.cfg.aws.connections_table, Key={"connection_id": {"S": "a"}})
            await r.parts.desired.check()
            assert r.parts.holdings.ids() == ["b"] and not rec.cursor.active
            assert r.count("lease_lost_total", reason="deleted") == 1
            assert await r.raw("a") == {}, "a fence writes nothing"

    arun(body())


def test_an_item_taken_by_a_later_tenure_is_fenced(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a", "b", "c")
            await r.update("a", "SET lease_owner = :p ADD lease_epoch :one", p="peer", one=1)
            await r.update("b", "SET lease_owner = :p", p="peer")  # same epoch, another owner
            await r.parts.desired.check()
            assert r.parts.holdings.ids() == ["c"]
            assert r.count("lease_lost_total", reason="taken") == 2
            assert await r.owner("a") == "peer" and await r.owner("b") == "peer"

    arun(body())


def test_a_stale_read_of_a_lower_epoch_concludes_nothing(tables: Config) -> None:
    """An eventually consistent view from before our claim: stopped, another URL, another owner — ignored."""
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a")
            await r.update("a", "SET lease_epoch = :zero, desired_state = :s, ws_url = :u, lease_owner = :o",
                           zero=0, s="STOPPED", u="ws://upstream.test/elsewhere", o="")
            await r.parts.desired.check()
            assert r.parts.holdings.ids() == ["a"]
            assert r.upstreams.urls() == ["ws://upstream.test/a"], "restarted on a stale read"
            assert r.count("lease_lost_total", reason="taken") == 0
            assert r.count("lease_releases_total", result="won") == 0

    arun(body())


def test_a_new_ws_url_restarts_the_socket_on_the_same_cursor(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a", "b")
            rec = r.parts.holdings.get("a")
            assert rec is not None
            cursor = rec.cursor
            await r.update("a", "SET ws_url = :u", u="ws://upstream.test/moved")
            await r.parts.desired.check(["a"])
            await settle()
            assert sorted(r.upstreams.open()) == ["ws://upstream.test/b", "ws://upstream.test/moved"]
            assert r.parts.holdings.get("a") is rec and rec.cursor is cursor and cursor.active
            assert rec.item.ws_url == "ws://upstream.test/moved"

    arun(body())


def test_a_stream_that_changed_while_being_read_is_left_alone(tables: Config) -> None:
    """Lost and claimed again while the BatchGetItem was in flight: the answer is about the older record."""
    async def body() -> None:
        async with rig(tables) as r:
            await _holding(r, "a")

            async def reclaimed_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                await original(*args, **kwargs)
                r.parts.holdings.fence("a", "test")
                await r.update("a", "REMOVE lease_owner SET lease_expires_at_ms = :zero", zero=0)
                assert await r.parts.claimer.claim("a") is Outcome.WON
                return {"a": None}  # "deleted", as read for the first tenure

            wrap(r.leases, "desired_states", reclaimed_meanwhile)
            await r.parts.desired.check()
            assert r.parts.holdings.ids() == ["a"], "an answer about an older record fenced the newer one"
            assert r.count("lease_lost_total", reason="deleted") == 0

    arun(body())


def test_a_parked_item_given_a_valid_url_connects(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a", url="http://not-a-websocket/{cid}")
            assert await r.parts.claimer.claim("a") is Outcome.WON
            rec = r.parts.holdings.get("a")
            assert rec is not None and rec.conn is None and r.count("bad_items_total", reason="bad_url") == 1
            await r.update("a", "SET ws_url = :u", u="ws://upstream.test/fixed")  # `ctl start` with a new URL
            await r.parts.desired.check(["a"])
            await settle()
            assert r.upstreams.open() == ["ws://upstream.test/fixed"] and rec.conn is not None

    arun(body())
