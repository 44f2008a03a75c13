"""``python -m bench.sim``: run seeded simulations of fleetd and check its invariants.

    python -m bench.sim --seeds 10000 --jobs 2 --out sim.jsonl      # CI
    python -m bench.sim --seeds 2000 --long --jobs 2 --out long.jsonl
    python -m bench.sim --seed 17 --trace                           # replay one seed, print its trace
    python -m bench.sim --seed 3 --scenario late_renewal --trace    # a scripted schedule
    python -m bench.sim --list-scenarios

Batch mode writes one JSON line per seed to ``--out`` (its result, the invariants it
broke and the first details), prints each failing seed and the invariant broken, and
prints one JSON summary line last: ``{"seeds", "violations", "failing_seeds",
"simulated_shard_minutes", "wall_s", ...}``.  Exit status 1 on any violation.

The process re-execs itself with ``PYTHONHASHSEED=0`` when that is not already set, so
a seed replays identically (set and dict iteration order depends on string hashing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.sim.runner import SeedResult, run_many, run_seed
from bench.sim.scenarios import SCENARIOS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=0, help="how many seeds to run (batch mode)")
    p.add_argument("--start", type=int, default=0, help="first seed of the batch")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--long", action="store_true", help="longer, larger scenarios (default timings half the time)")
    p.add_argument("--scenario", default="", choices=["", *sorted(SCENARIOS)], help="a scripted schedule")
    p.add_argument("--out", default="", help="JSON lines file of per-seed results (batch mode)")
    p.add_argument("--seed", type=int, default=None, help="replay one seed")
    p.add_argument("--trace", action="store_true", help="with --seed: print the event trace")
    p.add_argument("--list-scenarios", action="store_true")
    return p


def _ensure_hash_seed() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable, "-m", "bench.sim", *sys.argv[1:]], env)


def _one(args: argparse.Namespace) -> int:
    result, world = run_seed(args.seed, args.long, args.scenario, trace=args.trace)
    if args.trace:
        p = world.p
        print(f"# seed {p.seed} scenario={args.scenario or '-'} tasks={p.tasks}x{p.shards_per_task} conns={p.conns} "
              f"mode={p.cfg.lease.lease_mode} ttl={p.cfg.lease.lease_ttl_s} faults_until={p.faults_until:.2f}s "
              f"bound={p.bound_s:.2f}s fault_rates={ {k: round(v, 3) for k, v in p.mix.rates.items()} }")
        print(f"# events: {[(round(e.at - 1000, 2), e.kind) for e in p.events]}")
        for line in world.lines or []:
            print(line)
    print(json.dumps(result.to_json()))
    return 1 if result.violations else 0


def _batch(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    seeds = list(range(args.start, args.start + args.seeds))
    totals: dict[str, Any] = {"seeds": 0, "violations": 0, "failing_seeds": 0, "simulated_shard_minutes": 0.0,
                              "requests": 0, "by_invariant": {}}
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
    try:
        for r in run_many(seeds, args.jobs, args.long, args.scenario):
            _account(totals, r)
            if out is not None:
                out.write(json.dumps(r.to_json()) + "\n")
                out.flush()
            if r.violations:
                first = r.details[0] if r.details else {}
                print(f"seed {r.seed}: {', '.join(r.invariants)} — {first.get('detail', '')}", flush=True)
    finally:
        if out is not None:
            out.close()
    wall = time.perf_counter() - started
    totals["simulated_shard_minutes"] = round(totals["simulated_shard_minutes"], 1)
    totals.update(wall_s=round(wall, 2), seeds_per_s=round(totals["seeds"] / wall, 2), jobs=args.jobs,
                  long=args.long, scenario=args.scenario, start=args.start)
    print(json.dumps(totals))
    return 1 if totals["violations"] else 0


def _account(totals: dict[str, Any], r: SeedResult) -> None:
    totals["seeds"] += 1
    totals["violations"] += r.violations
    totals["failing_seeds"] += 1 if r.violations else 0
    totals["simulated_shard_minutes"] += r.shard_minutes
    totals["requests"] += r.requests
    for name in r.invariants:
        totals["by_invariant"][name] = totals["by_invariant"].get(name, 0) + 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_scenarios:
        for name, sc in sorted(SCENARIOS.items()):
            print(f"{name:14} {sc.doc}")
        return 0
    _ensure_hash_seed()
    if args.seed is not None:
        return _one(args)
    if args.seeds <= 0:
        _parser().error("give --seeds N (batch) or --seed S (replay)")
    return _batch(args)


if __name__ == "__main__":
    sys.exit(main())
