"""Shard runtime against the local stack and the fake upstream (issue: shard runtime).

Process tests run ``python -m fleetd shard`` and send it real signals; a few tests
run the shard in a thread of this process so they can read its counters directly.
Timings are the fast profile of :mod:`bench.profile` (TTL 6 s, heartbeat 1 s, margin 1 s, reconcile 1 s).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from bench import profile
from fleetd import cli, config
from fleetd.config import Config
from fleetd.devstack import DevStack
from fleetd.schema import HELD_BY_SESSION, SESSION_KIND
from tests.fleet import (
    FleetdProc,
    ShardThread,
    UpstreamProc,
    audit,
    ddb,
    owners,
    seed_items,
    start_shard,
    stop_all,
    wait_for,
)

MODES = ["session", "item"]


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[UpstreamProc]:
    up = UpstreamProc(tmp_path, rate=5.0)
    yield up
    up.stop()


def ids(n: int, prefix: str = "c") -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def held_by(cfg: Config) -> dict[str, int]:
    counts: dict[str, int] = {}
    for owner in owners(cfg).values():
        counts[owner] = counts.get(owner, 0) + 1
    return counts


def assert_no_loss(cfg: Config, up: UpstreamProc, conns: list[str], lag: int = 15) -> None:
    """Every stream's written seqs are contiguous from 1 and reach close to what was produced."""
    produced = {cid: s["produced"] for cid, s in up.stats().items()}
    report = audit(cfg, conns)
    assert set(report.seqs) == set(conns), f"never written: {sorted(set(conns) - set(report.seqs))[:5]}"
    assert report.missing() == {}, f"missing seqs: {list(report.missing().items())[:3]}"
    lags = {cid: produced[cid] - max(report.seqs[cid]) for cid in conns}
    behind = {cid: n for cid, n in lags.items() if n > lag}
    assert not behind, f"streams far behind their upstream: {list(behind.items())[:5]}"


def max_concurrent(up: UpstreamProc, conns: list[str]) -> int:
    stats = up.stats()
    return max(int(stats[c]["max_concurrent"]) for c in conns)


def fast(cfg: Config, mode: str = "session", **extra: object) -> Config:
    return profile.fast(cfg, lease_mode=mode, **extra)


@pytest.mark.parametrize("mode", MODES)
def test_200_connections_started_with_ctl_all_stream_without_loss(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """40 streams started through ``fleetd ctl start`` (the item and its START hint) and 160 written as it
    writes them (``seed_items``, no hint: each ctl start is a process's worth of SDK setup, half a second
    of CPU): all are claimed, streamed without loss by one socket each, and released at SIGTERM."""
    for key, value in config.as_env(cfg).items():
        monkeypatch.setenv(key, value)
    conns = ids(200)
    for cid in conns[:40]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["ctl", "start", cid, upstream.url(cid)])
        assert exit_info.value.code == 0
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns[40:]})
    shard = start_shard(cfg, tmp_path, 0, FLEETD_LEASE_MODE=mode, FLEETD_MAX_CONNECTIONS_PER_SHARD="1000")
    try:
        wait_for(lambda: held_by(cfg).get("", 0) == 0, 30, 0.5, "all 200 claimed")
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 20, 0.5, "all attached")
        time.sleep(10)
        shard.signal(signal.SIGTERM)
        assert shard.wait(20) == 0
        assert_no_loss(cfg, upstream, conns)
        assert max_concurrent(upstream, conns) == 1
        assert held_by(cfg) == {"": 200}, "graceful stop releases every lease"
    finally:
        stop_all(shard)


