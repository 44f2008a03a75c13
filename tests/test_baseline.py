"""The seed-design baseline (``python -m bench.baseline``) on the local stack and the fake upstream.

The baseline is the reference the benchmark compares fleetd to, so it must be correct
too: every stream held and written without loss, leases released on SIGTERM, a peer
taking over after SIGKILL with one streamer at a time, STOPPED items closed.  Real
processes, real signals; timings shortened (heartbeat 1 s, TTL 6 s, margin 1 s,
reconcile 2 s, desired state 1 s).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import orjson
import pytest

from fleetd.config import Config
from tests.fleet import FleetdProc, UpstreamProc, audit, ddb, owners, seed_items, stop_all, wait_for

TTL_S, MARGIN_S, RECONCILE_S, DESIRED_S = 6, 1, 2, 1
FAST = ["--heartbeat-s", "1", "--lease-ttl-s", str(TTL_S), "--safety-margin-s", str(MARGIN_S),
        "--reconcile-s", str(RECONCILE_S), "--desired-state-s", str(DESIRED_S), "--hint-wait-s", "1",
        "--backoff-max-s", "2", "--aws-timeout-s", "2", "--shutdown-budget-s", "8"]


class Baseline(FleetdProc):
    """A baseline worker process; ``name`` is its worker id (lease owners are ``name/<nonce>``)."""

    def __init__(self, cfg: Config, log_dir: Path, name: str, *extra: str) -> None:
        self.stats_path = log_dir / f"baseline-{name}.json"
        argv = [sys.executable, "-m", "bench.baseline", "--worker-id", name,
                "--connections-table", cfg.aws.connections_table, "--messages-table", cfg.aws.messages_table,
                "--hints-queue", cfg.aws.hints_queue, "--stats-file", str(self.stats_path), *FAST, *extra]
        super().__init__(argv, dict(os.environ), log_dir / f"baseline-{name}.log")
        wait_for(lambda: "ready" in self.log_path.read_text().split(), 20, 0.1, f"baseline {name} ready")

    def stats(self) -> dict[str, Any]:
        try:
            return dict(orjson.loads(self.stats_path.read_bytes()))
        except (OSError, orjson.JSONDecodeError):
            return {}


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[UpstreamProc]:
    up = UpstreamProc(tmp_path, rate=5.0)
    yield up
    up.stop()


def ids(n: int) -> list[str]:
    return [f"c{i:04d}" for i in range(n)]


def owned_by(cfg: Config, name: str) -> int:
    return sum(o.startswith(f"{name}/") for o in owners(cfg).values())


def all_attached(up: UpstreamProc, conns: list[str]) -> bool:
    stats = up.stats()
    return all(c in stats and stats[c]["attached"] == 1 for c in conns)


def assert_no_loss(cfg: Config, produced: dict[str, int], conns: list[str], lag: int = 10) -> None:
    """Seqs contiguous from 1 for every stream, reaching close to what was produced at ``produced``'s time."""
    report = audit(cfg, conns)
    assert set(report.seqs) == set(conns), f"never written: {sorted(set(conns) - set(report.seqs))[:5]}"
    assert report.missing(produced) == {}, f"missing seqs: {list(report.missing(produced).items())[:3]}"
    behind = {c: produced[c] - max(report.seqs[c]) for c in conns if produced[c] - max(report.seqs[c]) > lag}
    assert not behind, f"streams far behind their upstream: {list(behind.items())[:5]}"


def queued_hints(cfg: Config) -> int:
    sqs = boto3.client("sqs")
    url = sqs.get_queue_url(QueueName=cfg.aws.hints_queue)["QueueUrl"]
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"])


