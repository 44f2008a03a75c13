"""The lease store against the real local DynamoDB (dynalite)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetd.aws import Outcome
from fleetd.clock import ManualClock, SystemClock
from fleetd.config import Config, replace
from fleetd.lease import STARTED, Fate, LeaseStore, OffersOpen, SessionInfo
from fleetd.schema import HELD_BY_SESSION
from tests.helpers import arun, clients


async def put_item(ddb: Any, cfg: Config, cid: str, **extra: dict[str, str]) -> None:
    item = {"connection_id": {"S": cid}, "desired_state": {"S": STARTED},
            "ws_url": {"S": f"ws://127.0.0.1:1/stream/{cid}"}, "lease_expires_at_ms": {"N": "0"},
            "lease_epoch": {"N": "0"}, "last_seq": {"N": "0"}, **extra}
    await ddb.put_item(TableName=cfg.aws.connections_table, Item=item)


def store(ddb: Any, cfg: Config, clock: Any = None) -> LeaseStore:
    return LeaseStore(ddb, cfg.aws, cfg.lease, clock or SystemClock())


@pytest.mark.parametrize("mode", ["session", "item"])
def test_exactly_one_of_twenty_claimers_wins(cfg: Config, mode: str) -> None:
    cfg = replace(cfg, lease_mode=mode)

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            for trial in range(50):
                cid = f"c{trial}"
                await put_item(c.dynamodb, cfg, cid, lease_epoch={"N": str(trial)})
                results = await asyncio.gather(*(leases.claim(cid, f"s{i}") for i in range(20)))
                winners = [r for r in results if r.outcome is Outcome.WON]
                assert len(winners) == 1, f"trial {trial}: {[r.outcome for r in results]}"
                assert {r.outcome for r in results} <= {Outcome.WON, Outcome.LOST}
                item = await leases.get(cid)
                assert item is not None and winners[0].item is not None
                assert item.lease_epoch == trial + 1 == winners[0].item.lease_epoch
                assert item.lease_owner == winners[0].item.lease_owner
                if mode == "session":
                    assert item.lease_expires_at_ms == HELD_BY_SESSION

    arun(main())


def test_item_renew_release_and_free_query(cfg: Config) -> None:
    cfg = replace(cfg, lease_mode="item")
    clock = ManualClock(now_ms=SystemClock().now_ms())

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            await put_item(c.dynamodb, cfg, "a")
            assert "a" in await leases.free_items(100)
            won = await leases.claim("a", "me")
            assert won.outcome is Outcome.WON and won.item is not None
            epoch = won.item.lease_epoch
            assert "a" not in await leases.free_items(100)
            assert await leases.renew_item("a", "intruder", epoch) is Outcome.LOST
            assert await leases.renew_item("a", "me", epoch + 1) is Outcome.LOST
            assert await leases.renew_item("a", "me", epoch) is Outcome.WON
            behind = store(c.dynamodb, cfg, ManualClock(now_ms=clock.now_ms() - 2000))
            assert await behind.renew_item("a", "me", epoch) is Outcome.LOST  # an older renewal: never a rewind
            item = await leases.get("a")
            assert item is not None and item.lease_expires_at_ms == clock.now_ms() + int(cfg.lease.lease_ttl_s * 1000)
            assert (await leases.claim("a", "other")).outcome is Outcome.LOST
            assert await leases.checkpoint("a", "me", epoch, 41) is Outcome.WON
            assert await leases.release("a", "me", epoch, 42) is Outcome.WON
            assert await leases.release("a", "me", epoch, 43) is Outcome.LOST  # no longer the owner
            assert "a" in await leases.free_items(100)
            again = await leases.claim("a", "other")
            assert again.outcome is Outcome.WON and again.item is not None
            assert again.item.last_seq == 42 and again.item.lease_epoch == epoch + 1

    arun(main())


def test_expired_item_lease_is_claimable_only_after_ttl_and_skew(cfg: Config) -> None:
    cfg = replace(cfg, lease_mode="item")
    clock = ManualClock(now_ms=SystemClock().now_ms())

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            await put_item(c.dynamodb, cfg, "b")
            assert (await leases.claim("b", "old")).outcome is Outcome.WON
            clock.advance(cfg.lease.lease_ttl_s)  # expired, but still inside the skew margin
            assert (await leases.claim("b", "new")).outcome is Outcome.LOST
            clock.advance(cfg.lease.safety_margin_s + 0.01)
            assert "b" in await leases.free_items(100)
            assert (await leases.claim("b", "new")).outcome is Outcome.WON

    arun(main())


def test_a_session_that_stopped_renewing_is_announced_before_it_is_dead(cfg: Config) -> None:
    """``dead_and_dying``: one query lists the dead sessions, and says when the first one that
    stops renewing within the horizon will be dead for everyone (a live one never shows)."""
    clock = ManualClock(now_ms=SystemClock().now_ms())
    ttl_s, horizon_ms = cfg.lease.lease_ttl_s, 6_000

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            for sid in ("t/0/live", "t/0/dying"):
                assert await leases.create_session(SessionInfo(sid, "t", 0, 700)) is Outcome.WON
            expires_ms = clock.now_ms() + int(ttl_s * 1000)
            assert await leases.dead_and_dying(horizon_ms) == ([], None)
            clock.advance(ttl_s - 3)  # "dying" stopped renewing: it expires in 3 s
            assert (await leases.renew_session("t/0/live", held=0))[0] is Outcome.WON
            dead, dying_at = await leases.dead_and_dying(horizon_ms)
            assert dead == []
            assert dying_at == expires_ms + leases.skew_ms + 50  # just past what `expired` calls dead
            clock.advance(3 + cfg.lease.safety_margin_s + 0.1)
            assert (await leases.renew_session("t/0/live", held=0))[0] is Outcome.WON
            assert await leases.dead_and_dying(horizon_ms) == (["t/0/dying"], None)

    arun(main())


def test_sessions_cannot_come_back_and_dead_items_move(cfg: Config) -> None:
    clock = ManualClock(now_ms=SystemClock().now_ms())

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            assert await leases.create_session(SessionInfo("t/0/x", "t", 0, 700)) is Outcome.WON
            assert await leases.create_session(SessionInfo("t/0/x", "t", 0, 700)) is Outcome.LOST
            assert (await leases.renew_session("t/0/x", held=1))[0] is Outcome.WON
            for cid in ("d1", "d2"):
                await put_item(c.dynamodb, cfg, cid)
                assert (await leases.claim(cid, "t/0/x")).outcome is Outcome.WON
            assert sorted(await leases.items_of("t/0/x")) == ["d1", "d2"]
            assert not await leases.session_is_dead("t/0/x")
            # A peer cannot take a live session's items...
            assert (await leases.claim("d1", "peer")).outcome is Outcome.LOST
            clock.advance(cfg.lease.lease_ttl_s + 0.001)
            # ...and an expired session can never be renewed.
            assert (await leases.renew_session("t/0/x", held=2))[0] is Outcome.LOST
            clock.advance(cfg.lease.safety_margin_s)
            assert "t/0/x" in await leases.expired_sessions()
            assert await leases.session_is_dead("t/0/x")
            for cid in ("d1", "d2"):
                r = await leases.claim(cid, "peer", dead_owner="t/0/x")
                assert r.outcome is Outcome.WON and r.item is not None and r.item.lease_owner == "peer"
            assert await leases.items_of("t/0/x") == []
            # Listed for the grace period, so a claim it sent just before dying is still found...
            assert await leases.delete_dead_session("t/0/x") is Outcome.LOST
            assert "t/0/x" in await leases.expired_sessions()
            clock.advance(cfg.lease.dead_session_grace_s + cfg.lease.safety_margin_s + 0.001)
            assert await leases.delete_dead_session("t/0/x") is Outcome.WON
            assert "t/0/x" not in await leases.expired_sessions()
            assert (await leases.fate("t/0/x")).fate is Fate.GONE

    arun(main())


def test_expire_session_makes_it_dead_at_once(cfg: Config) -> None:
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            await leases.create_session(SessionInfo("t/1/y", "t", 1, 700))
            assert await leases.expire_session("t/1/y") is Outcome.WON
            assert await leases.session_is_dead("t/1/y")
            assert (await leases.renew_session("t/1/y", held=0))[0] is Outcome.LOST
            assert await leases.expire_session("t/1/nobody") is Outcome.LOST

    arun(main())


def test_a_session_ended_at_once_stays_listed_for_the_grace(cfg: Config) -> None:
    """Regression (issue 13, defect 3): ending a session set expires_at_ms = 0, so the grace counted
    from 1970 and the session could be forgotten at once; a claim it sent landing afterwards left an
    item owned by a session nobody lists.  The grace now counts from the tombstone."""
    clock = ManualClock(now_ms=SystemClock().now_ms())

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            await leases.create_session(SessionInfo("t/2/z", "t", 2, 700))
            assert await leases.expire_session("t/2/z") is Outcome.WON
            assert await leases.expire_session("t/2/z") is Outcome.LOST  # the first tombstone stands
            assert await leases.delete_dead_session("t/2/z") is Outcome.LOST
            clock.advance(cfg.lease.dead_session_grace_s)
            assert await leases.delete_dead_session("t/2/z") is Outcome.LOST
            clock.advance(cfg.lease.safety_margin_s + 0.001)
            assert await leases.delete_dead_session("t/2/z") is Outcome.WON

    arun(main())


def test_a_renewal_sent_before_expiry_cannot_revive_a_session_declared_dead(cfg: Config) -> None:
    """Regression (issue 13, defect 1): a renewal builds ``:now`` once, so an SDK retry landing after
    the session expired still passed ``expires_at_ms >= :now`` and extended a session a peer had
    already read as dead.  Death is now a tombstone, and renewals are conditioned on its absence."""
    start = SystemClock().now_ms()
    sent, peer_clock = ManualClock(now_ms=start), ManualClock(now_ms=start)

    async def main() -> None:
        async with clients(cfg) as c:
            owner, peer = store(c.dynamodb, cfg, sent), store(c.dynamodb, cfg, peer_clock)
            await owner.create_session(SessionInfo("t/3/w", "t", 3, 700))
            peer_clock.advance(cfg.lease.lease_ttl_s + cfg.lease.safety_margin_s + 0.01)
            sent.advance(cfg.lease.lease_ttl_s - 0.5)  # a renewal sent just before the expiry ...
            assert (await peer.fate("t/3/w")).fate is Fate.DEAD  # ... the peer declares it dead first
            assert (await owner.renew_session("t/3/w", held=0))[0] is Outcome.LOST  # ... then it lands
            assert (await peer.fate("t/3/w")).fate is Fate.DEAD
            assert await peer.declare_dead("t/3/w") is Outcome.LOST  # never declared twice

    arun(main())


def test_a_renewal_applied_after_a_later_one_never_sets_the_expiry_back(cfg: Config) -> None:
    """An SDK attempt of renewal A can land after renewal B: applied, it would set the expiry back to A's,
    below what B justified, and peers would declare the session dead while its owner still streams
    (sim scenario rewound_renewal).  A re-applied renewal is a no-op once a later one landed; its
    answer says RETRYABLE (the session is alive), while a re-application of the latest stays WON."""
    start = SystemClock().now_ms()
    clock = ManualClock(now_ms=start)

    async def main() -> None:
        async with clients(cfg) as c:
            owner = store(c.dynamodb, cfg, clock)
            await owner.create_session(SessionInfo("t/4/r", "t", 4, 700))
            a_clock = ManualClock(now_ms=start + 1000)  # renewal A, built 1 s after the start ...
            late = store(c.dynamodb, cfg, a_clock)
            assert (await late.renew_session("t/4/r", held=0))[0] is Outcome.WON
            clock.advance(3.0)  # ... renewal B, 2 s later, lands
            outcome, b_expires, _ = await owner.renew_session("t/4/r", held=0)
            assert outcome is Outcome.WON
            outcome, a_expires, _ = await late.renew_session("t/4/r", held=0)  # A, applied again
            assert outcome is Outcome.RETRYABLE and a_expires < b_expires
            assert (await owner.renew_session("t/4/r", held=0))[0] is Outcome.WON  # B again: same value
            record = await owner._session_record("t/4/r")
            assert record is not None and int(record["expires_at_ms"]["N"]) == b_expires

    arun(main())


def test_a_crashed_process_is_buried_with_the_session_it_had_not_reported(cfg: Config) -> None:
    """The supervisor knows the session a shard last reported; a replacement the shard opened just before
    it crashed carries the same pid and is buried too (else it waits for its TTL); a successor's is not."""
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            for sid, pid in (("t/1/reported", 70), ("t/1/unreported", 70), ("t/1/successor", 71), ("t/2/other", 70)):
                assert await leases.create_session(SessionInfo(sid, "t", int(sid[2]), 700, pid=pid)) is Outcome.WON
            assert await leases.bury_process("t/1/reported", 70) is Outcome.WON
            fates = {sid: (await leases.fate(sid)).fate
                     for sid in ("t/1/reported", "t/1/unreported", "t/1/successor", "t/2/other")}
            assert fates == {"t/1/reported": Fate.DEAD, "t/1/unreported": Fate.DEAD,
                             "t/1/successor": Fate.ALIVE, "t/2/other": Fate.ALIVE}

    arun(main())


