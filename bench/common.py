"""What every benchmark scenario shares: the profile sizes, the run context, progress, upstream pools.

A :class:`Context` owns the local stack (dynalite + moto), the metering proxy in
front of dynalite, fresh tables per measurement, and every child process it
starts, so a scenario cannot leak processes: :meth:`Context.close` stops them all.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.faults.proxy import ProxyThread
from bench.meter import MeteringProxy, Peak, Usage, diff, key_schemas, start_metering
from bench.procs import UpstreamProc, ddb, scan_all, seed_items
from bench.profile import fast, fast_env
from bench.sut import System, Tables
from fleetd.config import Config
from fleetd.devstack import DevStack
from fleetd.metrics import scrape


@dataclass(frozen=True)
class Profile:
    """How big and how long each scenario runs: ``smoke`` (CI), ``quick`` (≤ 15 min for all), ``full``."""

    name: str
    density_points: tuple[int, ...]
    density_window_s: float
    throughput_connections: int
    throughput_rates: tuple[float, ...]  # msgs/s per connection, rising
    throughput_window_s: float
    failover_connections: int
    failover_trials: int
    failover_rate: float
    fast_timings: bool  # smoke: short leases so a CI run finishes in minutes


PROFILES = {
    "smoke": Profile("smoke", (100,), 12.0, 100, (5.0,), 3.0, 60, 1, 1.0, True),
    "quick": Profile("quick", (700, 2000, 5000), 15.0, 700, (1.0, 50.0, 300.0), 5.0, 600, 2, 0.5, False),
    "full": Profile("full", (700, 2000, 5000), 60.0, 700, (1.0, 10.0, 50.0, 100.0, 200.0, 300.0, 500.0), 15.0,
                    1500, 20, 0.1, False),
}

# The smoke profile (CI) runs fleetd on the fast profile, and the baseline on the same lease timings.
_PRODUCT = Config()
# Upstream and AWS failure detection stay at product values, as they do for the baseline (which is given
# only the lease timings below): the two systems compared like for like.
_SMOKE_OVERRIDES: dict[str, Any] = {
    "backoff_max_s": _PRODUCT.upstream.backoff_max_s, "ping_idle_s": _PRODUCT.upstream.ping_idle_s,
    "ping_reply_s": _PRODUCT.upstream.ping_reply_s, "aws_timeout_s": _PRODUCT.aws.aws_timeout_s}
SMOKE = fast(**_SMOKE_OVERRIDES)
FAST_FLEETD = fast_env(**_SMOKE_OVERRIDES)
FAST_BASELINE = ("--heartbeat-s", str(SMOKE.lease.heartbeat_s), "--lease-ttl-s", str(SMOKE.lease.lease_ttl_s),
                 "--safety-margin-s", str(SMOKE.lease.safety_margin_s),
                 "--reconcile-s", "2",  # the baseline's value since the harness began (6a65cf8), no reason recorded
                 "--desired-state-s", str(SMOKE.lease.desired_state_s))


class Progress:
    """One line per step on stderr, with the time since the run started."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, message: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - self.t0:7.1f}s] {message}\n")
        sys.stderr.flush()


@dataclass
class Context:
    out: Path
    profile: Profile
    progress: Progress = field(default_factory=Progress)
    stack: DevStack | None = None
    meter_thread: ProxyThread | None = None
    meter: MeteringProxy | None = None
    children: list[System | UpstreamProc] = field(default_factory=list)
    upstream_count: int = 0
    meter_keys: bool = False  # failover and cold_start: systems through the metering proxy, hot keys measured
    throttle_keys: bool = False  # the metering proxy throttles keys past DynamoDB's per-key limits

    # ----- lifecycle ---------------------------------------------------------------------------------

    def open(self) -> Context:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        self.stack = DevStack(log_dir=self.out / "logs")
        self.stack.start()
        self.stack.apply_env()
        return self

    def close(self) -> None:
        for child in reversed(self.children):
            with contextlib.suppress(Exception):
                child.stop()
        self.children.clear()
        if self.meter_thread is not None:
            self.meter_thread.stop()
        if self.stack is not None:
            self.stack.stop()

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    # ----- tables, metering, upstreams ---------------------------------------------------------------

    def fresh_tables(self) -> Tables:
        """New tables and queue (``fleetd init``), and a metering proxy that knows their indexes."""
        prefix = f"b{uuid.uuid4().hex[:8]}"
        tables = Tables(f"{prefix}-connections", f"{prefix}-sessions", f"{prefix}-messages", f"{prefix}-hints")
        env = dict(os.environ, FLEETD_CONNECTIONS_TABLE=tables.connections, FLEETD_SESSIONS_TABLE=tables.sessions,
                   FLEETD_MESSAGES_TABLE=tables.messages, FLEETD_HINTS_QUEUE=tables.queue)
        subprocess.run([sys.executable, "-m", "fleetd", "init"], env=env, check=True, capture_output=True)
        if self.meter_thread is not None:
            self.meter_thread.stop()
        keys = key_schemas(ddb(), [tables.connections, tables.sessions, tables.messages])
        self.meter_thread, self.meter = start_metering(os.environ["AWS_ENDPOINT_URL_DYNAMODB"], keys,
                                                       throttle=self.throttle_keys)
        return tables

    def sut_env(self, metered: bool = True) -> dict[str, str]:
        """The environment of a system under test: DynamoDB through the metering proxy, or direct.

        The proxy is one Python thread: fine for counting an idle fleet's requests, but a
        hand-over's burst of releases and claims would queue behind it, so the failover
        scenario talks to dynalite directly.
        """
        assert self.meter_thread is not None, "fresh_tables() first"
        return dict(os.environ) if not metered else dict(os.environ, AWS_ENDPOINT_URL_DYNAMODB=self.meter_thread.url)

    def usage(self) -> dict[tuple[str, str], Usage]:
        assert self.meter is not None
        return self.meter.tally.snapshot()

    def prime_meter(self, tables: Tables) -> None:
        """Show the metering proxy the connection items seeded behind its back (their index keys)."""
        if self.meter is not None:
            self.meter.prime(tables.connections, scan_all(tables.connections, ConsistentRead=True))

    def hot_keys(self, since: float, until: float, tables: Tables) -> dict[str, Any]:
        """The hottest key's busiest second, for writes and for reads, in ``[since, until]`` (monotonic),
        and the requests throttled then (``--throttle-keys``)."""
        assert self.meter is not None
        hot = self.meter.hot
        refused = hot.refused(since, until)
        return {"writes": _peak(hot.peak("write", since, until), tables),
                "reads": _peak(hot.peak("read", since, until), tables),
                "throttled": sum(refused.values()),
                "throttled_keys": {short_key(k, tables): n for k, n in refused.most_common(3)}}

    def writes_per_stream(self, since: float, until: float, tables: Tables, ids: list[str]) -> dict[str, Any]:
        """Writes on the connections table per stream of ``ids`` in ``[since, until]`` (monotonic): what
        moving each cost (claims, takes, releases, pushes, checkpoints; failed conditional writes too)."""
        assert self.meter is not None
        counts = self.meter.item_writes(tables.connections, since, until)
        per = [counts.get(cid, 0) for cid in ids]
        return {"mean": round(sum(per) / len(per), 3) if per else None, "max": max(per, default=None),
                "streams": len(per)}

    def upstreams(self, count: int, rate: float, size: int = 200) -> UpstreamPool:
        self.upstream_count += count
        pool = UpstreamPool([UpstreamProc(self.logs, rate=rate, size=size, name=f"upstream-{self.upstream_count - i}")
                             for i in range(count)])
        self.children += pool.procs
        return pool

    def started(self, system: System) -> System:
        self.children.append(system)
        return system

    def stop(self, child: System | UpstreamProc) -> None:
        with contextlib.suppress(Exception):
            child.stop()
        if child in self.children:
            self.children.remove(child)


