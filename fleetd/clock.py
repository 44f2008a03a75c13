"""Injectable time.

Everything that compares against lease expiries reads wall time through a
:class:`Clock`, so tests can skew a shard's clock (SPEC §3: clock skew below the
safety margin must never cause double streaming) without sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Wall time in epoch milliseconds plus a monotonic clock for intervals."""

    def now_ms(self) -> int: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The process clock, optionally offset (fault injection of clock skew)."""

    __slots__ = ("offset_ms",)

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock tests move by hand."""

    __slots__ = ("_mono", "_ms")

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self._ms = now_ms
        self._mono = 0.0

    def now_ms(self) -> int:
        return self._ms

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._ms += int(seconds * 1000)
        self._mono += seconds