def test_a_live_session_cannot_be_declared_dead(cfg: Config) -> None:
    clock = ManualClock(now_ms=SystemClock().now_ms())

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            await leases.create_session(SessionInfo("t/4/v", "t", 4, 700))
            clock.advance(cfg.lease.lease_ttl_s + cfg.lease.safety_margin_s - 0.1)  # expired, within the skew
            assert await leases.declare_dead("t/4/v") is Outcome.LOST
            assert (await leases.fate("t/4/v")).fate is Fate.ALIVE
            assert (await leases.fate("t/4/none")).fate is Fate.GONE

    arun(main())


def test_release_of_a_stream_that_never_wrote_keeps_no_resume_point(cfg: Config) -> None:
    """Regression (issue 13, defect 4): release wrote last_seq = 0 for an item that never had one,
    so the next owner resumed at from_seq=1 and an upstream numbering from 0 lost seq 0."""
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            await c.dynamodb.put_item(TableName=cfg.aws.connections_table, Item={
                "connection_id": {"S": "n"}, "desired_state": {"S": STARTED}, "ws_url": {"S": "ws://h/n"},
                "lease_expires_at_ms": {"N": "0"}})
            won = await leases.claim("n", "t/0/s")
            assert won.item is not None and won.item.last_seq == -1
            assert await leases.release("n", "t/0/s", won.item.lease_epoch, -1) is Outcome.WON
            item = await leases.get("n")
            assert item is not None and item.last_seq == -1 and item.lease_owner == ""

    arun(main())


