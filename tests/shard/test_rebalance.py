"""Rebalancing (fleetd/shard/rebalance.py): ``plan()`` over a table of fleets, and one hand-over on dynalite."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleetd.aws import Outcome
from fleetd.config import Config
from fleetd.lease import SessionLoad
from fleetd.shard.rebalance import Plan, plan
from tests.helpers import arun
from tests.shard.support import rig

SETTLED = 1_000  # settled_before_ms: a peer started after it is still booting


def peer(sid: str, held: int, capacity: int = 10, draining: bool = False, started: int = 0) -> SessionLoad:
    return SessionLoad(sid, held, capacity, draining, started)


@dataclass(frozen=True)
class Case:
    name: str
    held: int
    loads: list[SessionLoad]
    want: Plan
    capacity: int = 10
    tolerance: float = 0.1
    max_moves: int = 200
    me: str = "me"


CASES = [
    Case("no peers", 10, [], Plan(below_share=False)),
    Case("only ourselves listed", 10, [peer("me", 10)], Plan(below_share=False)),
    Case("within the band", 5, [peer("a", 5)], Plan(below_share=False)),
    Case("above the share but inside a wide band", 6, [peer("a", 4)], Plan(below_share=False), tolerance=0.25),
    Case("below our share: peers may hand us streams", 2, [peer("a", 8)], Plan(below_share=True)),
    # share 0.5, load 1.0, target 0: up to the share (5), the target's room (5)
    Case("above the band, one empty peer", 10, [peer("a", 0)], Plan(False, "a", 5)),
    Case("the emptiest peer is the target", 10, [peer("a", 4), peer("b", 0), peer("c", 3)],
         Plan(False, "b", 4)),  # share 17/40: b's room is 4
    # share 200/300: us and a are over the band; b's room (33) is split between the two of us → 17
    Case("several over the band split the target's room", 100,
         [peer("a", 100, capacity=100), peer("b", 0, capacity=50), peer("c", 0, capacity=50)],
         Plan(False, "b", 17), capacity=100),
    Case("the target is not below the band", 10, [peer(f"p{i}", 7) for i in range(9)], Plan(below_share=False)),
    Case("a draining peer is left out", 10, [peer("a", 0, draining=True)], Plan(below_share=False)),
    Case("a booting peer is left out", 10, [peer("a", 0, started=SETTLED + 1)], Plan(below_share=False)),
    Case("a peer settled just in time counts", 10, [peer("a", 0, started=SETTLED)], Plan(False, "a", 5)),
    Case("a peer without capacity is left out", 10, [peer("a", 0, capacity=0)], Plan(below_share=False)),
    Case("draining and booting peers are not targets", 10,
         [peer("d", 0, draining=True), peer("b", 0, started=SETTLED + 1), peer("a", 2)], Plan(False, "a", 4)),
    Case("max_moves caps a move", 10, [peer("a", 0)], Plan(False, "a", 2), max_moves=2),
    Case("capacities differ: shares are proportional", 30, [peer("a", 0, capacity=10)],
         Plan(False, "a", 7), capacity=30),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case) -> None:
    got = plan(case.me, case.held, case.capacity, case.loads, SETTLED, case.tolerance, case.max_moves)
    assert got == case.want


def test_plan_never_moves_below_the_share_or_past_the_targets_share() -> None:
    """Every fleet of a few peers: after the move we are not below our share, nor the target above it."""
    for held in range(0, 21):
        for a in range(0, 11):
            for b in range(0, 11):
                loads = [peer("a", a), peer("b", b, capacity=10)]
                p = plan("me", held, 20, loads, SETTLED, 0.1, 200)
                if p.n == 0:
                    continue
                share = (held + a + b) / 40
                target = {"a": a, "b": b}[p.to]
                assert held - p.n >= share * 20 - 1e-9, (held, a, b, p)
                assert target + p.n <= share * 10 + 1e-9, (held, a, b, p)


def test_hand_over_pushes_streams_to_the_peer_and_marks_it_handed(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables) as r:
            await r.open()
            ids = ["a", "b", "c", "d"]
            await r.put_items(*ids)
            for cid in ids:
                assert await r.parts.claimer.claim(cid) is Outcome.WON
            a = r.parts.holdings.get("a")
            assert a is not None
            a.cursor.last_seq = 30
            await r.peer_session("peer")
            await r.parts.rebalancer.hand_over("peer", 3)
            moved = [cid for cid in ids if cid not in r.parts.holdings]
            assert len(moved) == 3 and len(r.parts.holdings) == 1
            for cid in moved:
                it = await r.item(cid)
                assert it.lease_owner == "peer" and it.lease_epoch == 2
            if "a" in moved:
                assert (await r.item("a")).last_seq == 30, "the receiver resumes from the final last_seq"
            assert r.count("rebalance_moves_total", result="won") == 3
            rec = await r.session_record("peer")
            assert rec["handed_count"]["N"] == "1"
            assert await r.queued_hints() == 0, "pushed streams are not hinted"

    arun(body())
