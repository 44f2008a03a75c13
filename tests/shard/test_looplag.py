"""The event-loop lag probe on a real uvloop loop (no AWS): what it records, and how it stops.

Time is real here: the loop is blocked with ``time.sleep``, which no injected clock can stand in
for.  The bounds are generous so that a busy machine only adds to what is recorded.
"""

from __future__ import annotations

import asyncio
import time

from fleetd.shard.looplag import LAG, PROBE_S, LagProbe
from fleetd.stats import LAG_BUCKETS, Histogram, Stats
from tests.helpers import arun

BLOCK_S = 0.15
PERIOD_S = 0.02  # much shorter than the block, so that the block spans a wake-up whenever it starts


def above(hist: Histogram, bound: float) -> int:
    """Samples greater than ``bound`` (one of the bucket bounds)."""
    return sum(hist.counts[hist.buckets.index(bound) + 1:])


async def probe_through(block_s: float) -> Histogram:
    """Run the probe for 0.4 s, the loop blocked ``block_s`` once in the middle."""
    stats, stopping = Stats(), asyncio.Event()
    task = asyncio.create_task(LagProbe(stats, stopping, PERIOD_S).run())
    await asyncio.sleep(0.2)
    asyncio.get_running_loop().call_soon(time.sleep, block_s)
    await asyncio.sleep(0.2)
    stopping.set()
    await asyncio.wait_for(task, 1.0)
    return stats.histograms[(LAG, ())]


def test_a_blocked_loop_is_counted_in_the_buckets_above_100_ms() -> None:
    hist = arun(probe_through(BLOCK_S))
    assert hist.buckets == LAG_BUCKETS
    assert above(hist, 0.1) >= 1, f"the {BLOCK_S} s block was not recorded: {hist.counts}"
    assert hist.sum >= BLOCK_S - PERIOD_S - 0.005  # the late wake-up alone, at uvloop's 1 ms resolution
    assert hist.count == sum(hist.counts) >= 5  # ~0.25 s unblocked: about a dozen 20 ms samples
    assert above(hist, 0.02) < hist.count, "an idle loop's samples belong in the low buckets"


def test_stopping_ends_the_probe_at_once_without_a_sample() -> None:
    async def scenario() -> tuple[float, Histogram]:
        stats, stopping = Stats(), asyncio.Event()
        task = asyncio.create_task(LagProbe(stats, stopping).run())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        stopping.set()
        await asyncio.wait_for(task, 1.0)
        return time.monotonic() - started, stats.histograms[(LAG, ())]

    took_s, hist = arun(scenario())
    assert took_s < PROBE_S
    assert hist.count == 0, "a wake-up cut short by stopping is not lag"