def test_one_worker_streams_20_without_loss_and_sigterm_releases_every_lease(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    conns = ids(20)
    seed_items(cfg, {c: upstream.url(c) for c in conns})
    worker = Baseline(cfg, tmp_path, "solo")
    try:
        wait_for(lambda: owned_by(cfg, "solo") == 20, 20, 0.2, "all 20 claimed")
        wait_for(lambda: all_attached(upstream, conns), 20, 0.2, "all 20 attached")
        wait_for(lambda: worker.stats().get("streaming") == 20 and worker.stats().get("held") == 20, 5, 0.2,
                 "stats file: 20 held and streaming")
        time.sleep(3)
        produced = {c: int(s["produced"]) for c, s in upstream.stats().items()}
        worker.signal(signal.SIGTERM)
        sent_at = time.monotonic()
        assert worker.wait(10) == 0
        print(f"baseline SIGTERM exit after {time.monotonic() - sent_at:.2f} s")
        assert time.monotonic() - sent_at < 5
        assert set(owners(cfg).values()) == {""}, "graceful stop releases every lease"
        assert queued_hints(cfg) == 20, "one START hint per released lease"
        assert_no_loss(cfg, produced, conns)
        stats = worker.stats()
        assert stats["messages"] == audit(cfg, conns).written, "each seq written exactly once by one worker"
        assert stats["held"] == 0 and stats["streaming"] == 0 and stats["claims"] == 20
        assert all(int(s["max_concurrent"]) == 1 for s in upstream.stats().values())
    finally:
        stop_all(worker)


def test_sigkill_one_of_two_workers_the_peer_takes_over_without_loss(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    conns = ids(20)
    seed_items(cfg, {c: upstream.url(c) for c in conns})
    a = Baseline(cfg, tmp_path, "a", "--max-connections", "10")
    b = None
    try:
        wait_for(lambda: owned_by(cfg, "a") == 10, 20, 0.2, "a to claim its 10")
        b = Baseline(cfg, tmp_path, "b")
        wait_for(lambda: owned_by(cfg, "b") == 10, 20, 0.2, "b to claim the other 10")
        wait_for(lambda: all_attached(upstream, conns), 20, 0.2, "all attached")
        time.sleep(2)
        a.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: owned_by(cfg, "b") == 20, TTL_S + MARGIN_S + RECONCILE_S * 1.2 + 5, 0.2, "b to own all")
        took = time.monotonic() - killed_at
        print(f"baseline takeover after SIGKILL: {took:.2f} s")
        assert took < TTL_S + MARGIN_S + RECONCILE_S * 1.2 + 3
        wait_for(lambda: all_attached(upstream, conns), 10, 0.2, "all re-attached")
        time.sleep(2)
        produced = {c: int(s["produced"]) for c, s in upstream.stats().items()}
        b.signal(signal.SIGTERM)
        assert b.wait(10) == 0
        assert_no_loss(cfg, produced, conns)
        report = audit(cfg, conns)
        assert report.overlaps(margin_ms=1000) == {}
        victims = [c for c in conns if len(report.writers[c]) == 2]
        assert len(victims) == 10, "the killed worker's 10 streams were written by a, then b"
        stats = upstream.stats()
        assert {c: int(stats[c]["max_concurrent"]) for c in conns} == dict.fromkeys(conns, 1)
    finally:
        stop_all(a, *([b] if b else []))


def test_stopped_item_is_closed_released_and_not_reclaimed(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    conns = ids(5)
    seed_items(cfg, {c: upstream.url(c) for c in conns})
    worker = Baseline(cfg, tmp_path, "solo")
    try:
        wait_for(lambda: all_attached(upstream, conns), 20, 0.2, "all 5 attached")
        ddb().update_item(TableName=cfg.aws.connections_table, Key={"connection_id": {"S": "c0002"}},
                          UpdateExpression="SET desired_state = :s",
                          ExpressionAttributeValues={":s": {"S": "STOPPED"}})
        stopped_at = time.monotonic()
        wait_for(lambda: upstream.stats()["c0002"]["attached"] == 0, DESIRED_S + 2, 0.05, "the socket to close")
        print(f"baseline closed a STOPPED stream after {time.monotonic() - stopped_at:.2f} s")
        wait_for(lambda: owners(cfg)["c0002"] == "", 3, 0.1, "the lease to be released")
        time.sleep(RECONCILE_S * 1.2 + 0.5)  # a reconcile round must not take it back
        assert owners(cfg)["c0002"] == ""
        stats = upstream.stats()
        assert stats["c0002"]["attached"] == 0
        assert all(stats[c]["attached"] == 1 for c in conns if c != "c0002")
        assert worker.stats()["held"] == 4
        worker.signal(signal.SIGTERM)
        assert worker.wait(10) == 0
    finally:
        stop_all(worker)
