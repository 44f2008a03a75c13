"""The few asyncio shapes fleetd's loops share: waiting, retrying, bounded fan-out, backoff, a guarded round.

Each exists once so that every loop reads the same way (STYLE.md): ``while not stopping``,
one guarded round, one wait.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
LOG_EVERY_S = 10.0  # a failing loop logs at most one line per this many seconds (the rest are counted)


class Monotonic(Protocol):
    def monotonic(self) -> float: ...


async def wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True if ``event`` was set meanwhile (at once if already set)."""
    if event.is_set():
        return True
    try:
        # asyncio.timeout, not wait_for: no task, timer and waiter per call (on 3.11 wait_for creates a
        # task and, on timeout, cancels and awaits it), and every loop waits this way every tick.
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def wait_any(*events: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s`` or until any of ``events`` is set; True if one was."""
    if any(e.is_set() for e in events):
        return True
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return any(e.is_set() for e in events)


@dataclass(slots=True)
class Backoff:
    """Doubling delays from ``first_s`` up to ``cap_s``.  With ``jitter`` j, each delay is drawn from
    [d·(1−j), d]: callers that fail together (a throttled table, a restarted peer) must not retry
    together."""

    first_s: float
    cap_s: float
    jitter: float = 0.0
    _next_s: float = field(init=False)

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    def peek(self) -> float:
        """The next delay before jitter (to decide whether there is time for it)."""
        return self._next_s

    def next(self) -> float:
        delay = self._next_s
        self._next_s = min(delay * 2, self.cap_s)
        return delay * random.uniform(1 - self.jitter, 1.0) if self.jitter else delay

    def reset(self) -> None:
        self._next_s = self.first_s


async def retrying(call: Callable[[], Awaitable[T]], retry: Callable[[T], bool], until: float,
                   clock: Monotonic) -> T:
    """``call()`` again, with jittered backoff, while ``retry(result)`` and ``until`` (monotonic) allows."""
    backoff = Backoff(0.1, 1.0, jitter=0.5)
    while True:
        result = await call()
        if not retry(result) or clock.monotonic() + backoff.peek() >= until:
            return result
        await asyncio.sleep(backoff.next())


async def bounded(items: Iterable[Any], limit: int, fn: Callable[[Any], Awaitable[T]]) -> list[T]:
    """``fn`` over ``items``, at most ``limit`` at once; the results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(x: Any) -> T:
        async with sem:
            return await fn(x)

    return list(await asyncio.gather(*(one(x) for x in items)))


class Guard:
    """Runs one round of a loop so that the loop never dies of it: an exception is counted
    (``loop_errors_total{loop=…}``), logged at most once per ``LOG_EVERY_S`` with how many were
    not logged, and the round's ``default`` returned."""

    def __init__(self, loop: str, count: Callable[[str], None], log: logging.Logger) -> None:
        self.loop = loop
        self._count = count
        self._log = log
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    async def run(self, round_: Callable[[], Awaitable[T]], default: T) -> T:
        try:
            return await round_()
        except Exception as e:
            self._count(self.loop)
            self._note(e)
            return default

    def _note(self, e: Exception) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        self._log.warning("loop round failed", extra={"loop": self.loop, "error": f"{type(e).__name__}: {e}",
                                                      "not_logged": self._unlogged})
        self._logged_at, self._unlogged = now, 0
