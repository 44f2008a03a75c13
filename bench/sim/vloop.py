"""Virtual time: one asyncio event loop per simulated process, stepped by a master scheduler.

Model
-----
* :class:`VirtualTime` is the one true timeline (seconds, float).  Nothing in the
  simulation reads a real clock.
* :class:`VirtualLoop` is an asyncio event loop whose ``time()`` is the virtual time
  and whose selector never blocks and never has I/O to report: callbacks and timers
  are all there is.  A loop is advanced by :meth:`VirtualLoop.step`, one
  ``_run_once`` with the loop installed as the running loop.
* :class:`Scheduler` owns the loops and a heap of *world events* (the network and
  the services, which belong to no process).  It runs every loop that has ready
  callbacks or due timers, in a fixed order, until all are idle at the current
  instant; then it advances virtual time to the earliest timer of a steppable loop
  or world event.  Running code takes no virtual time.
* A paused process (SIGSTOP) is simply not stepped; a crashed one (SIGKILL) is never
  stepped again.  Callbacks scheduled onto them meanwhile stay queued (or are lost).

CPython assumption (pinned by ``tests/sim/test_sim.py::test_private_loop_api``): the
private ``asyncio.BaseEventLoop._run_once``, ``_ready``, ``_scheduled`` and
``asyncio.events._set_running_loop`` of CPython 3.11 behave as documented in its
source.  No asyncgen hooks are installed (fleetd's async generators are always
exhausted), and no self-pipe exists (there are no other threads).

Not modelled: CPU time (a callback takes zero virtual time), thread pools, signals.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from asyncio import events
from collections.abc import Callable
from typing import Any

# asyncio's default (clock resolution) is irrelevant here; timers fire at their exact virtual time.
_EPS = 1e-9


SPIN_ROUNDS = 5_000  # rounds at one instant before a process is declared busy-looping
SPIN_ROUNDS_AFTER = 100  # once one was, a lower bar (each detection costs a charge of virtual time)
SPIN_CHARGE_S = 0.005  # virtual time a busy loop burns per detection
MAX_SPINS = 20_000  # then give the seed up (a livelock)


class Livelock(RuntimeError):
    """Some process keeps scheduling work at the current instant: virtual time cannot advance."""


class VirtualTime:
    """The shared virtual clock (seconds)."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start


class _NullSelector:
    """A selector with nothing to select: every select returns at once, empty."""

    def select(self, timeout: float | None = None) -> list[Any]:
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time with no I/O (see the module docstring)."""

    # BaseEventLoop's private queues (CPython 3.11), declared for the type checker.
    _ready: collections.deque[asyncio.Handle]
    _scheduled: list[Any]  # asyncio.TimerHandle, whose private _when we read

    def __init__(self, vt: VirtualTime, name: str) -> None:
        super().__init__()
        self._vt = vt
        self._selector = _NullSelector()
        self._clock_resolution = _EPS
        self.name = name
        self.errors: list[str] = []
        self.set_exception_handler(self._on_error)

    def time(self) -> float:
        return self._vt.now

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.errors.append(f"{context.get('message')}: {type(exc).__name__ if exc else ''} {exc or ''}")

    def next_due(self) -> float | None:
        """When this loop next has work: now if callbacks are ready, else its earliest live timer."""
        if self._ready:
            return self._vt.now
        sched = self._scheduled
        while sched and sched[0]._cancelled:
            heapq.heappop(sched)
        return sched[0]._when if sched else None

    def step(self) -> None:
        """Run one iteration (ready callbacks and due timers) with this loop as the running loop.

        The running loop is left set afterwards (switched when another loop steps, cleared when
        the scheduler returns): world events never ask for a running loop.
        """
        if events._get_running_loop() is not self:
            events._set_running_loop(self)
        self._run_once()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._ready.clear()
        self._scheduled.clear()
        super().close()


class Scheduler:
    """Steps the processes' loops and runs world events in virtual-time order."""

    def __init__(self, vt: VirtualTime) -> None:
        self.vt = vt
        self.loops: list[VirtualLoop] = []  # steppable now (running processes), in a fixed order
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.before_advance: list[Callable[[], None]] = []  # run when every loop is idle at this instant
        self.on_spin: list[Callable[[list[str]], None]] = []  # a busy loop was detected (names of the loops)
        self.spin_rounds = SPIN_ROUNDS
        self.spins = 0
        self.steps = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run the world event ``fn`` at virtual time ``when`` (never in the past)."""
        heapq.heappush(self._heap, (max(when, self.vt.now), next(self._seq), fn))

    def add(self, loop: VirtualLoop) -> None:
        self.loops.append(loop)

    def remove(self, loop: VirtualLoop) -> None:
        if loop in self.loops:
            self.loops.remove(loop)

    def run_until(self, end: float) -> None:
        try:
            self._run_until(end)
        finally:
            events._set_running_loop(None)

    def _run_until(self, end: float) -> None:
        vt = self.vt
        while True:
            if self._run_instant():
                self._charge_spin()
                continue
            for fn in self.before_advance:
                fn()
            nxt = self._next_time()
            if nxt is None or nxt > end:
                vt.now = max(vt.now, end)
                return
            vt.now = max(vt.now, nxt)

    def _run_instant(self) -> bool:
        """Step the loops with work due now, and run the world events due now, until none is left;
        True if some loop still had work after ``spin_rounds`` rounds (a busy loop).

        A timer is due when its time is not after now (no tolerance: asyncio itself runs timers up
        to its clock resolution early, and code that re-arms for the remaining nanoseconds must see
        time advance, or it would spin at one instant).
        """
        heap = self._heap
        vt = self.vt
        ran, rounds = True, 0
        while ran:
            ran = False
            now = vt.now
            for loop in tuple(self.loops):
                sched = loop._scheduled
                if loop._ready or (sched and sched[0]._when <= now):
                    loop.step()
                    self.steps += 1
                    ran = True
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2]()
                ran = True
            rounds += 1
            if ran and rounds > self.spin_rounds:
                return True
        return False

    def _charge_spin(self) -> None:
        """A process keeps scheduling work at one instant (in real life: it burns a CPU).  Report it,
        and let virtual time pass as CPU time would: up to ``SPIN_CHARGE_S``, never past the next
        world event or another timer."""
        spinning = [lp.name for lp in self.loops if lp._ready]
        for fn in self.on_spin:
            fn(spinning)
        self.spin_rounds = SPIN_ROUNDS_AFTER
        self.spins += 1
        if self.spins > MAX_SPINS:
            raise Livelock(f"processes {spinning} spin without end at t={self.vt.now:.6f}")
        nxt = self.vt.now + SPIN_CHARGE_S
        if self._heap:
            nxt = min(nxt, self._heap[0][0])
        for loop in self.loops:
            sched = loop._scheduled
            if sched and self.vt.now < sched[0]._when < nxt:
                nxt = sched[0]._when
        self.vt.now = nxt

    def _next_time(self) -> float | None:
        best = self._heap[0][0] if self._heap else None
        for loop in self.loops:
            sched = loop._scheduled
            while sched and sched[0]._cancelled:
                heapq.heappop(sched)
            if loop._ready:
                return self.vt.now
            if sched and (best is None or sched[0]._when < best):
                best = sched[0]._when
        return best
