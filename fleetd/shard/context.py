"""What every shard component shares: configuration, clock, counters, the stores, and ``stopping``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fleetd.clock import Clock
from fleetd.config import Config
from fleetd.hints import Hints
from fleetd.lease import LeaseStore
from fleetd.sink import Sink
from fleetd.stats import Stats
from fleetd.tracing import NULL, Tracer


@dataclass(frozen=True, slots=True)
class Context:
    """Built once the AWS clients are open; every field is set, none changes.

    ``stopping`` is the one stopping event: set by the first SIGTERM/SIGINT (or ``request_stop``),
    it ends every loop (``while not stopping.is_set()``) and starts the shutdown phases.  ``tracer``
    is the shard's (``fleetd.tracing``; the null one unless OTLP export is configured).
    """

    cfg: Config
    clock: Clock
    stats: Stats
    leases: LeaseStore
    sink: Sink
    sink_ddb: Any
    hints: Hints
    stopping: asyncio.Event
    tracer: Tracer = NULL

    def is_stopping(self) -> bool:
        return self.stopping.is_set()

    def count_error(self, loop: str) -> None:
        self.stats.inc("loop_errors_total", loop=loop)
