"""The deterministic simulation (bench/sim): its machinery, its determinism, and that its invariants can fail.

No servers: everything runs in this process on virtual time.  The batch test runs a few
hundred seeds; CI runs ``python -m bench.sim --seeds 10000`` separately.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from bench.sim.__main__ import _parser
from bench.sim.runner import run_many, run_seed
from bench.sim.vloop import Scheduler, VirtualLoop, VirtualTime

REGRESSIONS = Path(__file__).resolve().parents[2] / "bench" / "sim" / "regressions.json"
BATCH_SEEDS = 300


def test_private_loop_api() -> None:
    """The CPython 3.11 internals the virtual loop relies on (vloop.py's pinned assumption)."""
    assert sys.version_info[:2] == (3, 11)
    assert hasattr(asyncio.BaseEventLoop, "_run_once")
    assert hasattr(asyncio.events, "_set_running_loop") and hasattr(asyncio.events, "_get_running_loop")
    vt = VirtualTime(100.0)
    sched = Scheduler(vt)
    loop = VirtualLoop(vt, "p")
    sched.add(loop)
    seen: list[tuple[str, float]] = []

    async def body() -> None:
        await asyncio.sleep(5)
        seen.append(("slept", asyncio.get_running_loop().time()))
        try:
            await asyncio.wait_for(asyncio.sleep(10), 2)
        except TimeoutError:
            seen.append(("timeout", vt.now))

    task = loop.create_task(body())
    sched.run_until(1000.0)
    assert task.done() and seen == [("slept", 105.0), ("timeout", 107.0)]
    assert vt.now == 1000.0


def test_paused_loop_is_not_stepped() -> None:
    vt = VirtualTime(0.0)
    sched = Scheduler(vt)
    a, b = VirtualLoop(vt, "a"), VirtualLoop(vt, "b")
    sched.add(a)
    fired: list[tuple[str, float]] = []
    a.call_at(1.0, lambda: fired.append(("a", vt.now)))
    b.call_at(1.0, lambda: fired.append(("b", vt.now)))
    sched.at(3.0, lambda: sched.add(b))  # b "resumes" at 3: its overdue timer fires then
    sched.run_until(10.0)
    assert fired == [("a", 1.0), ("b", 3.0)]


def test_same_seed_replays_identically() -> None:
    first, _ = run_seed(11, trace=True)
    second, _ = run_seed(11, trace=True)
    assert first.trace_hash and first.trace_hash == second.trace_hash
    assert (first.requests, first.steps, first.invariants) == (second.requests, second.steps, second.invariants)


def test_different_seeds_differ() -> None:
    assert run_seed(1, trace=True)[0].trace_hash != run_seed(2, trace=True)[0].trace_hash


def test_unsafe_clock_skew_breaks_one_streamer() -> None:
    """Skew far beyond safety_margin_s voids the guarantee (SPEC §3): the checker must see it."""
    broken = [run_seed(seed, scenario="unsafe_skew")[0] for seed in range(5)]
    assert sum(bool({"one_streamer_socket", "stale_write"} & set(r.invariants)) for r in broken) >= 3, broken


def test_corrupted_messages_table_is_lost_seq() -> None:
    corrupted, _ = run_seed(3, scenario="corrupt")
    assert "lost_seq" in corrupted.invariants, corrupted


def test_batch_runs_in_parallel_in_seed_order() -> None:
    results = list(run_many([5, 6, 7, 8], jobs=2))
    assert [r.seed for r in results] == [5, 6, 7, 8]
    assert [r.requests for r in results] == [run_seed(s)[0].requests for s in (5, 6, 7, 8)]


def test_batch_of_seeds_has_no_violations() -> None:
    failing = [(r.seed, r.invariants) for r in run_many(list(range(BATCH_SEEDS)), jobs=2) if r.violations]
    assert not failing, failing[:20]


def _regressions() -> list[dict[str, object]]:
    return list(json.loads(REGRESSIONS.read_text()))


def _args(case: dict[str, object]) -> list[str]:
    raw = case["args"]
    assert isinstance(raw, list)
    return [str(a) for a in raw]


def test_regressions_file_is_well_formed() -> None:
    for case in _regressions():
        assert {"seed", "args", "defect", "note"} <= set(case)
        _parser().parse_args(_args(case))


@pytest.mark.parametrize("case", _regressions(), ids=lambda c: f"seed{c['seed']}-{c['defect']}")
def test_regression_seed(case: dict[str, object]) -> None:
    args = _parser().parse_args(_args(case))
    result, _ = run_seed(int(str(case["seed"])), args.long, args.scenario)
    assert result.violations == 0, (case["note"], result.details)
