"""The event-loop lag probe: how late the shard's event loop runs a timer that is due.

Every ``PROBE_S`` the probe asks the loop to wake it ``PROBE_S`` later, on the loop's own clock
(``loop.time()``), and records how late it woke into the ``event_loop_lag_seconds`` histogram
(``fleetd.stats.LAG_BUCKETS``).  Every timer of the shard is late by as much — heartbeats and
fence checks included — so lag is the shard's CPU headroom seen from inside: near 0 on a shard with
room to spare, and a stall as long as the slowest callback otherwise.  uvloop's clock has a
resolution of 1 ms, so lag below that reads as 0 or 1 ms.

A sample costs one bisect and three additions into a histogram created once; no key, dict or
task is made per sample.
"""

from __future__ import annotations

import asyncio

from fleetd.aio import wait
from fleetd.stats import LAG_BUCKETS, Histogram, Stats

PROBE_S = 0.25  # 240 samples a minute: a p99 over a 1 min rate window rests on the worst 2 or 3
LAG = "event_loop_lag_seconds"


class LagProbe:
    """Samples the loop's lag until ``stopping`` is set; a wake-up cut short by ``stopping`` is not a sample."""

    def __init__(self, stats: Stats, stopping: asyncio.Event, period_s: float = PROBE_S) -> None:
        self.stopping = stopping
        self.period_s = period_s
        self._hist: Histogram = stats.histogram(LAG, LAG_BUCKETS)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.period_s
        while not await wait(self.stopping, self.period_s):
            now = loop.time()
            self._hist.observe(max(0.0, now - due))  # the loop's clock is monotonic; max() guards rounding
            due = now + self.period_s
