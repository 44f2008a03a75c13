"""Hint intake (fleetd/shard/inbox.py): ``sort_hints()`` over a table of receives, and one poll on moto."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fleetd.aws import Outcome
from fleetd.config import Config
from fleetd.hints import Hint
from fleetd.shard.inbox import Sorted, sort_hints
from tests.helpers import arun
from tests.shard.support import rig


def start(receipt: str, *ids: str) -> Hint:
    return Hint(tuple(ids), receipt)


def dead(receipt: str, session: str) -> Hint:
    return Hint((), receipt, dead_session=session)


@dataclass(frozen=True)
class Case:
    name: str
    hints: list[Hint]
    want: Sorted
    held: frozenset[str] = field(default_factory=frozenset)
    room: int = 5
    stopping: bool = False


CASES = [
    Case("nothing received", [], Sorted()),
    Case("dead session while running: taken over by name", [dead("r1", "s1")],
         Sorted(dead=["s1"], taken=["r1"])),
    Case("dead session while stopping: requeued for peers", [dead("r1", "s1")], Sorted(requeue=["r1"]),
         stopping=True),
    Case("dead session with no room: still taken (the takeover checks room)", [dead("r1", "s1")],
         Sorted(dead=["s1"], taken=["r1"]), room=0),
    Case("all held: ours, re-read", [start("r1", "a", "b")], Sorted(ours=["a", "b"], taken=["r1"]),
         held=frozenset({"a", "b"})),
    Case("all held while stopping: ours, taken", [start("r1", "a")], Sorted(ours=["a"], taken=["r1"]),
         held=frozenset({"a"}), stopping=True),
    Case("room for all: claims", [start("r1", "a", "b")], Sorted(claims=["a", "b"], taken=["r1"])),
    Case("no room: requeued", [start("r1", "a", "b")], Sorted(requeue=["r1"]), room=0),
    Case("negative room (over capacity): requeued", [start("r1", "a")], Sorted(requeue=["r1"]), room=-2),
    Case("partial room: the rest sent on", [start("r1", "a", "b", "c")],
         Sorted(claims=["a", "b"], leftover=["c"], taken=["r1"]), room=2),
    Case("stopping: requeued", [start("r1", "a")], Sorted(requeue=["r1"]), stopping=True),
    Case("room shared across hints", [start("r1", "a", "b"), start("r2", "c", "d")],
         Sorted(claims=["a", "b", "c"], leftover=["d"], taken=["r1", "r2"]), room=3),
    Case("room used up by an earlier hint: the next requeued", [start("r1", "a", "b"), start("r2", "c")],
         Sorted(claims=["a", "b"], taken=["r1"], requeue=["r2"]), room=2),
    Case("partly held, no room: ours re-read, the rest sent on", [start("r1", "a", "b")],
         Sorted(ours=["a"], leftover=["b"], taken=["r1"]), held=frozenset({"a"}), room=0),
    Case("partly held while stopping: the rest sent on", [start("r1", "a", "b")],
         Sorted(ours=["a"], leftover=["b"], taken=["r1"]), held=frozenset({"a"}), stopping=True),
    Case("held ids take no room", [start("r1", "a", "b", "c")],
         Sorted(claims=["b", "c"], ours=["a"], taken=["r1"]), held=frozenset({"a"}), room=2),
    Case("dead and start hints together", [start("r1", "a"), dead("r2", "s1"), start("r3", "b")],
         Sorted(claims=["a"], dead=["s1"], taken=["r1", "r2"], requeue=["r3"]), room=1),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sort_hints(case: Case) -> None:
    assert sort_hints(case.hints, case.held, case.room, case.stopping) == case.want


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_receipt_is_taken_or_requeued_once(case: Case) -> None:
    got = sort_hints(case.hints, case.held, case.room, case.stopping)
    assert sorted(got.taken + got.requeue) == sorted(h.receipt for h in case.hints)
    assert len(got.claims) <= max(0, case.room) and not (case.stopping and got.claims)
    named = [cid for h in case.hints if h.receipt in got.taken for cid in h.connection_ids]
    assert sorted(got.claims + got.leftover + got.ours) == sorted(named), "an id of a taken hint was dropped"


def test_a_poll_claims_what_fits_sends_the_rest_on_and_acks(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=2) as r:
            await r.open()
            await r.put_items("a", "b", "c")
            assert await r.parts.ctx.hints.send_start(["a", "b", "c"]) == 3  # one message of three ids
            assert await r.parts.inbox._poll()
            assert sorted(r.parts.holdings.ids()) == ["a", "b"]
            assert r.count("hint_claims_total") == 2
            assert await r.hinted_ids() == ["c"], "the hint was acked and its rest sent on"

    arun(body())


def test_a_poll_while_full_of_claims_requeues_and_claims_nothing(tables: Config) -> None:
    async def body() -> None:
        async with rig(tables, capacity=1) as r:
            await r.open()
            await r.put_items("a", "b")
            assert await r.parts.claimer.claim("a") is Outcome.WON
            assert await r.parts.ctx.hints.send_start(["b"]) == 1
            assert await r.parts.inbox._poll()
            assert r.parts.holdings.ids() == ["a"]
            assert r.count("hints_total", kind="returned") == 1
            assert await r.hinted_ids() == ["b"], "visible to peers again at once"

    arun(body())
