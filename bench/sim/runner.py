"""Run seeds: one in this process (with a trace), or many over worker processes.

``run_seed`` builds a seed's :class:`~bench.sim.world.World` (optionally under a named
scenario), runs it, tears it down and returns a :class:`SeedResult`.  ``run_many``
spreads seeds over ``jobs`` forked workers, in chunks, and yields results in seed order.
Workers are forked from a process whose ``PYTHONHASHSEED`` is fixed (``__main__``
re-execs itself otherwise), so set and dict iteration orders match a replay's.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.sim.scenarios import SCENARIOS
from bench.sim.world import World, build_params, silence_fleetd


@dataclass(slots=True)
class SeedResult:
    seed: int
    scenario: str
    violations: int
    invariants: dict[str, int]
    details: list[dict[str, Any]]
    shard_minutes: float
    wall_s: float
    requests: int
    steps: int
    errors: list[str] = field(default_factory=list)
    trace_hash: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_world(seed: int, long: bool = False, scenario: str = "", trace: bool = False) -> World:
    params = build_params(seed, long)
    sc = SCENARIOS[scenario] if scenario else None
    if sc is not None and sc.tweak is not None:
        sc.tweak(params)
    world = World(params, trace=trace)
    if sc is not None and sc.setup is not None:
        sc.setup(world)
    return world


def run_seed(seed: int, long: bool = False, scenario: str = "", trace: bool = False) -> tuple[SeedResult, World]:
    started = time.perf_counter()
    world = build_world(seed, long, scenario, trace)
    try:
        with silence_fleetd(world.say if trace else None):
            world.run()
    finally:
        errors = world.errors()
        world.teardown()
    ck = world.checker
    result = SeedResult(seed, scenario, sum(ck.counts.values()), dict(sorted(ck.counts.items())),
                        [v.to_json() for v in ck.violations[:10]], round(world.shard_seconds / 60, 3),
                        round(time.perf_counter() - started, 4), world.net.sent, world.sched.steps, errors[:5],
                        world.trace_hash() if trace else "")
    return result, world


def _work(args: tuple[int, bool, str]) -> SeedResult:
    return run_seed(*args)[0]


def run_many(seeds: list[int], jobs: int, long: bool = False, scenario: str = "") -> Iterator[SeedResult]:
    """Results in seed order (workers take chunks; order restored as they arrive)."""
    work = [(s, long, scenario) for s in seeds]
    if jobs <= 1:
        for w in work:
            yield _work(w)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs, maxtasksperchild=500) as pool:
        yield from pool.imap(_work, work, chunksize=max(1, min(25, len(work) // (jobs * 8) or 1)))
