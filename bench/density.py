"""Scenario ``density``: idle-ish connections (1 msg / 10 s) held by one fleetd shard vs one baseline process.

Per point (system, N): start the system on fresh tables with N STARTED items, time
until every stream has a client, let it settle, then measure a window: RSS and
CPU of its process tree (psutil, from outside), and its DynamoDB requests by
operation with their capacity units (the metering proxy).  RSS per connection is
``(RSS with N − RSS of the same system holding nothing) / N``.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import FAST_BASELINE, FAST_FLEETD, Context, seed, usage_by_op, wait_attached, window_usage
from bench.meter import sample
from bench.sut import System, baseline_worker, fleetd_task

IDLE_RATE = 0.1  # msgs/s per connection
SYSTEMS = ("fleetd", "baseline")


def start_system(ctx: Context, kind: str, tables: Any, capacity: int, name: str = "d") -> System:
    if kind == "fleetd":
        timings = FAST_FLEETD if ctx.profile.fast_timings else {}
        system, _ = fleetd_task(name, 1, tables, ctx.logs, ctx.sut_env(),
                                FLEETD_MAX_CONNECTIONS_PER_SHARD=str(capacity), **timings)
    else:
        extra = FAST_BASELINE if ctx.profile.fast_timings else ()
        system, _ = baseline_worker(name, tables, ctx.logs, ctx.sut_env(), *extra)
    return ctx.started(system)


def empty_rss(ctx: Context, kind: str) -> int:
    """RSS of the system holding nothing (after boot), the base of RSS per connection."""
    tables = ctx.fresh_tables()
    system = start_system(ctx, kind, tables, 10)
    time.sleep(4.0)
    rss = sample([system.pid]).rss_bytes
    ctx.stop(system)
    return rss


def measure_point(ctx: Context, kind: str, n: int, base_rss: int) -> dict[str, Any]:
    """One (system, N) point; ``held`` < N means the system could not hold them all."""
    tables = ctx.fresh_tables()
    pool = ctx.upstreams(1 if n <= 2500 else 2, IDLE_RATE)
    ids = seed(tables, pool, n)
    t0 = time.monotonic()
    system = start_system(ctx, kind, tables, n)
    connect_s, best = wait_attached(pool, n, 30 + n / 40, ctx.progress, f"density {kind} {n}", system)
    ctx.progress(f"density {kind} {n}: {best}/{n} connected" + (f" in {connect_s:.1f} s" if connect_s else ""))
    time.sleep(3.0)
    before, s0 = ctx.usage(), sample([system.pid])
    time.sleep(ctx.profile.density_window_s)
    s1, window = sample([system.pid]), window_usage(ctx, before)
    held_end = pool.attached()
    point = summarize(kind, n, base_rss, s0.at, s1, s0.cpu_s, window, tables)
    point.update(seconds_to_all_connected=connect_s, max_connected=best, held_at_end=held_end,
                 held=connect_s is not None and held_end >= n, alive=system.alive(),
                 startup_s=time.monotonic() - t0, connections_seeded=len(ids))
    ctx.stop(system)
    for p in pool.procs:
        ctx.stop(p)
    return point


def summarize(kind: str, n: int, base_rss: int, t0: float, s1: Any, cpu0: float, window: Any,
              tables: Any) -> dict[str, Any]:
    minutes = (s1.at - t0) / 60.0
    conn_minutes = n * minutes
    by_op = usage_by_op(window, tables)
    calls = sum(v["calls"] for v in by_op.values())
    return {
        "system": kind, "connections": n, "window_s": round(s1.at - t0, 1),
        "rss_bytes": s1.rss_bytes, "rss_empty_bytes": base_rss,
        "rss_per_connection_bytes": (s1.rss_bytes - base_rss) / n,
        "cpu_s": s1.cpu_s - cpu0,
        "cpu_ms_per_connection_minute": (s1.cpu_s - cpu0) * 1000.0 / conn_minutes,
        "dynamodb_calls_per_connection_minute": calls / conn_minutes,
        "calls_per_connection_minute_by_op": {k: v["calls"] / conn_minutes for k, v in by_op.items()},
        "usage": by_op,
        "connection_minutes": conn_minutes,
    }


def run(ctx: Context) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    for kind in SYSTEMS:
        base = empty_rss(ctx, kind)
        ctx.progress(f"density {kind}: empty RSS {base / 2**20:.1f} MiB")
        for n in ctx.profile.density_points:
            point = measure_point(ctx, kind, n, base)
            points.append(point)
            ctx.progress(f"density {kind} {n}: held={point['held']} rss/conn={point['rss_per_connection_bytes']:.0f} B "
                         f"cpu={point['cpu_ms_per_connection_minute']:.2f} ms/conn-min "
                         f"calls={point['dynamodb_calls_per_connection_minute']:.2f}/conn-min")
            if not point["held"]:
                break  # "as many as it can hold": larger points would only fail harder
    return {"idle_rate_per_connection": IDLE_RATE, "points": points}
