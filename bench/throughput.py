"""Scenario ``throughput``: one shard, N connections, a rising message rate until the sink falls behind.

For each sink (fleetd with ``discard``, fleetd with ``dynamodb``, the baseline's
PutItem per message) and each rate step: fresh tables, fake upstreams producing
``rate`` msgs/s per connection, the system started and given all streams, then a
window in which the ingest rate is measured from outside — the messages the fake
upstreams *sent* (a system that falls behind stops reading, TCP backpressure
holds the upstream back) — and from inside for fleetd (``fleetd_messages_total``).
Latency upstream → receive comes from message items (``received_at_ms`` minus the
upstream's production timestamp in the payload); receive → durable from fleetd's
``sink_latency_seconds`` histogram.  A step whose ingest is below 90 % of the
offered rate ends the ladder: that sink has fallen behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import Context, UpstreamPool, metrics, seed, wait_attached
from bench.meter import sample
from bench.procs import ddb
from bench.sut import System, Tables, baseline_worker, fleetd_task, read_json

BEHIND = 0.9
CONNECT_TIMEOUT_S = 45.0
SINKS = (("fleetd", "discard"), ("fleetd", "dynamodb"), ("baseline", "dynamodb"))


def run(ctx: Context) -> dict[str, Any]:
    ladders: list[dict[str, Any]] = []
    for kind, sink in SINKS:
        steps: list[dict[str, Any]] = []
        for rate in ctx.profile.throughput_rates:
            step = measure_step(ctx, kind, sink, rate)
            steps.append(step)
            ctx.progress(f"throughput {kind}/{sink} {rate:g}/s/conn: offered {step['offered_msgs_s']:.0f}, "
                         f"ingest {step['ingest_msgs_s']:.0f} msgs/s, cpu {step['cpu_percent']:.0f} %")
            if not sustained(step):
                break
        best = max(steps, key=lambda s: s["ingest_msgs_s"])
        ladders.append({"system": kind, "sink": sink, "steps": steps, "max_ingest_msgs_s": best["ingest_msgs_s"],
                        "max_sustained_msgs_s": max([s["ingest_msgs_s"] for s in steps if sustained(s)],
                                                    default=0.0)})
    return {"connections": ctx.profile.throughput_connections, "ladders": ladders}


def measure_step(ctx: Context, kind: str, sink: str, rate: float) -> dict[str, Any]:
    n = ctx.profile.throughput_connections
    tables = ctx.fresh_tables()
    pool = ctx.upstreams(2, rate, size=200)
    seed(tables, pool, n)
    system, url, stats_file = start(ctx, kind, sink, tables, n)
    connect_s, best = wait_attached(pool, n, CONNECT_TIMEOUT_S, ctx.progress,
                                    f"throughput {kind}/{sink} {rate:g}", system)
    time.sleep(2.0)
    c0, sent0, s0 = accepted(url, stats_file), total_sent(pool), sample([system.pid])
    m0 = metrics(url) if url else {}
    time.sleep(ctx.profile.throughput_window_s)
    c1, sent1, s1 = accepted(url, stats_file), total_sent(pool), sample([system.pid])
    m1 = metrics(url) if url else {}
    seconds = s1.at - s0.at
    step: dict[str, Any] = {
        "rate_per_connection": rate, "connections": n, "offered_msgs_s": rate * n, "connected_s": connect_s,
        "connected": best, "held_at_end": pool.attached(),
        "ingest_msgs_s": (c1 - c0) / seconds, "upstream_sent_msgs_s": (sent1 - sent0) / seconds,
        "cpu_percent": 100.0 * (s1.cpu_s - s0.cpu_s) / seconds,
    }
    if m1:
        step["sink_latency_s"] = histogram_quantiles(m0, m1, "fleetd_sink_latency_seconds")
    if sink == "dynamodb":
        step["upstream_to_receive_ms"] = receive_lag(tables, pool)
    ctx.stop(system)
    for p in pool.procs:
        ctx.stop(p)
    return step


def sustained(step: dict[str, Any]) -> bool:
    """Kept up: took in ≥ 90 % of the offered rate with every stream connected to the end."""
    return bool(step["ingest_msgs_s"] >= BEHIND * step["offered_msgs_s"]
                and step["held_at_end"] >= step["connections"])


def accepted(metrics_url: str, stats_file: Path | None) -> float:
    """Messages the system has taken in so far: fleetd's ``messages_total``, the baseline's written count."""
    if metrics_url:
        return metrics(metrics_url).get("fleetd_messages_total", 0.0)
    assert stats_file is not None
    return float(read_json(stats_file).get("messages", 0))


def start(ctx: Context, kind: str, sink: str, tables: Tables, n: int) -> tuple[System, str, Path | None]:
    if kind == "fleetd":
        system, url = fleetd_task("t", 1, tables, ctx.logs, ctx.sut_env(), FLEETD_SINK=sink,
                                  FLEETD_MAX_CONNECTIONS_PER_SHARD=str(n))
        return ctx.started(system), url, None
    system, stats_file = baseline_worker("t", tables, ctx.logs, ctx.sut_env())
    return ctx.started(system), "", stats_file


def total_sent(pool: UpstreamPool) -> int:
    return sum(int(s["sent"]) for s in pool.streams().values())


def histogram_quantiles(m0: dict[str, float], m1: dict[str, float], name: str) -> dict[str, float | None]:
    """p50/p99 of a Prometheus histogram over a window (upper bucket bound that reaches the rank)."""
    prefix = f"{name}_bucket{{le="
    buckets = sorted(((float(k[len(prefix):-1]), m1[k] - m0.get(k, 0.0)) for k in m1 if k.startswith(prefix)),
                     key=lambda b: b[0])
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, float | None] = {}
    for q in (0.5, 0.99):
        out[f"p{int(q * 100)}"] = next((le for le, c in buckets if total and c >= q * total), None)
    return out


def receive_lag(tables: Tables, pool: UpstreamPool, sample_size: int = 2000) -> dict[str, float | None]:
    """received_at_ms − the upstream's production time, over the most recent message items of a few streams."""
    client = ddb()
    lags: list[float] = []
    for cid in list(pool.streams())[:20]:
        resp = client.query(TableName=tables.messages, KeyConditionExpression="connection_id = :c",
                            ExpressionAttributeValues={":c": {"S": cid}}, ScanIndexForward=False,
                            Limit=sample_size // 20)
        for item in resp.get("Items", []):
            ts = orjson.loads(item["payload"]["S"]).get("ts_ms")
            if isinstance(ts, int | float):
                lags.append(float(item["received_at_ms"]["N"]) - ts)
    lags.sort()
    if not lags:
        return {"p50": None, "p99": None, "samples": 0}
    return {"p50": lags[len(lags) // 2], "p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
            "samples": float(len(lags))}
