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
import contextvars
import heapq
import itertools
from asyncio import events, format_helpers, futures, tasks
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any, TypeVarTuple, Unpack

_Ts = TypeVarTuple("_Ts")

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


class _Handle(events.Handle):
    """``asyncio.Handle`` without the per-handle debug query (the loop never runs in debug mode)."""

    __slots__ = ()

    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop,
                 context: contextvars.Context | None = None) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _Timer(events.TimerHandle):
    """``asyncio.TimerHandle``, likewise."""

    __slots__ = ()

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...],
                 loop: asyncio.AbstractEventLoop, context: contextvars.Context | None = None) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None
        self._when = when
        self._scheduled = False


_MIN_SCHEDULED = 100  # asyncio.base_events._MIN_SCHEDULED_TIMER_HANDLES
_MIN_CANCELLED_FRACTION = 0.5  # asyncio.base_events._MIN_CANCELLED_TIMER_HANDLES_FRACTION


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time with no I/O (see the module docstring).

    Speed: the loop's hot methods (``call_soon``, ``call_at``, ``call_later``, ``create_task``,
    ``_run_once``) are BaseEventLoop's minus what a loop that is never in debug mode, never
    selects and never runs other threads does not need.  ``_scheduled`` is a heap of
    ``(when, TimerHandle)`` pairs rather than of TimerHandles: the order is the same (two
    timers with equal ``when`` compare as TimerHandles do, neither less than the other; the
    pair only saves the Python-level ``TimerHandle.__lt__`` on every heap comparison), so
    timers fire in exactly the order BaseEventLoop's heap would fire them.
    """

    # BaseEventLoop's private queues (CPython 3.11), declared for the type checker.
    _ready: collections.deque[asyncio.Handle]
    _scheduled: list[tuple[float, asyncio.TimerHandle]]  # a heap; see the class docstring
    _closed: bool
    _timer_cancelled_count: int
    _task_factory: Any

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

    def set_debug(self, enabled: bool) -> None:
        if enabled:
            raise RuntimeError("a VirtualLoop does not run in debug mode")
        super().set_debug(enabled)

    # ----- BaseEventLoop's hot paths, lean ----------------------------------------------------------

    def call_soon(self, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        if self._closed:
            raise RuntimeError("Event loop is closed")
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        if self._closed:
            raise RuntimeError("Event loop is closed")
        timer = _Timer(when, callback, args, self, context)
        heappush(self._scheduled, (when, timer))
        timer._scheduled = True
        return timer

    def call_later(self, delay: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                   context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._vt.now + delay, callback, *args, context=context)

    def create_future(self) -> asyncio.Future[Any]:
        return futures.Future(loop=self)

    def create_task(self, coro: Any, *, name: str | None = None,  # type: ignore[override]
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        if self._closed:
            raise RuntimeError("Event loop is closed")
        if self._task_factory is not None:
            return super().create_task(coro, name=name, context=context)
        return tasks.Task(coro, loop=self, name=name, context=context)

    def _run_once(self) -> None:
        """BaseEventLoop._run_once (CPython 3.11) on the pair heap, without the select."""
        sched = self._scheduled
        n = len(sched)
        if n > _MIN_SCHEDULED and self._timer_cancelled_count / n > _MIN_CANCELLED_FRACTION:
            kept = []
            for entry in sched:
                if entry[1]._cancelled:
                    entry[1]._scheduled = False  # type: ignore[attr-defined]
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._scheduled = sched = kept
            self._timer_cancelled_count = 0
        else:
            while sched and sched[0][1]._cancelled:
                self._timer_cancelled_count -= 1
                heappop(sched)[1]._scheduled = False  # type: ignore[attr-defined]
        ready = self._ready
        if sched:
            end = self._vt.now + self._clock_resolution
            while sched and sched[0][0] < end:
                timer = heappop(sched)[1]
                timer._scheduled = False  # type: ignore[attr-defined]
                ready.append(timer)
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if handle._cancelled:
                continue
            try:
                handle._context.run(handle._callback, *handle._args)  # type: ignore[attr-defined]
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._callback_failed(handle, exc)
        handle = None  # type: ignore[assignment]  # break cycles, as asyncio does

    def _callback_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """What ``asyncio.Handle._run`` does when its callback raises."""
        cb = format_helpers._format_callback_source(handle._callback, handle._args)  # type: ignore[attr-defined]
        self.call_exception_handler({"message": f"Exception in callback {cb}", "exception": exc, "handle": handle})

    # ----- the scheduler's view ----------------------------------------------------------------------

    def next_due(self) -> float | None:
        """When this loop next has work: now if callbacks are ready, else its earliest live timer."""
        if self._ready:
            return self._vt.now
        sched = self._scheduled
        while sched and sched[0][1]._cancelled:
            heappop(sched)
        return sched[0][0] if sched else None

    def step(self) -> None:
        """Run one iteration (ready callbacks and due timers) with this loop as the running loop.

        The running loop is left set afterwards (switched when another loop steps, cleared when
        the scheduler returns): world events never ask for a running loop.
        """
        if events._get_running_loop() is not self:
            events._set_running_loop(self)
        self._run_once()

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
        self._running: VirtualLoop | None = None  # the loop last installed as the running loop

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run the world event ``fn`` at virtual time ``when`` (never in the past)."""
        now = self.vt.now
        heappush(self._heap, (when if when > now else now, next(self._seq), fn))

    def add(self, loop: VirtualLoop) -> None:
        self.loops.append(loop)

    def remove(self, loop: VirtualLoop) -> None:
        if loop in self.loops:
            self.loops.remove(loop)

    def run_until(self, end: float) -> None:
        self._running = None
        try:
            self._run_until(end)
        finally:
            self._running = None
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
        set_running = events._set_running_loop
        running = self._running
        ran, rounds, steps = True, 0, 0
        try:
            while ran:
                ran = False
                now = vt.now
                for loop in tuple(self.loops):
                    sched = loop._scheduled
                    if loop._ready or (sched and sched[0][0] <= now):
                        if loop is not running:
                            set_running(loop)
                            running = self._running = loop
                        loop._run_once()
                        steps += 1
                        ran = True
                while heap and heap[0][0] <= now:
                    heappop(heap)[2]()
                    ran = True
                rounds += 1
                if ran and rounds > self.spin_rounds:
                    return True
            return False
        finally:
            self.steps += steps

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
            if sched and self.vt.now < sched[0][0] < nxt:
                nxt = sched[0][0]
        self.vt.now = nxt

    def _next_time(self) -> float | None:
        best = self._heap[0][0] if self._heap else None
        now = self.vt.now
        for loop in self.loops:
            sched = loop._scheduled
            while sched and sched[0][1]._cancelled:
                heappop(sched)
            if loop._ready:
                return now
            if sched and (best is None or sched[0][0] < best):
                best = sched[0][0]
        return best