def test_desired_state_of_250_ids_in_three_calls(cfg: Config) -> None:
    calls: list[str] = []

    async def main() -> None:
        async with clients(cfg) as c:
            leases = LeaseStore(c.dynamodb, cfg.aws, cfg.lease, SystemClock(),
                                on_request=lambda op, outcome: calls.append(op))
            for i in range(250):
                await put_item(c.dynamodb, cfg, f"x{i}")
            await c.dynamodb.update_item(
                TableName=cfg.aws.connections_table, Key={"connection_id": {"S": "x7"}},
                UpdateExpression="SET desired_state = :s", ExpressionAttributeValues={":s": {"S": "STOPPED"}})
            calls.clear()
            states = await leases.desired_states([f"x{i}" for i in range(250)] + ["missing"])
            assert calls.count("BatchGetItem") <= 3
            assert len(states) == 251 and states["missing"] is None
            assert all(states[f"x{i}"] is not None for i in range(250))
            assert states["x7"] is not None and states["x7"].desired_state == "STOPPED"
            assert sum(1 for s in states.values() if s and s.desired_state == STARTED) == 249

    arun(main())


@pytest.mark.parametrize("mode", ["session", "item"])
def test_stopped_held_lists_only_stopped_items_someone_holds(cfg: Config, mode: str) -> None:
    cfg = replace(cfg, lease_mode=mode)

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            for cid in ("held-stopped", "held-started", "free-stopped"):
                await put_item(c.dynamodb, cfg, cid)
            for cid in ("held-stopped", "held-started"):
                assert (await leases.claim(cid, "task/0/n")).outcome is Outcome.WON
            for cid in ("held-stopped", "free-stopped"):
                await c.dynamodb.update_item(TableName=cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                                             UpdateExpression="SET desired_state = :s",
                                             ExpressionAttributeValues={":s": {"S": "STOPPED"}})
            assert await leases.stopped_held() == ["held-stopped"]
            await leases.release("held-stopped", "task/0/n", 1, 0)
            assert await leases.stopped_held() == []

    arun(main())


