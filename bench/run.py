"""``python -m bench.run --scenario NAME --out DIR [--quick | --smoke]``: fleetd vs the seed design.

Scenarios: ``density``, ``throughput``, ``failover``, ``cost`` or ``all`` (those four), and
``cold_start``, run on its own (it starts and kills whole fleets: minutes even at smoke size).  The
run starts its own local stack (dynalite + moto), fake upstreams and systems under
test, shows progress on stderr, stops every process it started, and writes
``DIR/results.json``, ``DIR/report.md`` and PNG plots.  Results of other scenarios
already in ``DIR`` (same profile) are kept, so scenarios can be run one at a time.  ``--smoke`` is the CI
size (≤ 3 minutes for ``all``, short leases); ``--quick`` ≤ 15 minutes; neither
flag: the full run whose results are committed under ``bench/results/<date>/``.
``--meter-keys`` puts the metering proxy in front of the systems in ``failover`` and ``cold_start`` too
(they talk to dynalite directly otherwise) and reports the hottest key per event; ``--throttle-keys``
(implies it) has the proxy throttle keys past DynamoDB's per-key limits, as DynamoDB would.
``--systems fleetd`` (failover only) re-runs one system's trials and keeps the other's
from ``DIR``: the baseline's full-size trials take an hour and do not change with fleetd.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench import coldstart, cost, density, failover, report, throughput
from bench.common import PROFILES, Context, opened

SCENARIOS = ("density", "throughput", "failover", "cost")  # --scenario all
ALONE = ("cold_start",)  # not part of all


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--scenario", required=True, choices=(*SCENARIOS, *ALONE, "all"))
    p.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, plots")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="all scenarios in <= 15 minutes")
    size.add_argument("--smoke", action="store_true", help="CI size: <= 3 minutes, asserts invariants only")
    p.add_argument("--systems", default="fleetd,baseline",
                   help="failover only: the systems to run; the others' results already in --out are kept")
    p.add_argument("--meter-keys", action="store_true",
                   help="failover, cold_start: systems through the metering proxy; report the hottest key per event")
    p.add_argument("--throttle-keys", action="store_true",
                   help="the metering proxy throttles a key past DynamoDB's 1,000 WCU/s or 3,000 RCU/s per key "
                        "value (implies --meter-keys)")
    args = p.parse_args(argv)
    args.systems = tuple(x.strip() for x in args.systems.split(",") if x.strip())
    if not args.systems or set(args.systems) - set(failover.EVENTS):
        p.error(f"--systems takes a comma-separated subset of {','.join(failover.EVENTS)}")
    if args.scenario != "failover" and set(args.systems) != set(failover.EVENTS):
        p.error("--systems applies to --scenario failover only")
    return args


def earlier(out: Path, profile: str) -> dict[str, Any]:
    """Results of other scenarios already in ``out`` from a run of the same profile (kept and reported)."""
    try:
        doc = orjson.loads((out / "results.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return dict(doc["results"]) if doc.get("profile") == profile else {}


def run_scenarios(ctx: Context, names: tuple[str, ...],
                  systems: tuple[str, ...] = tuple(failover.EVENTS)) -> dict[str, Any]:
    before = earlier(ctx.out, ctx.profile.name)
    results = {k: v for k, v in before.items() if k not in names}
    kept = {k: v for k, v in before.get("failover", {}).items() if k in failover.EVENTS and k not in systems}
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "density": lambda: density.run(ctx),
        "throughput": lambda: throughput.run(ctx),
        "failover": lambda: {**kept, **failover.run(ctx, systems)},
        "cost": lambda: cost.run(ctx, results.get("density")),
        "cold_start": lambda: coldstart.run(ctx),
    }
    for name in names:
        t0 = time.monotonic()
        ctx.progress(f"scenario {name}: start")
        results[name] = steps[name]()
        results[name]["duration_s"] = round(time.monotonic() - t0, 1)
        results[name]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        ctx.progress(f"scenario {name}: done in {results[name]['duration_s']} s")
        write(ctx.out, results, ctx.profile.name)  # partial results survive a later failure
    return results


def write(out: Path, results: dict[str, Any], profile: str) -> None:
    doc = {"profile": profile, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": machine(), "results": results}
    (out / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    report.write(out, doc)


def machine() -> dict[str, Any]:
    import os

    import psutil

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = PROFILES["smoke" if args.smoke else "quick" if args.quick else "full"]
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    with opened(args.out, profile, meter_keys=args.meter_keys, throttle_keys=args.throttle_keys) as ctx:
        ctx.progress(f"bench {args.scenario} ({profile.name}) → {args.out}")
        run_scenarios(ctx, names, args.systems)
        ctx.progress(f"done: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
