"""The supervisor's collector, fed synthetic shard snapshots (no processes, no servers but one)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd.metrics import (
    CLIENT_IDLE_TIMEOUT_S,
    READY_MAX_AGE_S,
    REQUIRED,
    FleetCollector,
    MetricsServer,
    exposition,
)
from fleetd.stats import LAG_BUCKETS, LATENCY_BUCKETS, Stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(active: int = 0, claims: float = 0, messages: int = 0, live: float = 1.0,
             batches: tuple[float, ...] = (), session: str = "s", stalled: float = 0.0,
             lags: tuple[float, ...] = ()) -> dict[str, Any]:
    stats = Stats()
    lag = stats.histogram("event_loop_lag_seconds", LAG_BUCKETS)  # as the shard's probe does
    for seconds in lags:
        lag.observe(seconds)
    stats.set("active_connections", active)
    stats.set("session_live", live)
    stats.set("sink_stalled_streams", stalled)
    if claims:
        stats.inc("lease_claims_total", claims, result="won")
    stats.messages = messages
    for seconds in batches:
        stats.observe("sink_batch_seconds", seconds)
    snap = stats.snapshot()
    snap.update(session_id=session, held=active)
    return snap


def samples(c: FleetCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(exposition(c).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(c: FleetCollector, name: str, **labels: str) -> float | None:
    return samples(c).get((name, tuple(sorted(labels.items()))))


def two_shards(clock: FakeClock | None = None) -> FleetCollector:
    c = FleetCollector(2, clock=clock or FakeClock())
    c.shard_started(0, pid=100)
    c.shard_started(1, pid=101)
    return c


def test_per_shard_gauges_and_task_total() -> None:
    c = two_shards()
    c.update(0, snapshot(active=120))
    c.update(1, snapshot(active=80))
    assert value(c, "fleetd_active_connections", shard="0") == 120
    assert value(c, "fleetd_active_connections", shard="1") == 80
    assert value(c, "fleetd_task_active_connections") == 200
    assert c.task_active_connections() == 200
    assert value(c, "fleetd_shards_running") == 2


def test_dead_shard_gauges_vanish_at_once() -> None:
    c = two_shards()
    c.update(0, snapshot(active=120))
    c.update(1, snapshot(active=80))
    c.shard_exited(1)
    assert value(c, "fleetd_active_connections", shard="1") is None
    assert value(c, "fleetd_session_live", shard="1") is None
    assert value(c, "fleetd_task_active_connections") == 120
    c.update(1, snapshot(active=80))  # a late snapshot of the dead incarnation must not resurrect it
    assert value(c, "fleetd_active_connections", shard="1") is None


def test_counters_never_decrease_across_restart() -> None:
    c = two_shards()
    c.update(1, snapshot(claims=50, messages=1000, batches=(0.003, 0.2)))
    assert value(c, "fleetd_lease_claims_total", result="won", shard="1") == 50
    c.shard_exited(1)
    assert value(c, "fleetd_lease_claims_total", result="won", shard="1") == 50  # counters stay when it dies
    c.shard_started(1, pid=102, restart=True)
    c.update(1, snapshot(claims=7, messages=30, batches=(0.003,)))  # the new incarnation counts from 0
    assert value(c, "fleetd_lease_claims_total", result="won", shard="1") == 57
    assert value(c, "fleetd_messages_total", shard="1") == 1030
    assert value(c, "fleetd_sink_batch_seconds_count", shard="1") == 3
    assert value(c, "fleetd_shard_restarts_total", shard="1") == 1
    assert value(c, "fleetd_shard_restarts_total", shard="0") == 0


def test_required_families_present_at_zero_before_any_report() -> None:
    c = two_shards()
    families = {f.name: f for f in text_string_to_metric_families(exposition(c).decode())}
    for fam in REQUIRED:
        parsed_name = "fleetd_" + fam.name.removesuffix("_total")
        assert parsed_name in families, fam.name
        assert families[parsed_name].type == fam.kind
        assert families[parsed_name].samples, f"{fam.name} has no series"
    assert value(c, "fleetd_lease_claims_total", result="lost", shard="0") == 0
    assert value(c, "fleetd_self_fence_total", shard="1") == 0
    assert value(c, "fleetd_upstream_frames_rejected_total", reason="oversized", shard="0") == 0
    assert value(c, "fleetd_active_connections", shard="0") == 0
    assert value(c, "fleetd_task_active_connections") == 0
    assert value(c, "fleetd_sink_batch_seconds_count", shard="0") == 0


def test_histogram_exposition_is_cumulative_and_valid() -> None:
    c = two_shards()
    c.update(0, snapshot(batches=(0.0005, 0.003, 0.003, 0.2, 99.0)))
    fam = next(f for f in text_string_to_metric_families(exposition(c).decode())
               if f.name == "fleetd_sink_batch_seconds")
    assert fam.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in fam.samples
               if s.name.endswith("_bucket") and s.labels["shard"] == "0"]
    assert len(buckets) == len(LATENCY_BUCKETS) + 1
    assert buckets[-1] == ("+Inf", 5)
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    le = dict(buckets)
    assert le["0.001"] == 1 and le["0.005"] == 3 and le["0.25"] == 4 and le["10.0"] == 4
    assert value(c, "fleetd_sink_batch_seconds_count", shard="0") == 5
    assert abs((value(c, "fleetd_sink_batch_seconds_sum", shard="0") or 0) - 99.2065) < 1e-9


def lag_buckets(c: FleetCollector, shard: str) -> dict[str, float]:
    fam = next(f for f in text_string_to_metric_families(exposition(c).decode())
               if f.name == "fleetd_event_loop_lag_seconds")
    assert fam.type == "histogram"
    return {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket") and s.labels["shard"] == shard}


def test_event_loop_lag_is_a_histogram_of_its_own_buckets_from_the_first_scrape() -> None:
    c = two_shards()
    le = [repr(b) for b in LAG_BUCKETS] + ["+Inf"]
    assert list(lag_buckets(c, "0")) == le  # before any report: every bucket, at 0
    assert set(lag_buckets(c, "0").values()) == {0.0}
    c.update(0, snapshot(lags=(0.0, 0.001, 0.015, 0.15, 3.0)))
    got = lag_buckets(c, "0")
    assert list(got) == le
    assert got["0.001"] == 2 and got["0.02"] == 3 and got["0.1"] == 3 and got["0.25"] == 4 and got["2.5"] == 4
    assert got["+Inf"] == value(c, "fleetd_event_loop_lag_seconds_count", shard="0") == 5
    assert abs((value(c, "fleetd_event_loop_lag_seconds_sum", shard="0") or 0) - 3.166) < 1e-9


def test_event_loop_lag_buckets_never_decrease_across_restart() -> None:
    c = two_shards()
    c.update(1, snapshot(lags=(0.001, 0.3, 0.3)))
    before = lag_buckets(c, "1")
    c.shard_exited(1)
    assert lag_buckets(c, "1") == before  # a dead shard's lag stays counted
    c.shard_started(1, pid=102, restart=True)
    c.update(1, snapshot())  # the new incarnation reports its own, empty, histogram
    assert lag_buckets(c, "1") == before
    c.update(1, snapshot(lags=(0.001,)))
    after = lag_buckets(c, "1")
    assert all(after[le] >= n for le, n in before.items())
    assert after["0.001"] == 2 and after["+Inf"] == 4
    assert value(c, "fleetd_event_loop_lag_seconds_count", shard="1") == 4


def test_one_histogram_name_has_one_bucket_layout() -> None:
    stats = Stats()
    lag = stats.histogram("event_loop_lag_seconds", LAG_BUCKETS)
    assert stats.histogram("event_loop_lag_seconds", LAG_BUCKETS) is lag
    with pytest.raises(ValueError, match="buckets"):
        stats.observe("event_loop_lag_seconds", 0.5)  # observe() means LATENCY_BUCKETS


def test_unknown_stats_are_exported_with_prefix_and_labels() -> None:
    c = two_shards()
    stats = Stats()
    stats.inc("sink_errors_total", kind="throttled")
    stats.set("upstream_connected", 3)
    c.update(0, stats.snapshot())
    assert value(c, "fleetd_sink_errors_total", kind="throttled", shard="0") == 1
    assert value(c, "fleetd_upstream_connected", shard="0") == 3


def test_ready_needs_every_shard_live_and_fresh() -> None:
    clock = FakeClock()
    c = two_shards(clock)
    assert not c.ready()  # nothing reported yet
    c.update(0, snapshot())
    assert not c.ready()
    c.update(1, snapshot(live=0.0))
    assert not c.ready()  # shard 1's session is not live
    c.update(1, snapshot())
    assert c.ready()
    clock.now += READY_MAX_AGE_S + 0.5
    assert not c.ready()  # stale reports
    c.update(0, snapshot())
    c.update(1, snapshot())
    assert c.ready()
    c.shard_exited(0)
    assert not c.ready()
    c.shard_started(0, pid=7, restart=True)
    c.update(0, snapshot())
    assert c.ready()
    c.update(1, snapshot(stalled=2.0))
    assert not c.ready()  # shard 1's sink cannot write two streams' messages
    c.update(1, snapshot())
    assert c.ready()
    c.draining = True
    assert not c.ready()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_endpoints_on_an_ephemeral_port() -> None:
    c = two_shards()
    server = MetricsServer("127.0.0.1:0", c)
    server.start()
    try:
        assert server.port > 0
        status, body = get(server.url + "/metrics")
        assert status == 200 and "fleetd_task_active_connections 0.0" in body
        assert get(server.url + "/healthz")[0] == 200
        assert get(server.url + "/readyz")[0] == 503
        c.update(0, snapshot())
        c.update(1, snapshot())
        assert get(server.url + "/readyz")[0] == 200
        assert get(server.url + "/nope")[0] == 404
    finally:
        server.stop()


def test_idle_and_slow_clients_neither_block_a_scrape_nor_hold_a_thread_for_long() -> None:
    """100 sockets that send nothing and 20 that send half a request: a scrape still answers at once,
    and the server lets go of each silent socket after its idle timeout."""
    server = MetricsServer("127.0.0.1:0", two_shards())
    server.start()
    idle: list[socket.socket] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(100)]
        for s in idle[:20]:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: slow\r\n")  # never ends its headers
        started = time.monotonic()
        status, body = get(server.url + "/metrics")
        assert status == 200 and "fleetd_task_active_connections" in body
        assert time.monotonic() - started < 5, "a scrape waited behind idle clients"
        for s in idle:
            s.settimeout(CLIENT_IDLE_TIMEOUT_S + 10)
            assert s.recv(1) == b"", "the server must close a silent client's socket"
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_clients_past_the_cap_are_refused_and_counted() -> None:
    server = MetricsServer("127.0.0.1:0", two_shards(), max_clients=5)
    server.start()
    held: list[socket.socket] = []
    try:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(5)]
        wait_until(lambda: server.clients == 5)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert extra.recv(1) == b"", "a client past the cap is closed at once"
        extra.close()
        assert server.refused >= 1
        for s in held:
            s.close()
        wait_until(lambda: server.clients == 0)
        assert get(server.url + "/healthz")[0] == 200
    finally:
        for s in held:
            s.close()
        server.stop()


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
