"""Scenario ``cost``: DynamoDB request units per connection-hour, fleetd vs baseline.

From the density measurement at the first point (700 connections unless the
profile is smaller) — counted requests with their consumed capacity (see
:mod:`bench.meter`), GSI writes included — split into *coordination* (the
connections and sessions tables: claims, renewals, desired-state reads,
checkpoints, releases, reconciliation queries) and *message writes* (the messages
table, one write unit per message in both designs), converted to dollars with the
seed's price basis.
"""

from __future__ import annotations

from typing import Any

from bench import density
from bench.common import Context
from bench.meter import USD_PER_READ_UNIT, USD_PER_WRITE_UNIT


def run(ctx: Context, density_result: dict[str, Any] | None = None) -> dict[str, Any]:
    n = ctx.profile.density_points[0]
    points = [p for p in (density_result or {}).get("points", []) if p["connections"] == n]
    by_system = {p["system"]: p for p in points}
    for kind in density.SYSTEMS:
        if kind not in by_system:
            by_system[kind] = density.measure_point(ctx, kind, n, base_rss=0)
    rows = {kind: per_connection_hour(by_system[kind]) for kind in density.SYSTEMS}
    ratios = {k: _ratio(rows["baseline"][k], rows["fleetd"][k]) for k in rows["fleetd"]}
    return {"connections": n, "per_connection_hour": rows, "baseline_over_fleetd": ratios,
            "price_basis": {"usd_per_million_write_units": USD_PER_WRITE_UNIT * 1e6,
                            "usd_per_million_read_units": USD_PER_READ_UNIT * 1e6}}


def per_connection_hour(point: dict[str, Any]) -> dict[str, float]:
    hours = point["connection_minutes"] / 60.0
    coord_w = coord_r = msg_w = msg_r = index_w = 0.0
    for key, u in point["usage"].items():
        table_kind = key.split(":", 1)[1]
        writes = u["write_units"] + u["index_write_units"]
        if table_kind == "messages":
            msg_w += writes
            msg_r += u["read_units"]
        else:
            coord_w += writes
            coord_r += u["read_units"]
            index_w += u["index_write_units"]
    coord_units = coord_w + coord_r
    return {
        "coordination_write_units": coord_w / hours,
        "coordination_index_write_units": index_w / hours,
        "coordination_read_units": coord_r / hours,
        "coordination_units": coord_units / hours,
        "coordination_usd": (coord_w * USD_PER_WRITE_UNIT + coord_r * USD_PER_READ_UNIT) / hours,
        "message_write_units": msg_w / hours,
        "message_usd": (msg_w * USD_PER_WRITE_UNIT + msg_r * USD_PER_READ_UNIT) / hours,
        "dynamodb_calls": point["dynamodb_calls_per_connection_minute"] * 60.0,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b > 0 else None
