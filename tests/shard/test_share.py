"""A shard's share of a backlog (fleetd/shard/share.py) and the reconciler's bursts built on it."""

from __future__ import annotations

import zlib

import pytest

from fleetd.config import Config
from fleetd.shard.share import fair_share, mine_first
from tests.helpers import arun
from tests.shard.support import rig


@pytest.mark.parametrize(("backlog", "sessions", "me", "share"), [
    (700, [], "a", 700),  # alone (not even listed yet): the whole backlog
    (700, ["a"], "a", 700),
    (1500, ["a", "b", "c"], "b", 500),
    (1501, ["a", "b", "c"], "c", 501),  # rounded up: together the shares cover the backlog
    (1500, ["b", "c"], "a", 500),  # we are not listed yet (index lag): counted anyway
    (0, ["a", "b"], "a", 0),
])
def test_fair_share(backlog: int, sessions: list[str], me: str, share: int) -> None:
    assert fair_share(backlog, sessions, me) == share


def test_partitions_of_shards_that_see_the_same_sessions_are_disjoint_and_cover_everything() -> None:
    ids = [f"c{n:04d}" for n in range(3000)]
    sessions = ["t1/0/x", "t2/0/y", "t3/0/z"]
    parts = []
    for me in sessions:
        ordered = mine_first(ids, sessions, me)
        assert sorted(ordered) == ids, "every id, once"
        mine = [c for c in ordered if zlib.crc32(c.encode()) % 3 == sorted(sessions).index(me)]
        assert ordered[:len(mine)] == mine, "our partition first, in its order"
        parts.append(set(mine))
    assert set().union(*parts) == set(ids)
    assert all(not (a & b) for i, a in enumerate(parts) for b in parts[i + 1:])
    assert all(900 <= len(p) <= 1100 for p in parts), [len(p) for p in parts]


def test_alone_a_shard_claims_the_whole_backlog_in_one_burst(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            await r.open()
            await r.put_items(*(f"i{n:02d}" for n in range(60)))
            assert await r.parts.reconciler._claim_free() is False, "nothing left for another step"
            assert len(r.parts.holdings) == 60

    arun(body())


def test_with_peers_a_burst_takes_our_share_from_our_partition_first(tables: Config) -> None:
    """Three live sessions, 90 free items, room 100: the burst is ceil(90 / 3) = 30 items, and they are
    our partition's (topped up from the rest if our partition is smaller)."""
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            me = await r.open()
            await r.peer_session("peer-1")
            await r.peer_session("peer-2")
            ids = [f"i{n:02d}" for n in range(90)]
            await r.put_items(*ids)
            assert await r.parts.reconciler._claim_free() is True, "the rest is left for a later step"
            held = set(r.parts.holdings.ids())
            assert len(held) == 30
            rank = sorted([me, "peer-1", "peer-2"]).index(me)
            ours = {c for c in ids if zlib.crc32(c.encode()) % 3 == rank}
            assert (ours <= held) if len(ours) <= 30 else (held <= ours)

    arun(body())


def test_a_shared_takeover_takes_our_share_and_an_own_session_is_taken_whole(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=100) as r:
            await r.open()
            await r.peer_session("peer-1")
            await r.put_items(*(f"d{n:02d}" for n in range(60)))
            await r.peer_session("dead")
            await r.claim_as("dead", *(f"d{n:02d}" for n in range(60)))
            await r.leases.expire_session("dead")
            assert await r.parts.reconciler.take_over("dead", shared=True) is False, "the peer's part remains"
            assert len(r.parts.holdings) == 30  # ceil(60 / 2): the dead session is not live, so not counted
            assert await r.parts.reconciler.take_over("dead") is False, "grace not yet over"
            assert len(r.parts.holdings) == 60, "taken whole when not shared"

    arun(body())