def test_free_stopped_frees_only_a_dead_owners_stopped_items(cfg: Config) -> None:
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            for cid in ("stopped-dead", "started-dead", "stopped-other"):
                await put_item(c.dynamodb, cfg, cid)
                owner = "other/0/o" if cid == "stopped-other" else "dead/0/d"
                assert (await leases.claim(cid, owner)).outcome is Outcome.WON
            for cid in ("stopped-dead", "stopped-other"):
                await c.dynamodb.update_item(TableName=cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                                             UpdateExpression="SET desired_state = :s",
                                             ExpressionAttributeValues={":s": {"S": "STOPPED"}})
            assert await leases.free_stopped("stopped-dead", "dead/0/d") is Outcome.WON
            assert await leases.free_stopped("started-dead", "dead/0/d") is Outcome.LOST  # claimable instead
            assert await leases.free_stopped("stopped-other", "dead/0/d") is Outcome.LOST
            assert await leases.items_of("dead/0/d") == ["started-dead"]
            item = (await c.dynamodb.get_item(TableName=cfg.aws.connections_table,
                                              Key={"connection_id": {"S": "stopped-dead"}}))["Item"]
            assert "lease_owner" not in item and item["lease_expires_at_ms"] == {"N": "0"}

    arun(main())


def test_bad_table_is_fatal_not_an_exception(cfg: Config) -> None:
    broken = replace(cfg, connections_table="no-such-table")

    async def main() -> None:
        async with clients(broken) as c:
            leases = store(c.dynamodb, broken)
            r = await leases.claim("z", "me")
            assert r.outcome is Outcome.FATAL

    arun(main())


