"""The supervisor: one per task, owns the shard processes (SPEC §1).

It runs no event loop and no WebSocket or AWS code of its own.  Its main loop is

    wait([signal self-pipe, shard sentinels, shard report pipes], timeout)
    → handle_term → read reports → reap_shards → manage_shards

and every signal handler only records the signal number (STYLE.md item 2).

* Shards are ``multiprocessing`` children started through a forkserver that has
  ``fleetd.shard`` and ``fleetd.child`` preloaded (a restart costs ~10 ms, not a fresh
  interpreter), one per usable CPU unless ``shards`` says otherwise.  What runs in
  the child around the shard (reports, parent watch, boot errors) is ``fleetd.child``.
* A shard reports an absolute stats snapshot once a second over a Pipe; the
  supervisor keeps the latest per shard for ``/metrics`` and CloudWatch.
* A shard that dies is restarted with backoff (0.5 s doubling to 30 s, reset after
  60 s of healthy uptime).  If it died uncleanly, its session is expired at once
  (``fleetd.burial``, in a worker thread) and the replacement starts with
  ``predecessor=<that session>``, so it takes over the dead shard's items in about
  a second instead of waiting for the session TTL (SPEC §6).
* A shard exiting with ``exits.BOOT_ERROR`` (missing tables, no credentials) halts
  the whole task with one clear line instead of a restart loop (STYLE.md item 3).
* SIGTERM/SIGINT: forwarded once to every shard, which shuts down gracefully;
  stragglers are SIGKILLed after ``shutdown_budget_s + 2``; a second signal kills
  at once.  As PID 1 it also reaps orphans re-parented to it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from fleetd import burial, exits, logs, tracing
from fleetd.child import shard_entry
from fleetd.cloudwatch import Publisher
from fleetd.config import Config
from fleetd.metrics import FleetCollector, MetricsServer

log = logging.getLogger("fleetd.supervisor")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_UPTIME_S = 60.0  # a shard that ran this long before dying restarts at the minimum backoff again
# A successor booting later than this leaves the crashed shard's streams to peers, told at once.
RESTART_SOON_S = 1.0
EXPIRE_WAIT_S = 3.0  # a restart waits at most this long for its predecessor's session to be expired
KILL_GRACE_S = 2.0  # added to shutdown_budget_s before stragglers are SIGKILLed
TICK_S = 1.0  # upper bound of one wait: restarts and deadlines are checked at least this often
HALTING_EXITS = frozenset({exits.BOOT_ERROR, exits.USAGE})  # a restart cannot fix these
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path = CPU_MAX) -> int:
    """One shard per CPU the task may really use: the CPUs this process may run on, capped by the cgroup v2
    quota (``"max 100000"`` = none)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return cpus
        return max(1, min(cpus, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        return cpus


def shard_context() -> ForkServerContext:
    """A shard restart costs ~10 ms, not a fresh interpreter: the forkserver context, with the shard's heavy
    imports (uvloop, picows, the AWS SDK, and OpenTelemetry when tracing is on) preloaded.

    The forkserver is started here with SIGTERM ignored (an ignored disposition
    survives exec): a SIGTERM to the whole process group (``kill -TERM -PGID``,
    systemd) must not kill it, or every shard's exit status is lost with it while
    the shards are still shutting down.  Shards restore the default (``fleetd.child.shard_entry``).
    """
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fleetd.shard", "fleetd.child", *tracing.preload()])
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return ctx


def reap_orphans(protected: set[int]) -> list[int]:
    """PID 1 inherits every orphan and must reap it: reap exited children that multiprocessing does not own.

    ``WNOWAIT`` peeks first, so the exit status of a child multiprocessing waits
    for (forkserver, resource tracker) is never stolen from it.
    """
    reaped: list[int] = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in protected:
            return reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)
        reaped.append(info.si_pid)


def _multiprocessing_pids() -> set[int]:
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


# ----- signals and wake-ups -----------------------------------------------------------------------------


class SignalInbox:
    """Signal handlers only record the signal number (STYLE.md item 2); the main loop acts on it.

    A self-pipe (``signal.set_wakeup_fd``) wakes the main loop's wait when a signal
    arrives, and :meth:`wake` does the same for other threads (a finished expiry).
    """

    def __init__(self) -> None:
        self.signals: deque[int] = deque()  # appended by the handler, consumed by Supervisor.handle_term
        self.fd = -1  # the read end: one of the main loop's waitables
        self._write_fd = -1

    def install(self, signums: Iterable[int]) -> None:
        self.fd, self._write_fd = os.pipe()
        for fd in (self.fd, self._write_fd):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in signums:
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only record: logging or locking in a signal handler can deadlock.
        self.signals.append(signum)

    def wake(self) -> None:
        """Wake the main loop from another thread."""
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for fd in (self.fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._write_fd = -1


# ----- burials (worker threads) -------------------------------------------------------------------------


class Undertaker:
    """The main loop never waits on AWS: dead sessions are buried (``fleetd.burial``) in worker threads.

    Each burial is a Future the main loop polls; a finished expiry wakes it (``wake``).
    Before :meth:`start` (a Supervisor that is not running) nothing is buried.
    """

    def __init__(self, cfg: Config, wake: Callable[[], None]) -> None:
        self.cfg = cfg
        self._wake = wake
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="aws-helper")
        self._pool.submit(burial.warm_up)

    def expire(self, session_id: str, pid: int) -> Future[str] | None:
        if self._pool is None:
            return None
        fut = self._pool.submit(burial.expire_session, self.cfg, session_id, pid)
        fut.add_done_callback(lambda _: self._wake())
        return fut

    def announce(self, expiring: Future[str] | None, session_id: str) -> Future[None] | None:
        """A peer woken before the expiry landed would find the session alive and wait for its next
        reconcile: DEAD_SESSION hints go out once ``expiring`` is done.  The successor's boot does not
        wait for them: it waits only for the expiry."""
        if self._pool is None or expiring is None:
            return None
        announcing: Future[None] = Future()

        def start(_: Future[str]) -> None:
            try:
                assert self._pool is not None
                inner = self._pool.submit(burial.announce_dead, self.cfg, session_id)
            except RuntimeError:  # shut down meanwhile
                announcing.cancel()
                return
            inner.add_done_callback(lambda f: announcing.set_result(None))

        expiring.add_done_callback(start)
        return announcing

    def close(self, burials: Iterable[Future[Any] | None]) -> None:
        """Peers take over faster when dead sessions are buried before we go: wait up to EXPIRE_WAIT_S."""
        if self._pool is None:
            return
        pending = [f for f in burials if f is not None and not f.done()]
        deadline = time.monotonic() + EXPIRE_WAIT_S
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)