@dataclass
class UpstreamPool:
    """Fake upstream processes; connection ``i`` goes to upstream ``i % len``."""

    procs: list[UpstreamProc]

    def urls(self, ids: list[str]) -> dict[str, str]:
        return {cid: self.procs[i % len(self.procs)].url(cid) for i, cid in enumerate(ids)}

    def streams(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for p in self.procs:
            merged.update(p.stats())
        return merged

    def attached(self) -> int:
        return sum(1 for s in self.streams().values() if s["attached"] > 0)


def seed(tables: Tables, pool: UpstreamPool, count: int, prefix: str = "c") -> list[str]:
    ids = [f"{prefix}{i:05d}" for i in range(count)]
    seed_items(tables.connections, pool.urls(ids))
    return ids


def wait_attached(pool: UpstreamPool, count: int, timeout_s: float, progress: Progress, what: str,
                  system: System | None = None) -> tuple[float | None, int]:
    """Seconds until ``count`` streams have a client (None if never), and the most seen."""
    t0 = time.monotonic()
    best, last_note = 0, t0
    while time.monotonic() - t0 < timeout_s:
        n = pool.attached()
        best = max(best, n)
        if n >= count:
            return time.monotonic() - t0, n
        if system is not None and not system.alive():
            break
        if time.monotonic() - last_note > 5:
            progress(f"{what}: {n}/{count} connected")
            last_note = time.monotonic()
        time.sleep(0.25)
    return None, best


def metrics(url: str) -> dict[str, float]:
    """A fleetd supervisor's /metrics, summed over labels other than the histogram bucket bound."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in scrape(text):
        key = f"{name}{{le={labels['le']}}}" if "le" in labels else name
        out[key] = out.get(key, 0.0) + value
    return out


def usage_by_op(window: dict[tuple[str, str], Usage], tables: Tables) -> dict[str, dict[str, float]]:
    """Per ``op:table-kind`` (connections / sessions / messages) usage of a window."""
    kinds = {tables.connections: "connections", tables.sessions: "sessions", tables.messages: "messages"}
    out: dict[str, dict[str, float]] = {}
    for (op, table), u in sorted(window.items()):
        if u.calls:
            out[f"{op}:{kinds.get(table, table)}"] = u.as_dict()
    return out


def short_key(key: str, tables: Tables) -> str:
    """A hot key's label with the run's table name shortened to its kind (``connections/by_owner:…``)."""
    for name, kind in ((tables.connections, "connections"), (tables.sessions, "sessions"),
                       (tables.messages, "messages")):
        if key.startswith(name):
            return kind + key[len(name):]
    return key


def _peak(peak: Peak | None, tables: Tables) -> dict[str, Any] | None:
    return None if peak is None else {"units_per_s": round(peak.units_per_s, 1), "key": short_key(peak.key, tables)}


def window_usage(ctx: Context, before: dict[tuple[str, str], Usage]) -> dict[tuple[str, str], Usage]:
    return diff(ctx.usage(), before)


@contextlib.contextmanager
def opened(out: Path, profile: Profile, meter_keys: bool = False, throttle_keys: bool = False) -> Iterator[Context]:
    ctx = Context(out, profile, meter_keys=meter_keys or throttle_keys, throttle_keys=throttle_keys).open()
    try:
        yield ctx
    finally:
        ctx.close()