def proxied_store(cfg: Config, calls: list[str] | None = None):
    """A LeaseStore whose DynamoDB traffic goes through a FaultProxy in front of dynalite."""
    import os
    from contextlib import asynccontextmanager

    from bench.faults.proxy import FaultProxy, client_via

    @asynccontextmanager
    async def ctx():
        proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL_DYNAMODB"], seed=7)
        url = await proxy.start()
        try:
            async with client_via(cfg.aws, "dynamodb", url) as ddb:
                hook = (lambda op, outcome: calls.append(op)) if calls is not None else (lambda op, outcome: None)
                yield proxy, ddb, LeaseStore(ddb, cfg.aws, cfg.lease, SystemClock(), on_request=hook)
        finally:
            await proxy.stop()

    return ctx()


def test_desired_states_survive_unprocessed_keys(cfg: Config) -> None:
    calls: list[str] = []

    async def main() -> None:
        async with proxied_store(cfg, calls) as (proxy, ddb, leases):
            for i in range(250):
                await put_item(ddb, cfg, f"u{i}")
            rule = proxy.add("BatchGetItem", "unprocessed", count=6)
            states = await leases.desired_states([f"u{i}" for i in range(250)])
            assert rule.fired >= 3, "the proxy must really have answered with UnprocessedKeys"
            assert all(states[f"u{i}"] is not None for i in range(250))
            assert calls.count("BatchGetItem") > 3  # the unprocessed halves were asked for again

    arun(main())