def test_a_new_item_whose_upstream_counts_from_0_has_seq_0_written(
        cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ctl start`` leaves no resume point, so the first connect sends no from_seq and seq 0 is kept."""
    for key, value in config.as_env(cfg).items():
        monkeypatch.setenv(key, value)
    up = UpstreamProc(tmp_path, rate=10.0, name="upstream-from-0", first_seq=0)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["ctl", "start", "from-0", up.url("from-0")])
        assert exit_info.value.code == 0
        st = ShardThread(fast(cfg))
        try:
            wait_for(lambda: len(audit(cfg, ["from-0"]).seqs.get("from-0", ())) >= 10, 20, 0.2, "10 frames written")
        finally:
            assert st.stop() == 0
        stream = up.stats()["from-0"]
    finally:
        up.stop()
    seqs = sorted(audit(cfg, ["from-0"]).seqs["from-0"])
    assert seqs[0] == 0, f"seq 0 lost: first connect asked from_seq={stream['from_seqs'][:1]}"
    assert seqs == list(range(len(seqs)))
    assert len(stream["from_seqs"]) < stream["connections"], "the first connect sent a from_seq"


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_one_of_two_shards_peer_takes_all(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path, mode: str) -> None:
    conns = ids(100)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    a = start_shard(cfg, tmp_path, 0, task="a", FLEETD_LEASE_MODE=mode)
    b = start_shard(cfg, tmp_path, 0, task="b", FLEETD_LEASE_MODE=mode)
    try:
        wait_for(lambda: held_by(cfg).get("", 0) == 0, 30, 0.5, "all 100 claimed")
        time.sleep(3)
        victim_prefix = "a/"
        assert any(o.startswith(victim_prefix) for o in owners(cfg).values()), "both shards should hold some"
        a.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: all(o.startswith("b/") for o in owners(cfg).values()), 30, 0.25, "b to own all")
        took = time.monotonic() - killed_at
        # TTL + margin + reconcile (+ a jittered round and slow CI): generous bound, figure printed.
        print(f"takeover after SIGKILL: {took:.2f} s")
        lease = profile.fast(cfg).lease
        assert took < lease.lease_ttl_s + lease.safety_margin_s + lease.reconcile_s + 6
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 20, 0.5, "re-attached")
        time.sleep(3)
        b.signal(signal.SIGTERM)
        assert b.wait(20) == 0
        assert_no_loss(cfg, upstream, conns)
        assert audit(cfg, conns).overlaps(margin_ms=1000) == {}
        assert max_concurrent(upstream, conns) == 1
    finally:
        stop_all(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_hands_over_through_hints(cfg: Config, upstream: UpstreamProc, tmp_path: Path, mode: str) -> None:
    conns = ids(100)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    # No rebalancing: b must get the streams through the SIGTERM's hints, not before.
    a = start_shard(cfg, tmp_path, 0, task="a", FLEETD_LEASE_MODE=mode, FLEETD_REBALANCE_S="0")
    try:
        wait_for(lambda: held_by(cfg).get("", 0) == 0, 30, 0.5, "a to claim all")
        # Long reconcile on b: it can only learn about the released items through hints.
        b = start_shard(cfg, tmp_path, 0, task="b", FLEETD_LEASE_MODE=mode, FLEETD_RECONCILE_S="60",
                        FLEETD_REBALANCE_S="0")
        wait_for(lambda: any("shard started" in str(r.get("event")) for r in b.logs()), 20, 0.2, "b up")
        time.sleep(2)
        a.signal(signal.SIGTERM)
        assert a.wait(20) == 0
        wait_for(lambda: all(o.startswith("b/") for o in owners(cfg).values()), 20, 0.1, "b to own all")
        time.sleep(3)
        b.signal(signal.SIGTERM)
        assert b.wait(20) == 0
        report = audit(cfg, conns)
        gaps = []
        for cid in conns:
            spans = sorted(report.writers[cid].values())
            assert len(spans) == 2, f"{cid} written by {len(spans)} sessions"
            gaps.append((spans[1][0] - spans[0][1]) / 1000)
        gaps.sort()
        print(f"SIGTERM handover gap p50 {gaps[50]:.2f} s, max {gaps[-1]:.2f} s")
        assert gaps[-1] <= 2.0 + 1.0  # target 2 s; allow one extra second for a loaded CI machine
        assert_no_loss(cfg, upstream, conns)
        assert max_concurrent(upstream, conns) == 1
    finally:
        stop_all(a)
        if "b" in locals():
            stop_all(b)


@pytest.mark.parametrize("mode", MODES)
def test_ctl_stop_closes_and_releases(
        cfg: Config, upstream: UpstreamProc, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    for key, value in config.as_env(cfg).items():
        monkeypatch.setenv(key, value)
    conns = ids(5)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    st = ShardThread(fast(cfg, mode))
    try:
        wait_for(lambda: len(st.shard.held_ids()) == 5, 20, 0.2, "5 held")
        wait_for(lambda: upstream.stats()["c0002"]["attached"] == 1, 10, 0.2, "attached")
        with pytest.raises(SystemExit):
            cli.main(["ctl", "stop", "c0002"])
        stopped_at = time.monotonic()
        wait_for(lambda: upstream.stats()["c0002"]["attached"] == 0, 5, 0.05, "upstream to see the close")
        assert time.monotonic() - stopped_at <= st.cfg.lease.desired_state_s + 1.0 + 0.5
        wait_for(lambda: owners(cfg)["c0002"] == "", 5, 0.1, "lease released")
        time.sleep(2)
        assert "c0002" not in st.shard.held_ids() and len(st.shard.held_ids()) == 4, "a stopped item is not re-claimed"
    finally:
        st.stop()


@pytest.mark.parametrize("mode", MODES)
def test_upstream_drop_and_refusal_then_resume_without_loss(cfg: Config, upstream: UpstreamProc, mode: str) -> None:
    conns = ids(20)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    st = ShardThread(fast(cfg, mode))
    try:
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()) and len(upstream.stats()) == 20,
                 20, 0.2, "attached")
        time.sleep(1)
        upstream.post("/refuse?on=1")
        upstream.post("/drop")
        time.sleep(3)
        assert all(s["attached"] == 0 for s in upstream.stats().values())
        upstream.post("/refuse?on=0")
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 15, 0.2, "reconnected")
        assert st.counter("upstream_reconnects_total") >= 20
        # A hung upstream (no data, no pongs) is noticed by auto-ping and reconnected.
        upstream.post("/stall?on=1")
        wait_for(lambda: st.counter("upstream_reconnects_total") >= 40, 15, 0.2, "stall detected")
        upstream.post("/stall?on=0")
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 15, 0.2, "reconnected")
        time.sleep(2)
    finally:
        assert st.stop() == 0
    assert_no_loss(cfg, upstream, conns)
    assert max_concurrent(upstream, conns) == 1


def test_bad_frames_and_bad_items_are_counted_and_the_shard_stays_healthy(
        cfg: Config, upstream: UpstreamProc) -> None:
    conns = ids(3)
    urls = {cid: upstream.url(cid) for cid in conns}
    urls["bad-url"] = "not a url"
    urls["bad-scheme"] = "https://example.com/x"
    seed_items(cfg, urls)
    # An item with missing attributes, written straight into the table.
    ddb().put_item(TableName=cfg.aws.connections_table, Item={
        "connection_id": {"S": "bare"}, "desired_state": {"S": "STARTED"}, "lease_expires_at_ms": {"N": "0"}})
    st = ShardThread(fast(cfg, max_frame_bytes=100_000))
    try:
        wait_for(lambda: len(st.shard.held_ids()) == 6, 20, 0.2, "all 6 held (3 parked)")
        wait_for(lambda: all(upstream.stats()[c]["attached"] == 1 for c in conns), 10, 0.2, "attached")
        time.sleep(1)  # let sequenced frames flow first: a seq-less frame is rejected only in a sequenced stream
        for kind in ("malformed", "binary", "noseq", "malformed"):
            upstream.post(f"/inject?id=c0000&kind={kind}")
        upstream.post("/inject?id=c0001&kind=oversized")
        wait_for(lambda: st.counter("upstream_frames_rejected_total", reason="malformed") == 2, 5, 0.1, "malformed")
        wait_for(lambda: st.counter("upstream_frames_rejected_total", reason="binary") == 1, 5, 0.1, "binary")
        wait_for(lambda: st.counter("upstream_frames_rejected_total", reason="noseq") == 1, 5, 0.1, "noseq")
        wait_for(lambda: st.counter("upstream_frames_rejected_total", reason="oversized") >= 1, 10, 0.1, "oversized")
        assert st.counter("bad_items_total", reason="bad_url") == 3
        wait_for(lambda: all(upstream.stats()[c]["attached"] == 1 for c in conns), 10, 0.2, "healthy again")
        time.sleep(2)
    finally:
        assert st.stop() == 0
    assert_no_loss(cfg, upstream, conns)


@pytest.mark.parametrize("mode", MODES)
def test_dynamodb_unreachable_fences_before_ttl_then_recovers(
        cfg: Config, upstream: UpstreamProc, stack: DevStack, mode: str) -> None:
    conns = ids(20)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    st = ShardThread(fast(cfg, mode))
    try:
        wait_for(lambda: len(upstream.stats()) == 20 and all(s["attached"] == 1 for s in upstream.stats().values()),
                 20, 0.2, "attached")
        time.sleep(1.5)
        stack.pause_dynamodb()
        paused_at = time.monotonic()
        try:
            wait_for(lambda: all(s["attached"] == 0 for s in upstream.stats().values()), 10, 0.05, "fenced")
            fenced_after = time.monotonic() - paused_at
            print(f"fenced {fenced_after:.2f} s after DynamoDB froze")
            # Before the TTL (6 s) from the last successful renewal, which was at most 1 s before the freeze.
            assert fenced_after < st.cfg.lease.lease_ttl_s
            time.sleep(st.cfg.lease.lease_ttl_s + 2 - fenced_after)
        finally:
            stack.resume_dynamodb()
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 30, 0.2, "recovered")
        assert st.counter("self_fence_total") >= 1
        time.sleep(2)
    finally:
        assert st.stop() == 0
    assert max_concurrent(upstream, conns) == 1
    assert_no_loss(cfg, upstream, conns)


def test_shard_without_tables_exits_with_boot_error(cfg: Config, tmp_path: Path) -> None:
    broken = config.replace(cfg, connections_table="never-created")
    shard = start_shard(broken, tmp_path, 0)
    try:
        assert shard.wait(20) == 3
        assert any("fleetd init" in str(r.get("reason", "")) for r in shard.logs())
    finally:
        stop_all(shard)


def test_shard_with_a_wrongly_keyed_messages_table_exits_with_boot_error(cfg: Config, tmp_path: Path) -> None:
    """Every message would be refused: a boot error naming the key, not a shard that stalls every stream."""
    wrong = config.replace(cfg, messages_table=cfg.aws.messages_table + "-wrong")
    ddb().create_table(TableName=wrong.aws.messages_table, BillingMode="PAY_PER_REQUEST",
                       KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
                       AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}])
    shard = start_shard(wrong, tmp_path, 0)
    try:
        assert shard.wait(20) == 3
        assert any("hash key is id" in str(r.get("reason", "")) for r in shard.logs()), shard.logs()[-3:]
    finally:
        stop_all(shard)


def test_dead_session_is_emptied_then_forgotten_after_its_grace(cfg: Config, upstream: UpstreamProc) -> None:
    """Its STARTED items are claimed, its STOPPED ones freed, and an item its late claim wins while
    it is still listed is found too; only after ``dead_session_grace_s`` is it deleted."""
    cfg = fast(cfg, dead_session_grace_s=15.0)
    dead, table = "gone/0/d", cfg.aws.connections_table

    def owned_by_dead(cid: str, state: str = "STARTED") -> None:
        ddb().put_item(TableName=table, Item={
            "connection_id": {"S": cid}, "desired_state": {"S": state}, "ws_url": {"S": upstream.url(cid)},
            "lease_owner": {"S": dead}, "lease_expires_at_ms": {"N": str(HELD_BY_SESSION)},
            "lease_epoch": {"N": "1"}, "last_seq": {"N": "0"}})

    owned_by_dead("live")
    owned_by_dead("stopped", "STOPPED")
    ddb().put_item(TableName=cfg.aws.sessions_table, Item={
        "session_id": {"S": dead}, "kind": {"S": SESSION_KIND},
        "expires_at_ms": {"N": str(int(time.time() * 1000) - 2_000)}})
    t = ShardThread(cfg)
    try:
        wait_for(lambda: owners(cfg).get("live", dead) != dead and owners(cfg).get("stopped") == "", 15, 0.25,
                 "live claimed and stopped freed")
        assert t.counter("dead_session_stopped_freed_total") == 1
        owned_by_dead("late")  # a claim the dead session sent before dying, landing now
        wait_for(lambda: owners(cfg).get("late", dead) != dead, 10, 0.25, "the late item taken over")
        assert "Item" in ddb().get_item(TableName=cfg.aws.sessions_table, Key={"session_id": {"S": dead}})
        wait_for(lambda: "Item" not in ddb().get_item(TableName=cfg.aws.sessions_table,
                                                      Key={"session_id": {"S": dead}}), 30, 0.5, "dead forgotten")
        wait_for(lambda: all(upstream.stats().get(c, {}).get("attached") == 1 for c in ("live", "late")), 10, 0.25,
                 "both streaming")
    finally:
        t.stop()


def test_a_dying_session_is_taken_over_as_it_dies_not_at_the_next_reconcile(
        cfg: Config, upstream: UpstreamProc) -> None:
    """A session that stopped renewing (its task was killed) expires in 4 s; the shard reconciles
    only every 30 s, yet takes its stream over just after the expiry (+ the skew allowance)."""
    cfg = config.replace(fast(cfg), reconcile_s=30.0)
    dying, table = "gone/0/z", cfg.aws.connections_table
    ddb().put_item(TableName=table, Item={
        "connection_id": {"S": "orphan"}, "desired_state": {"S": "STARTED"}, "ws_url": {"S": upstream.url("orphan")},
        "lease_owner": {"S": dying}, "lease_expires_at_ms": {"N": str(HELD_BY_SESSION)},
        "lease_epoch": {"N": "1"}, "last_seq": {"N": "0"}})
    ddb().put_item(TableName=cfg.aws.sessions_table, Item={
        "session_id": {"S": dying}, "kind": {"S": SESSION_KIND},
        "expires_at_ms": {"N": str(int(time.time() * 1000) + 4_000)}})
    started = time.monotonic()
    t = ShardThread(cfg)
    try:
        wait_for(lambda: owners(cfg).get("orphan", dying) != dying, 15, 0.1, "the orphan taken over")
        took = time.monotonic() - started
        print(f"\ntaken over {took:.1f} s after boot (the session expired at 4 s)")
        assert took >= 4.0, "taken over before its session expired"
        wait_for(lambda: upstream.stats().get("orphan", {}).get("attached") == 1, 10, 0.1, "streaming")
    finally:
        t.stop()


def test_a_new_shard_gets_its_share_without_loss_or_overlap(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    """60 streams on shard a; shard b starts; a hands b half of them, one write each, b adopts them."""
    conns = ids(60)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    env = {"FLEETD_MAX_CONNECTIONS_PER_SHARD": "100", "FLEETD_REBALANCE_S": "2"}
    a = start_shard(cfg, tmp_path, 0, task="a", **env)
    b: FleetdProc | None = None
    try:
        wait_for(lambda: held_by(cfg).get("", 0) == 0, 30, 0.5, "a claims all 60")
        # Claimed is not yet connected: count each stream's connections once all 60 are attached.
        wait_for(lambda: sum(s["attached"] for s in upstream.stats().values()) == 60, 20, 0.25, "a streams all 60")
        before = {cid: int(s["connections"]) for cid, s in upstream.stats().items()}
        b = start_shard(cfg, tmp_path, 0, task="b", **env)

        def split() -> dict[str, int]:
            return {t: sum(n for o, n in held_by(cfg).items() if o.startswith(f"{t}/")) for t in ("a", "b")}

        wait_for(lambda: split()["b"] >= 27 and split()["a"] <= 33, 40, 0.5, "b to get its share")
        wait_for(lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 20, 0.5, "all attached")
        moved = [cid for cid, s in upstream.stats().items() if int(s["connections"]) > before[cid]]
        print(f"split {split()}, {len(moved)} streams moved")
        assert 27 <= len(moved) <= 33, "only what b's share needed was moved"
        assert all(int(s["connections"]) - before[cid] == (cid in moved) for cid, s in upstream.stats().items()), \
            "a stream moved twice (handed back and forth)"
        time.sleep(3)
        for proc in (a, b):
            proc.signal(signal.SIGTERM)
        assert a.wait(20) == 0 and b.wait(20) == 0
        assert_no_loss(cfg, upstream, conns)
        assert audit(cfg, conns).overlaps(margin_ms=1000) == {}
        assert max_concurrent(upstream, conns) == 1
    finally:
        stop_all(a, *([b] if b else []))


def test_shards_booting_together_do_not_hand_streams_back_and_forth(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    """Two shards boot at once on 60 free items and look for imbalance every second.  Each one's
    recorded load lags its claims by a heartbeat: a look at a booting peer must wait, or it hands
    streams to a peer it sees empty, which then hands some back (CI saw 10 go one way, 5 back)."""
    conns = ids(60)
    seed_items(cfg, {cid: upstream.url(cid) for cid in conns})
    env = {"FLEETD_MAX_CONNECTIONS_PER_SHARD": "100", "FLEETD_REBALANCE_S": "1"}
    a = start_shard(cfg, tmp_path, 0, task="a", **env)
    b = start_shard(cfg, tmp_path, 0, task="b", **env)
    try:
        wait_for(lambda: held_by(cfg).get("", 0) == 0, 30, 0.5, "all 60 claimed")
        time.sleep(8)  # past the settle time (2 heartbeats + 2 s): later looks may hand, on a true view
        handers = {p.log_path.name for p in (a, b)
                   if any(r.get("event") == "streams handed to a peer" for r in p.logs())}
        assert len(handers) <= 1, f"both shards handed streams to each other: {handers}"
        for proc in (a, b):
            proc.signal(signal.SIGTERM)
        assert a.wait(20) == 0 and b.wait(20) == 0
        assert_no_loss(cfg, upstream, conns)
    finally:
        stop_all(a, b)


def test_handed_more_than_room_gives_the_rest_back(cfg: Config, upstream: UpstreamProc) -> None:
    """Streams handed to a shard on a stale view of its load: it adopts what fits, frees the rest, and
    frees one stopped since it was handed over (none may stay owned and unstreamed)."""
    # No rebalancing loops: the receive loop runs the same scan at boot, racing the call below.
    st = ShardThread(fast(cfg, max_connections_per_shard=2, rebalance_s=0.0))
    try:
        wait_for(lambda: st.shard.loop is not None and st.shard.session_id != "", 10, 0.1, "booted")
        me, table = st.shard.session_id, cfg.aws.connections_table
        for i, state in enumerate(("STARTED", "STARTED", "STARTED", "STARTED", "STOPPED")):
            ddb().put_item(TableName=table, Item={
                "connection_id": {"S": f"h{i}"}, "desired_state": {"S": state}, "ws_url": {"S": upstream.url(f"h{i}")},
                "lease_owner": {"S": me}, "lease_expires_at_ms": {"N": str(HELD_BY_SESSION)},
                "lease_epoch": {"N": "3"}, "last_seq": {"N": "0"}})
        assert st.shard.loop is not None and st.shard.parts is not None
        adopt = st.shard.parts.reconciler.adopt_own_strays(source="handed")
        asyncio.run_coroutine_threadsafe(adopt, st.shard.loop).result(20)
        # What we gave back is hinted, and our own inbox may claim one of those back meanwhile (a claim in
        # flight is owned in the table before it is held): what we own settles to what we hold.
        seen: dict[str, object] = {}

        def settled() -> bool:
            own = owners(cfg)
            held = set(st.shard.held_ids())
            seen.update(own=own, held=held)
            return {c for c in own if own[c] == me} == held

        wait_for(settled, 10, 0.2, f"what we own is what we hold (last seen: {seen})")
        own, held = cast(dict[str, str], seen["own"]), cast(set[str], seen["held"])  # the settled view
        # Everything is streamed by us or free again; nothing stays ours unstreamed.
        assert {c for c in own if own[c] == ""} == set(own) - held
        assert own["h4"] == ""  # stopped: freed whether it was tried (claim refused) or left over
        assert 1 <= len(held) <= 2  # room for 2; 1 when the stopped one was among the 2 tried
        assert st.counter("handed_claims_total") >= 1  # (the reconcile's own scan may adopt one too)
        assert st.counter("rebalance_given_back_total") >= 2
    finally:
        st.stop()
