"""Sink backpressure end to end: a slow DynamoDB sink pauses upstream reads, and nothing breaks for it.

The messages table is reached through a fault proxy that delays every
BatchWriteItem, so the sink drains far slower than the upstreams produce.  The
shard must keep its buffer near the high watermark — including for streams it
claims *after* the sink crossed it — and must not lose paused streams to its own
auto-ping (a paused socket cannot read the pong).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import metrics
from bench.faults.proxy import ProxyThread
from bench.sut import Tables, fleetd_task
from fleetd.config import Config
from fleetd.devstack import DevStack
from tests.fleet import UpstreamProc, audit, seed_items, wait_for

HIGH, LOW = 2000, 500


def test_slow_sink_pauses_reads_without_dropping_streams(stack: DevStack, cfg: Config, tmp_path: Path) -> None:
    upstream = UpstreamProc(tmp_path, rate=200.0, size=100)
    tables = Tables(cfg.aws.connections_table, cfg.aws.sessions_table, cfg.aws.messages_table, cfg.aws.hints_queue)
    first = [f"a{i:02d}" for i in range(20)]
    seed_items(cfg, {cid: upstream.url(cid) for cid in first})
    with ProxyThread(os.environ["AWS_ENDPOINT_URL_DYNAMODB"]) as px:
        px.add("BatchWriteItem", "latency", seconds=0.25)
        env = dict(os.environ, AWS_ENDPOINT_URL_DYNAMODB=px.url)
        run, url = fleetd_task("bp", 1, tables, tmp_path, env, FLEETD_SINK_HIGH_WATERMARK=str(HIGH),
                               FLEETD_SINK_LOW_WATERMARK=str(LOW), FLEETD_SINK_FLUSHERS="2",
                               FLEETD_PING_IDLE_S="1", FLEETD_PING_REPLY_S="1", FLEETD_RECONCILE_S="1",
                               FLEETD_ALLOWED_SCHEMES="ws")
        try:
            wait_for(lambda: _polled(url, "fleetd_sink_pressure_total") >= 1, 30, what="sink pressure")
            late = [f"b{i:02d}" for i in range(20)]  # claimed while the sink is pressured
            seed_items(cfg, {cid: upstream.url(cid) for cid in late})
            wait_for(lambda: _value(url, "fleetd_active_connections") == 40, 30, what="all 40 held")
            peak = 0.0
            for _ in range(40):  # 10 s of paused and resumed reading
                peak = max(peak, _value(url, "fleetd_sink_buffer_messages"))
                time.sleep(0.25)
            # Each socket may deliver what it had already read when the pause came: a bounded overshoot.
            assert peak < HIGH + 40 * 300, f"sink buffer reached {peak}: reads were not paused"
            assert _value(url, "fleetd_sink_pressure_total") >= 2, "reads were never resumed"
            assert _value(url, "fleetd_upstream_reconnects_total") == 0, "a paused stream was dropped"
            assert _value(url, "fleetd_upstream_connected") == 40
        finally:
            run.stop()
    stats = upstream.stats()
    upstream.stop()
    report = audit(cfg, first + late)
    assert report.missing({k: v["produced"] for k, v in stats.items()}) == {}
    assert all(s["connections"] == 1 for cid, s in stats.items() if cid in first + late), "a stream reconnected"


def _value(url: str, name: str) -> float:
    return metrics(url).get(name, 0.0)


def _polled(url: str, name: str) -> float:
    """``_value``, or -1 while the metrics endpoint is not up yet."""
    try:
        return _value(url, name)
    except OSError:
        return -1.0