@pytest.mark.parametrize("mode", ["500", "reset"])
def test_claim_whose_response_was_lost_is_reported_won(cfg: Config, mode: str) -> None:
    async def main() -> None:
        async with proxied_store(cfg) as (proxy, ddb, leases):
            await put_item(ddb, cfg, "amb")
            # The first attempt reaches the server and succeeds; its answer is lost.  The SDK's
            # retry then fails its condition (we already own it): the store must see it was a win.
            rule = proxy.add("UpdateItem", "drop_response", count=1, mode=mode)
            result = await leases.claim("amb", "me")
            assert rule.fired == 1
            assert result.outcome is Outcome.WON and result.item is not None
            assert result.item.lease_owner == "me" and result.item.lease_epoch == 1
            # A plain lost race is still LOST.
            assert (await leases.claim("amb", "other")).outcome is Outcome.LOST

    arun(main())


def test_live_loads_samples_live_sessions_with_their_load(cfg: Config) -> None:
    clock = ManualClock()

    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg, clock)
            for i in range(12):
                assert await leases.create_session(SessionInfo(f"t/{i}/s", "t", i, 100 + i)) is Outcome.WON
                assert (await leases.renew_session(f"t/{i}/s", held=i))[0] is Outcome.WON
            assert await leases.expire_session("t/0/s") is Outcome.WON
            assert await leases.mark_draining("t/1/s") is Outcome.WON
            loads = await leases.live_loads(sample=50)
            assert sorted(x.session_id for x in loads) == sorted(f"t/{i}/s" for i in range(1, 12))
            by_id = {x.session_id: x for x in loads}
            assert by_id["t/5/s"].held == 5 and by_id["t/5/s"].capacity == 105 and not by_id["t/5/s"].draining
            assert by_id["t/1/s"].draining
            assert len(await leases.live_loads(sample=4)) == 4
            clock.advance(cfg.lease.lease_ttl_s)
            assert await leases.live_loads(sample=50) == []  # nobody renewed

    arun(main())


def test_push_hands_an_item_to_another_session_in_one_write(cfg: Config) -> None:
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            for cid in ("p1", "p2"):
                await put_item(c.dynamodb, cfg, cid)
            r = await leases.claim("p1", "a/0/x")
            assert r.item is not None
            epoch = r.item.lease_epoch
            assert await leases.push("p1", "a/0/x", epoch + 1, 7, "b/0/y") is Outcome.LOST  # a stale epoch
            assert await leases.push("p1", "b/0/y", epoch, 7, "c/0/z") is Outcome.LOST  # not the owner
            assert await leases.push("p1", "a/0/x", epoch, 7, "b/0/y") is Outcome.WON
            assert await leases.items_of("b/0/y") == ["p1"]
            # The new owner adopts it with a claim conditioned on being its owner; nobody else can take it.
            assert (await leases.claim("p1", "c/0/z")).outcome is Outcome.LOST
            got = await leases.claim("p1", "b/0/y", dead_owner="b/0/y")
            assert got.outcome is Outcome.WON and got.item is not None
            assert got.item.last_seq == 7 and got.item.lease_epoch == epoch + 2
            # A stopped item is not handed over: it is released by its owner instead.
            r2 = await leases.claim("p2", "a/0/x")
            assert r2.item is not None
            await c.dynamodb.update_item(TableName=cfg.aws.connections_table, Key={"connection_id": {"S": "p2"}},
                                         UpdateExpression="SET desired_state = :s",
                                         ExpressionAttributeValues={":s": {"S": "STOPPED"}})
            assert await leases.push("p2", "a/0/x", r2.item.lease_epoch, 0, "b/0/y") is Outcome.LOST
            assert await leases.disown("p2", "b/0/y") is Outcome.LOST
            assert await leases.disown("p2", "a/0/x") is Outcome.WON
            assert await leases.items_of("a/0/x") == []

    arun(main())


