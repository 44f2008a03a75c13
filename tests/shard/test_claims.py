"""The claimer (fleetd/shard/claims.py): a win is streamed only under the generation it was sent in.

``leases.claim`` is wrapped to act between the claim's send and its answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fleetd.aws import Outcome
from fleetd.config import Config
from fleetd.shard.claims import UNCLAIMABLE_RETRY_S
from tests.helpers import arun
from tests.shard.support import Rig, rig, wrap


def test_a_won_claim_is_adopted(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            me = await r.open()
            await r.put_items("a")
            assert await r.parts.claimer.claim("a", source="hint") is Outcome.WON
            assert "a" in r.parts.holdings
            it = await r.item("a")
            assert it.lease_owner == me and it.lease_epoch == 1
            assert r.count("lease_claims_total", result="won") == 1 and r.count("hint_claims_total") == 1

    arun(body())


def test_a_claim_of_an_item_a_live_peer_owns_is_lost(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a", "stopped")
            await r.peer_session("peer")
            await r.claim_as("peer", "a")
            await r.stop_item("stopped")
            assert await r.parts.claimer.claim("a") is Outcome.LOST
            assert await r.parts.claimer.claim("stopped") is Outcome.LOST
            assert len(r.parts.holdings) == 0 and await r.owner("a") == "peer"

    arun(body())


async def _holding_b(r: Rig) -> None:
    assert await r.parts.claimer.claim("b") is Outcome.WON


async def _past_deadline(r: Rig) -> None:
    r.clock.advance(5.0)


async def _abandoned(r: Rig) -> None:
    r.parts.session.abandon_now("test")


async def _stopping(r: Rig) -> None:
    r.parts.ctx.stopping.set()


_PINNED: list[object] = []


async def _in_flight(r: Rig) -> None:
    slot = r.parts.holdings.claiming("a")
    slot.__enter__()  # never exited: a claim of it stays in flight
    _PINNED.append(slot)  # (collected, the context manager would exit and free the slot)


@pytest.mark.parametrize(("case", "before", "cid", "capacity"), [
    ("held already", _holding_b, "b", 5),
    ("a claim of it in flight", _in_flight, "a", 5),
    ("no room", _holding_b, "a", 1),
    ("session past its deadline", _past_deadline, "a", 5),
    ("session abandoned", _abandoned, "a", 5),
    ("stopping", _stopping, "a", 5),
])
def test_not_tried_returns_none_and_writes_nothing(tables: Config, case: str, before: Callable[[Rig], Awaitable[None]],
                                                   cid: str, capacity: int) -> None:
    async def body() -> None:
        async with rig(tables, capacity=capacity) as r:
            await r.open()
            await r.put_items("a", "b")
            await before(r)
            sent: list[str] = []

            async def record(original: Any, *args: Any, **kwargs: Any) -> Any:
                sent.append(args[0])
                return await original(*args, **kwargs)

            wrap(r.leases, "claim", record)
            assert await r.parts.claimer.claim(cid) is None, case
            assert sent == [], f"{case}: a claim was sent"
            assert cid == "b" or await r.owner("a") == ""

    arun(body())


def test_a_win_answered_after_the_session_was_abandoned_is_disowned(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            me = await r.open()
            await r.put_items("a")

            async def abandoned_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                assert answer.outcome is Outcome.WON
                r.parts.session.abandon_now("test")
                return answer

            wrap(r.leases, "claim", abandoned_meanwhile)
            assert await r.parts.claimer.claim("a") is Outcome.LOST
            assert "a" not in r.parts.holdings and r.upstreams.sockets == []
            it = await r.item("a")
            assert it.lease_owner == "" and it.lease_expires_at_ms == 0, f"left to the abandoned {me}"
            assert it.lease_epoch == 1, "disowned, not re-claimed"
            assert r.count("lease_claims_orphaned_total") == 1
            assert await r.hinted_ids() == ["a"], "a peer is told it is free"

    arun(body())


def test_a_win_answered_after_a_replacement_is_disowned_by_the_old_session(tables: Config) -> None:
    """The claim was sent under session n1; n2 is live when it wins: the item is freed, not adopted by n2."""
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("a")

            async def replaced_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                await r.parts.session.replace("test")
                return answer

            wrap(r.leases, "claim", replaced_meanwhile)
            assert await r.parts.claimer.claim("a") is Outcome.LOST
            assert r.me == "task/0/n2" and r.parts.session.may_claim()
            assert "a" not in r.parts.holdings and await r.owner("a") == ""
            assert r.count("lease_claims_orphaned_total") == 1

    arun(body())


def test_a_late_disown_does_not_free_a_later_tenure(tables: Config) -> None:
    """Between the late win and its disown a peer took the item (epoch + 1): the disown must not free it."""
    async def body() -> None:
        async with rig(tables) as r:
            old = await r.open()
            await r.put_items("a")

            async def taken_meanwhile(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                r.parts.session.abandon_now("test")
                # The abandoned session's item, taken over with its owner unchanged (same owner, epoch 2).
                await r.update("a", "ADD lease_epoch :one", one=1)
                return answer

            wrap(r.leases, "claim", taken_meanwhile)
            assert await r.parts.claimer.claim("a") is Outcome.LOST
            it = await r.item("a")
            assert it.lease_owner == old and it.lease_epoch == 2, "a later tenure was freed"

    arun(body())


def test_item_mode_a_win_answered_past_its_own_fence_deadline_is_disowned(tables: Config) -> None:
    """Sent at 3 (its lease's deadline 8); the session is renewed meanwhile (live to 12); answered at 8.5."""
    async def body() -> None:
        async with rig(tables, lease_mode="item") as r:
            await r.open()
            await r.put_items("a")
            r.clock.advance(3.0)
            assert await r.parts.session.renew()  # live to 8

            async def slow(original: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(*args, **kwargs)
                r.clock.advance(4.0)
                assert await r.parts.session.renew()
                r.clock.advance(1.5)
                return answer

            wrap(r.leases, "claim", slow)
            assert r.parts.session.may_claim()
            assert await r.parts.claimer.claim("a") is Outcome.LOST
            assert r.parts.session.may_claim() and "a" not in r.parts.holdings
            assert await r.owner("a") == ""
            assert r.count("lease_claims_orphaned_total") == 1

    arun(body())


def test_an_unclaimable_item_is_skipped_then_tried_again(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            await r.put_items("bad")
            await r.update("bad", "SET lease_epoch = :x", x="not a number")
            calls: list[str] = []

            async def count(original: Any, *args: Any, **kwargs: Any) -> Any:
                calls.append(args[0])
                return await original(*args, **kwargs)

            wrap(r.leases, "claim", count)
            assert await r.parts.claimer.claim("bad") is Outcome.FATAL
            assert r.parts.claimer.skipped("bad") and r.count("bad_items_total", reason="unclaimable") == 1
            assert await r.parts.claimer.claim("bad") is None and calls == ["bad"]
            r.clock.advance(UNCLAIMABLE_RETRY_S - 1)
            assert r.parts.claimer.skipped("bad")
            r.clock.advance(1)
            assert not r.parts.claimer.skipped("bad")
            await r.parts.session.replace("test")  # a live session again, five minutes on
            assert await r.parts.claimer.claim("bad") is Outcome.FATAL and calls == ["bad", "bad"]
            assert r.count("bad_items_total", reason="unclaimable") == 1, "counted once"

    arun(body())
