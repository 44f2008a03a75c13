"""Items owned by a session nobody lists any more are found by the orphan sweep (issue 13, defect 3).

Routes to such an item: a claim of a dead session landing after the session was forgotten (an SDK
retry), index lag at takeover, a hand-over to a receiver dying at that moment, the sessions table's
TTL.  Whatever the route, the state is the same, and that is what these tests build: an item whose
``lease_owner`` names a session that does not exist, or one that is dead and no longer listed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetd.config import Config
from fleetd.schema import HELD_BY_SESSION, SESSION_KIND
from tests.fleet import UpstreamProc, ddb, owners, start_shard, stop_all, wait_for


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[UpstreamProc]:
    up = UpstreamProc(tmp_path, rate=5.0)
    yield up
    up.stop()


def owned_by(cfg: Config, up: UpstreamProc, cid: str, owner: str) -> None:
    ddb().put_item(TableName=cfg.aws.connections_table, Item={
        "connection_id": {"S": cid}, "desired_state": {"S": "STARTED"}, "ws_url": {"S": up.url(cid)},
        "lease_owner": {"S": owner}, "lease_expires_at_ms": {"N": str(HELD_BY_SESSION)},
        "lease_epoch": {"N": "3"}, "last_seq": {"N": "0"}})


def test_an_item_of_a_forgotten_session_is_freed_and_streamed(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    """Without the sweep the item stays owned by ``gone/0/x`` forever: no index query finds it."""
    owned_by(cfg, upstream, "orphan", "gone/0/x")
    shard = start_shard(cfg, tmp_path, 0, FLEETD_ORPHAN_SWEEP_S="0.3")
    try:
        wait_for(lambda: owners(cfg).get("orphan") not in ("gone/0/x", "", None), 20, 0.25,
                 "the orphan freed and claimed")
        wait_for(lambda: upstream.stats().get("orphan", {}).get("attached") == 1, 10, 0.25, "streaming")
    finally:
        stop_all(shard)


def test_an_item_of_a_dead_session_missing_from_by_expiry_is_taken_over(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    """A dead session whose record is not in ``by_expiry`` (no ``kind``: a record from another writer,
    or the index lagging) is still found by the sweep through its items, and taken over."""
    owned_by(cfg, upstream, "stray", "dead/0/y")
    ddb().put_item(TableName=cfg.aws.sessions_table, Item={
        "session_id": {"S": "dead/0/y"}, "expires_at_ms": {"N": str(int(time.time() * 1000) - 60_000)}})
    shard = start_shard(cfg, tmp_path, 0, FLEETD_ORPHAN_SWEEP_S="0.3")
    try:
        wait_for(lambda: owners(cfg).get("stray") not in ("dead/0/y", "", None), 20, 0.25, "taken over")
        item = ddb().get_item(TableName=cfg.aws.sessions_table, Key={"session_id": {"S": "dead/0/y"}},
                              ConsistentRead=True).get("Item", {})
        assert item == {} or "dead_at_ms" in item, "taken over without a tombstone"
    finally:
        stop_all(shard)


def test_a_live_sessions_items_are_left_alone(cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    owned_by(cfg, upstream, "kept", "live/0/z")
    ddb().put_item(TableName=cfg.aws.sessions_table, Item={
        "session_id": {"S": "live/0/z"}, "kind": {"S": SESSION_KIND},
        "expires_at_ms": {"N": str(int(time.time() * 1000) + 600_000)}})
    shard = start_shard(cfg, tmp_path, 0, FLEETD_ORPHAN_SWEEP_S="0.3")
    try:
        time.sleep(6)  # several sweeps
        assert owners(cfg).get("kept") == "live/0/z"
    finally:
        stop_all(shard)
