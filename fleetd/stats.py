"""A shard's counters, gauges and histograms as plain numbers.

Shards never touch prometheus-client: they count into a :class:`Stats` and send
absolute snapshots to the supervisor, whose collector (``fleetd.metrics``) exposes
them.  A dead shard's gauges therefore vanish with its last snapshot, and counters
survive restarts because the supervisor keeps each dead shard's final totals.
"""

from __future__ import annotations

import bisect
from typing import Any

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]

# Seconds; covers a fast local BatchWriteItem up to a throttled retry storm.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Seconds; event-loop lag from uvloop's 1 ms clock resolution up to a stall that risks self-fencing
# (safety_margin_s, 2 s by default).  20 ms is a bound of its own: the shard's p99 target.
LAG_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _key(name: str, labels: dict[str, str]) -> Key:
    return name, tuple(sorted(labels.items()))


class Histogram:
    """Cumulative-at-export histogram with fixed buckets: ``counts[i]`` holds the values in
    ``(buckets[i-1], buckets[i]]``, the last one those above every bucket (+Inf)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value


class Stats:
    """Counters only go up, gauges are set, histograms observe.  Names omit the ``fleetd_`` prefix."""

    __slots__ = ("counters", "gauges", "histograms", "messages")

    def __init__(self) -> None:
        self.counters: dict[Key, float] = {}
        self.gauges: dict[Key, float] = {}
        self.histograms: dict[Key, Histogram] = {}
        self.messages = 0  # hot path: a plain attribute, exported as messages_total

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = _key(name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self.gauges[_key(name, labels)] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        """One value into the histogram ``name``, of ``LATENCY_BUCKETS`` (another layout: :meth:`histogram`)."""
        self.histogram(name, LATENCY_BUCKETS, **labels).observe(value)

    def histogram(self, name: str, buckets: tuple[float, ...], /, **labels: str) -> Histogram:
        """The histogram of this name and labels, created with ``buckets`` if it does not exist yet.

        A hot path keeps the returned object and observes into it directly (no key built per value).
        One name has one bucket layout: asking for another is a ValueError."""
        key = _key(name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = Histogram(buckets)
        elif hist.buckets != buckets:
            raise ValueError(f"histogram {name} has buckets {hist.buckets}, not {buckets}")
        return hist

    def counter(self, name: str, **labels: str) -> float:
        """Current value of one counter (0 if never incremented)."""
        return self.counters.get(_key(name, labels), 0.0)

    def snapshot(self) -> dict[str, Any]:
        """Plain, picklable absolute values."""
        counters = dict(self.counters)
        counters[("messages_total", ())] = float(self.messages)
        return {
            "counters": counters,
            "gauges": dict(self.gauges),
            "histograms": {
                k: (h.buckets, list(h.counts), h.count, h.sum) for k, h in self.histograms.items()
            },
        }