def test_renewals_read_how_often_the_session_was_handed_streams(cfg: Config) -> None:
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            assert await leases.create_session(SessionInfo("t/0/h", "t", 0, 100)) is Outcome.WON
            assert (await leases.renew_session("t/0/h", held=0))[2] == 0
            assert await leases.notify_handed("t/0/h") is Outcome.WON
            assert (await leases.renew_session("t/0/h", held=0))[2] == 1
            # Read, not taken: a renewal whose answer was lost, retried, still sees it.
            assert (await leases.renew_session("t/0/h", held=0))[2] == 1
            assert await leases.notify_handed("t/0/h") is Outcome.WON
            assert (await leases.renew_session("t/0/h", held=0))[2] == 2
            assert await leases.expire_session("t/0/h") is Outcome.WON
            assert await leases.notify_handed("t/0/h") is Outcome.LOST  # nobody left to tell
            assert await leases.notify_handed("t/0/nobody") is Outcome.LOST

    arun(main())


def test_an_offer_is_taken_once_by_owner_and_epoch_and_only_after_the_offering_mark(cfg: Config) -> None:
    """The SIGTERM hand-over: a session's offers are open only once it wrote its offering mark with their
    token (or died: then without the offer's resume point); a take is one write conditioned on the
    offering owner and epoch, which records the offer's last_seq, so a second delivery of the offer, or
    one for an older epoch, takes nothing."""
    async def main() -> None:
        async with clients(cfg) as c:
            leases = store(c.dynamodb, cfg)
            await put_item(c.dynamodb, cfg, "o")
            await leases.create_session(SessionInfo("t/5/a", "t", 5, 700))
            won = await leases.claim("o", "t/5/a")
            assert won.outcome is Outcome.WON and won.item is not None
            epoch = won.item.lease_epoch
            assert await leases.offers_open("t/5/a", "k") is OffersOpen.NO  # still streaming: take nothing
            assert await leases.mark_offering("t/5/a", "k") is Outcome.WON
            assert await leases.offers_open("t/5/a", "k") is OffersOpen.WITH_SEQ
            assert await leases.offers_open("t/5/a", "forged") is OffersOpen.NO
            assert (await leases.take("o", "t/6/b", "t/5/a", epoch - 1, 40)).outcome is Outcome.LOST
            taken = await leases.take("o", "t/6/b", "t/5/a", epoch, 41)
            assert taken.outcome is Outcome.WON and taken.item is not None
            assert (taken.item.lease_owner, taken.item.lease_epoch, taken.item.last_seq) == ("t/6/b", epoch + 1, 41)
            assert (await leases.take("o", "t/7/c", "t/5/a", epoch, 41)).outcome is Outcome.LOST  # delivered twice
            assert await leases.release("o", "t/5/a", epoch, 41) is Outcome.LOST  # the stopper's fallback too
            await leases.expire_session("t/5/a")
            assert await leases.mark_offering("t/5/a", "k2") is Outcome.LOST  # a dead session marks nothing
            assert await leases.offers_open("t/5/a", "k") is OffersOpen.WITH_SEQ  # its own offers stay good
            assert await leases.offers_open("t/5/a", "forged") is OffersOpen.DEAD  # others: no resume point
            assert await leases.offers_open("t/9/nobody", "k") is OffersOpen.NO

    arun(main())