# ----- the supervisor -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ShardSlot:
    """One shard index and its current incarnation."""

    index: int
    process: BaseProcess | None = None
    reports: Connection | None = None
    session_id: str = ""  # from the latest snapshot
    started_at: float = 0.0
    died_at: float = 0.0
    restart_at: float = math.inf  # when the next incarnation may start (inf = not scheduled)
    backoff_s: float = BACKOFF_MIN_S
    predecessor: str | None = None  # the dead incarnation's session, handed to the next one
    expiring: Future[str] | None = None
    announcing: Future[None] | None = None
    boot_error: str = ""
    incarnations: int = 0

    @property
    def pid(self) -> int:
        return (self.process.pid or 0) if self.process is not None else 0

    def kill(self, sig: int) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def predecessor_settled(self, now: float) -> bool:
        """The successor must not boot before its predecessor's session is expired (or we gave up)."""
        return self.expiring is None or self.expiring.done() or now - self.died_at >= EXPIRE_WAIT_S


class Supervisor:
    """One task's shards run, restart and stop under one loop (constructor is pure)."""

    def __init__(self, cfg: Config, ctx: ForkServerContext | None = None) -> None:
        self.cfg = cfg
        self.count = cfg.runtime.shards or usable_cpus()
        self.slots = [ShardSlot(i) for i in range(self.count)]
        self.collector = FleetCollector(self.count)
        self.server = MetricsServer(cfg.runtime.metrics_addr, self.collector)
        self.publisher = Publisher(cfg.runtime, cfg.aws, self.collector)
        self.inbox = SignalInbox()
        self.undertaker = Undertaker(cfg, self.inbox.wake)
        self.stopping = False
        self.stop_signal = 0
        self.stop_deadline = math.inf
        self.killed = False
        self.exit_code = exits.OK
        self.halt_message = ""
        self._ctx = ctx

    @property
    def kill_after_s(self) -> float:
        """How long shards get to stop, from the stop signal (or their supervisor's death) to SIGKILL."""
        return self.cfg.runtime.shutdown_budget_s + KILL_GRACE_S

    # ----- lifecycle -----------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.server.start()
        except OSError as e:
            print(f"fleetd: error: cannot serve metrics on {self.cfg.runtime.metrics_addr}: {e.strerror}",
                  file=sys.stderr)
            return exits.USAGE
        self._ctx = self._ctx or shard_context()
        self.inbox.install((signal.SIGTERM, signal.SIGINT, signal.SIGCHLD))
        self.undertaker.start()
        self.publisher.start()
        log.info("supervisor started", extra={"shards": self.count, "pid": os.getpid(), "metrics": self.server.url})
        try:
            for slot in self.slots:
                self._start(slot)
            self._loop()
        finally:
            self._cleanup()
        log.info("supervisor stopped", extra={"exit_code": self.exit_code})
        if self.halt_message:  # last, so it is the line an operator sees at the bottom
            print(f"fleetd: error: {self.halt_message}", file=sys.stderr, flush=True)
        return self.exit_code

    def _loop(self) -> None:
        while not (self.stopping and all(s.process is None for s in self.slots)):
            ready = wait(self._waitables(), timeout=self._timeout())
            self.inbox.drain()
            self.handle_term()
            for slot in self.slots:
                if slot.reports is not None and slot.reports in ready:
                    self._read_reports(slot)
            self.reap_shards()
            self.manage_shards()

    def _waitables(self) -> list[Any]:
        objs: list[Any] = [self.inbox.fd]
        for slot in self.slots:
            if slot.process is not None:
                objs.append(slot.process.sentinel)
            if slot.reports is not None:
                objs.append(slot.reports)
        return objs

    def _timeout(self) -> float:
        """Until the next restart or deadline is due, at most TICK_S (a finished expiry wakes us itself)."""
        now = time.monotonic()
        due = [math.inf if self.killed else self.stop_deadline]
        for s in self.slots:
            if s.process is None and not self.stopping:
                waiting = s.expiring is not None and not s.expiring.done()
                due.append(max(s.restart_at, s.died_at + EXPIRE_WAIT_S) if waiting else s.restart_at)
        return min(TICK_S, max(0.01, min(due) - now))

    def _cleanup(self) -> None:
        self.collector.draining = True
        self.publisher.stop()
        self.server.stop()
        self.undertaker.close(f for s in self.slots for f in (s.expiring, s.announcing))
        reap_orphans(_multiprocessing_pids())
        self.inbox.close()

    # ----- signals -------------------------------------------------------------------------------------

    def handle_term(self) -> None:
        """Act on recorded signals: the first TERM/INT stops gracefully, a second one kills."""
        while self.inbox.signals:
            sig = self.inbox.signals.popleft()
            if sig == signal.SIGCHLD:
                continue  # reap_shards reaps on every iteration
            if self.stopping:
                self._force(sig)
            else:
                log.info("stopping", extra={"signal": _signal_name(sig)})
                self._begin_stop(sig)

    def _begin_stop(self, sig: int) -> None:
        self.stopping = True
        self.stop_signal = sig
        self.collector.draining = True
        self.stop_deadline = time.monotonic() + self.kill_after_s
        for slot in self.slots:
            slot.restart_at = math.inf
            slot.kill(signal.SIGTERM)

    def _force(self, sig: int) -> None:
        log.warning("second signal: killing shards now", extra={"signal": _signal_name(sig)})
        self._kill_all()
        self.exit_code = 128 + sig

    def _kill_all(self) -> None:
        self.killed = True
        for slot in self.slots:
            slot.kill(signal.SIGKILL)

    # ----- shards --------------------------------------------------------------------------------------

    def _start(self, slot: ShardSlot) -> None:
        assert self._ctx is not None
        recv, send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=shard_entry, name=f"fleetd-shard-{slot.index}",
                                 args=(self.cfg, slot.index, slot.predecessor, send, self.kill_after_s))
        try:
            proc.start()
        except OSError as e:
            recv.close()
            log.error("could not start shard", extra={"shard": slot.index, "error": str(e)})
            self._schedule_restart(slot, time.monotonic())
            return
        finally:
            send.close()  # the child has its copy; ours would keep the pipe from ever reporting EOF
        slot.process, slot.reports, slot.started_at = proc, recv, time.monotonic()
        slot.restart_at, slot.expiring = math.inf, None
        self.collector.shard_started(slot.index, proc.pid or 0, restart=slot.incarnations > 0)
        slot.incarnations += 1
        log.info("shard started", extra={"shard": slot.index, "pid": proc.pid, "predecessor": slot.predecessor})
        slot.predecessor = None

    def _read_reports(self, slot: ShardSlot) -> None:
        conn = slot.reports
        if conn is None:
            return
        try:
            while conn.poll():
                self._on_report(slot, conn.recv())
        except (EOFError, OSError):
            conn.close()
            slot.reports = None

    def _on_report(self, slot: ShardSlot, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        if "boot_error" in msg:
            slot.boot_error = str(msg["boot_error"])
            return
        slot.session_id = str(msg.get("session_id") or slot.session_id)
        self.collector.update(slot.index, msg)

    def reap_shards(self) -> None:
        """Handle every shard that exited, and reap orphans (we may be PID 1)."""
        for slot in self.slots:
            proc = slot.process
            if proc is not None and proc.exitcode is not None:
                self._read_reports(slot)  # its last snapshots carry its session id and final counters
                self._on_exit(slot, proc.exitcode)
        reap_orphans(_multiprocessing_pids() | {s.pid for s in self.slots if s.pid})

    def _on_exit(self, slot: ShardSlot, code: int) -> None:
        assert slot.process is not None
        now = time.monotonic()
        uptime, sid, pid = now - slot.started_at, slot.session_id, slot.pid
        # Exit code 255 is also what multiprocessing reports when the forkserver died and took the
        # shard's status with it: the shard may still run, unsupervised.  Its process group is its own.
        if pid > 0:  # never killpg(0): that is our own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        slot.process.close()
        slot.process, slot.session_id, slot.died_at = None, "", now
        if slot.reports is not None:
            slot.reports.close()
            slot.reports = None
        self.collector.shard_exited(slot.index)
        _log_exit(slot.index, pid, code, sid, uptime, self.stopping)
        if uptime >= HEALTHY_UPTIME_S:
            slot.backoff_s = BACKOFF_MIN_S
        restarting = not self.stopping and code not in HALTING_EXITS
        if code != exits.OK and sid:
            slot.predecessor = sid
            # A successor held back by the crash-loop backoff (or never coming) would leave the
            # streams waiting for it, or for the peers' next reconcile: tell the peers instead.
            slot.expiring = self.undertaker.expire(sid, pid)
            if not restarting or slot.backoff_s > RESTART_SOON_S:
                slot.announcing = self.undertaker.announce(slot.expiring, sid)
        if self.stopping:
            return
        if code in HALTING_EXITS:
            self._halt(slot, code)
            return
        self._schedule_restart(slot, now)

    def _schedule_restart(self, slot: ShardSlot, now: float) -> None:
        slot.restart_at = now + slot.backoff_s
        log.info("shard restart scheduled", extra={"shard": slot.index, "delay_s": slot.backoff_s})
        slot.backoff_s = min(slot.backoff_s * 2, BACKOFF_MAX_S)

    def _halt(self, slot: ShardSlot, code: int) -> None:
        reason = slot.boot_error or "see its log above (missing tables or queue? run `fleetd init`)"
        self.halt_message = f"shard {slot.index} cannot boot (exit code {code}): {reason}"
        log.error("halting: a shard cannot boot", extra={"shard": slot.index, "reason": reason})
        self.exit_code = exits.BOOT_ERROR
        self._begin_stop(0)

    def manage_shards(self) -> None:
        """Start due restarts; past the stop deadline, SIGKILL stragglers."""
        now = time.monotonic()
        if self.stopping:
            if now >= self.stop_deadline and not self.killed:
                live = [s.index for s in self.slots if s.process is not None]
                log.warning("shutdown budget exceeded: killing shards", extra={"shards": live})
                self._kill_all()
                if self.exit_code == exits.OK:
                    self.exit_code = 128 + (self.stop_signal or signal.SIGTERM)
            return
        for slot in self.slots:
            if slot.process is None and now >= slot.restart_at and slot.predecessor_settled(now):
                self._start(slot)


def _log_exit(index: int, pid: int, code: int, session_id: str, uptime: float, stopping: bool) -> None:
    how = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
    extra = {"shard": index, "pid": pid, "exit_code": code, "session_id": session_id, "uptime_s": round(uptime, 1)}
    report: Callable[..., None] = log.info if stopping or code == exits.OK else log.warning
    report(f"shard exited ({how})", extra=extra)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def main(cfg: Config) -> int:
    """``fleetd run``: supervise the shards until SIGTERM/SIGINT; returns the exit code."""
    logs.setup(cfg.runtime.log_format, cfg.runtime.log_level)
    logs.set_context(role="supervisor")
    return Supervisor(cfg).run()
