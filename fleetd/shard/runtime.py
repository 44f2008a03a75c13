"""The shard process: signals, AWS clients, the components, one TaskGroup of their loops, shutdown.

The first SIGTERM/SIGINT sets ``stopping``: every loop ends and the shutdown phases run, releases
starting while the loops wind down; a second signal exits at once.  No socket is held past the
fence deadline, even while shutting down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import uvloop
from picows import ws_connect

from fleetd import exits, logs, tracing
from fleetd.aio import wait
from fleetd.aws import Clients, Outcome, open_clients
from fleetd.clock import Clock, SystemClock
from fleetd.config import Config
from fleetd.hints import Hints
from fleetd.lease import LeaseStore
from fleetd.shard.boot import BootError, boot
from fleetd.shard.checkpoint import Checkpointer
from fleetd.shard.claims import Claimer
from fleetd.shard.context import Context
from fleetd.shard.desired import DesiredState
from fleetd.shard.handoff import OFFER_WAIT_S, Handoff
from fleetd.shard.holdings import Holdings
from fleetd.shard.inbox import Inbox
from fleetd.shard.itemleases import ItemLeases
from fleetd.shard.looplag import LagProbe
from fleetd.shard.orphans import OrphanSweeper
from fleetd.shard.rebalance import Rebalancer
from fleetd.shard.reconcile import Reconciler
from fleetd.shard.session import Identity, SessionHooks, SessionKeeper
from fleetd.shard.tasks import Tasks
from fleetd.sink import Sink
from fleetd.stats import Stats
from fleetd.tracing import Span, Tracer
from fleetd.upstream import Connector

log = logging.getLogger(__name__)
Reporter = Callable[[dict[str, Any]], None]
REPORT_S = 1.0  # the report loop's period
# The traces of a shard that stops are exported within this, after its shutdown phases: its leases are
# released by then, and a supervisor that kills it meanwhile costs only spans.
TRACE_CLOSE_S = 2.0


def env_tracer(who: Identity) -> Tracer:
    """The shard's tracer from the standard ``OTEL_*`` settings (the null one without them).  Its batch
    queue holds twice the shard's capacity: a shutdown ends every tenure at once."""
    return tracing.from_env({"task_id": who.task_id, "shard": who.index}, queue_size=2048 + 2 * who.capacity)


@dataclass(frozen=True, slots=True)
class Environment:
    """What a shard takes from its process: AWS clients, sockets, signals, randomness.

    The defaults are the real ones; the deterministic simulation (``bench/sim``) passes simulated
    AWS clients, simulated upstream sockets and seeded ids, so it runs the shard's code unchanged.
    """

    open_clients: Callable[[AsyncExitStack, Any], Awaitable[Clients]] = open_clients
    connect: Connector = ws_connect
    signals: bool = True  # install SIGTERM/SIGINT handlers (only on the main thread)
    nonce: Callable[[], str] = field(default=lambda: uuid.uuid4().hex[:12])
    tracer: Callable[[Identity], Tracer] = env_tracer  # built in the shard process, once it runs


@dataclass(frozen=True, slots=True)
class Components:
    """The shard's parts, assembled once the AWS clients are open; each owns its own state."""

    ctx: Context
    session: SessionKeeper
    holdings: Holdings
    claimer: Claimer
    reconciler: Reconciler
    rebalancer: Rebalancer
    inbox: Inbox
    desired: DesiredState
    checkpointer: Checkpointer
    items: ItemLeases
    orphans: OrphanSweeper
    lag: LagProbe
    handoff: Handoff

    def loops(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        return [("session", self.session.run), ("item_leases", self.items.run), ("reconcile", self.reconciler.run),
                ("hints", self.inbox.run), ("desired_state", self.desired.run),
                ("checkpoint", self.checkpointer.run), ("orphan_sweep", self.orphans.run),
                ("rebalance", self.rebalancer.run), ("loop_lag", self.lag.run)]


def assemble(cfg: Config, clock: Clock, stats: Stats, clients: Clients, stopping: asyncio.Event,
             who: Identity, connect: Connector, tracer: Tracer = tracing.NULL) -> Components:
    """Wire the components: each is told what it needs by a small explicit call, none reads another's state.
    Callbacks name components assigned below them; they run only once the loops start."""
    tasks = Tasks()

    def count_request(op: str, outcome: Outcome) -> None:
        stats.inc("dynamodb_requests_total", op=op, outcome=outcome.value)

    leases = LeaseStore(clients.dynamodb, cfg.aws, cfg.lease, clock, count_request, clients.renew_dynamodb)
    sink = Sink(cfg, "", stats, clock, on_pressure=lambda high: holdings.on_pressure(high),
                may_write=lambda cur: holdings.may_write(cur))
    hints = Hints(clients.sqs, cfg.aws.hints_queue, cfg.aws.hint_wait_s, stats)
    ctx = Context(cfg, clock, stats, leases, sink, clients.sink_dynamodb, hints, stopping, tracer)
    hooks = SessionHooks(fence_all=lambda reason: holdings.fence_all(reason), held_count=lambda: len(holdings),
                         opened=sink.set_session, replaced=lambda: reconciler.wake(),
                         handed=lambda until: rebalancer.watch_handed(until))
    session = SessionKeeper(ctx, who, hooks, tasks)
    holdings = Holdings(ctx, session, connect, who.capacity, suspect_strays=lambda: reconciler.suspect_strays())
    claimer = Claimer(ctx, session, holdings, suspect_strays=lambda: reconciler.suspect_strays())
    reconciler = Reconciler(ctx, session, holdings, claimer)
    rebalancer = Rebalancer(ctx, session, holdings, reconciler)
    desired = DesiredState(ctx, holdings)
    return Components(ctx, session, holdings, claimer, reconciler, rebalancer,
                      Inbox(ctx, holdings, claimer, reconciler, recheck=desired.check), desired,
                      Checkpointer(ctx, session, holdings), ItemLeases(ctx, session, holdings),
                      OrphanSweeper(ctx, session, reconciler), LagProbe(stats, stopping),
                      Handoff(ctx, session, holdings))


class Shard:
    """One shard process's lifetime (the constructor is pure: no loop, client, socket or task)."""

    def __init__(self, cfg: Config, index: int = 0, clock: Clock | None = None,
                 reporter: Reporter | None = None, predecessor: str | None = None,
                 env: Environment | None = None) -> None:
        self.cfg = cfg
        self.env = env or Environment()
        self.clock = clock or SystemClock(cfg.lease.clock_offset_ms)
        self.who = Identity(cfg.runtime.task_id or socket.gethostname(), index,
                            cfg.runtime.max_connections_per_shard, self.env.nonce)
        self.reporter = reporter
        self.predecessor = predecessor  # a crashed shard's session, handed over by the supervisor
        self.stats = Stats()
        self.stopping = asyncio.Event()
        # Set while running: the loop that request_stop() reaches from another thread, and the parts
        # (read by tests and the simulation, never by the shard's own code).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.parts: Components | None = None

    # ----- views (for tests, the simulation, the report) ------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.parts.session.session_id if self.parts is not None else ""

    def held_ids(self) -> list[str]:
        return self.parts.holdings.ids() if self.parts is not None else []

    # ----- lifetime ------------------------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self._install_signals()
        async with AsyncExitStack() as stack:
            clients = await self.env.open_clients(stack, self.cfg.aws)
            tracer = self.env.tracer(self.who)
            stack.push_async_callback(tracer.close, TRACE_CLOSE_S)  # after the shutdown, before the clients
            parts = assemble(self.cfg, self.clock, self.stats, clients, self.stopping, self.who, self.env.connect,
                             tracer)
            self.parts = parts
            try:
                if not await boot(parts.ctx, clients.dynamodb, parts.session):
                    return exits.OK  # asked to stop while still booting: nothing held, nothing to release
            except BootError as e:
                log.error("shard cannot boot", extra={"reason": str(e)})
                return exits.BOOT_ERROR
            if self.predecessor:
                parts.session.inherit(self.predecessor)
            log.info("shard started", extra={"capacity": self.who.capacity, "mode": self.cfg.lease.lease_mode})
            async with asyncio.TaskGroup() as tg:
                for name, loop in parts.loops():
                    tg.create_task(loop(), name=name)
                tg.create_task(self._report_loop(parts), name="report")
                tg.create_task(parts.ctx.sink.run(clients.sink_dynamodb, self.stopping), name="sink")
                await self.stopping.wait()
                try:
                    await Shutdown(parts, self.cfg.runtime.shutdown_budget_s).run()
                finally:
                    parts.inbox.close()
                self.report()
        return exits.OK

    def _install_signals(self) -> None:
        if not self.env.signals or threading.current_thread() is not threading.main_thread():
            return  # an in-process test harness; it stops us with request_stop()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self.stopping.is_set():
            log.warning("second signal: exiting without graceful shutdown")
            os._exit(128 + sig)
        log.info("stopping", extra={"signal": signal.Signals(sig).name})
        self.stopping.set()

    def request_stop(self) -> None:
        """Thread-safe: begin the graceful shutdown."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)

    # ----- reporting -------------------------------------------------------------------------------------

    async def _report_loop(self, parts: Components) -> None:
        while not self.stopping.is_set():
            await wait(self.stopping, REPORT_S)
            self.report()

    def report(self) -> None:
        parts = self.parts
        if parts is None:
            return
        self.stats.set("active_connections", len(parts.holdings))
        self.stats.set("upstream_connected", parts.holdings.connected())
        self.stats.set("sink_buffer_messages", parts.ctx.sink.buffered)
        self.stats.set("session_live", parts.session.live_gauge())
        if self.reporter is not None:
            snap = self.stats.snapshot()
            snap["session_id"] = parts.session.session_id
            snap["held"] = len(parts.holdings)
            self.reporter(snap)


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    step: Callable[[], Awaitable[None]]
    timeout_s: float
    quiet: bool = False  # best effort: a failure is logged at info, not warning


class Shutdown:
    """The shutdown as a table of named, bounded phases, each logged with its duration.

    Peers are told we are draining alongside (a mark that costs them nothing); the held streams are
    offered to peers with room (one write each when taken, ``fleetd.shard.handoff``); what they did not
    take is released with hints, bounded by the budget and by our fence deadline; whatever is left is
    fenced, and our session ends (expired now) so that peers take over at once what we could not
    release.  The whole is one trace span, each phase an event of it."""

    def __init__(self, parts: Components, budget_s: float) -> None:
        self.parts = parts
        self.budget_s = budget_s

    async def run(self) -> None:
        p = self.parts
        clock = p.ctx.clock
        started = clock.monotonic()
        log.info("shutting down", extra={"held": len(p.holdings)})
        with p.ctx.tracer.span("shutdown", session_id=p.session.session_id, held=len(p.holdings)) as span:
            try:
                await self._phases(span)
            finally:
                p.session.finish()  # renewing and fencing stop only now that nothing is held
        log.info("shard stopped", extra={"seconds": round(clock.monotonic() - started, 3)})

    async def _phases(self, span: Span) -> None:
        p = self.parts
        clock = p.ctx.clock
        started = clock.monotonic()
        mark = Phase("draining_mark", p.session.mark_draining, 1.0, quiet=True)
        draining = asyncio.ensure_future(self._phase(mark, span))
        # The session is renewed (and fenced) through the shutdown, so the budget bounds it; item leases are
        # no longer renewed, so in item mode the first item's deadline bounds it too.
        deadline = p.items.next_deadline()
        hand_over_s = max(0.5, min(self.budget_s / 2, OFFER_WAIT_S + 3.0, deadline - started))
        await self._phase(Phase("hand_over", p.handoff.run, hand_over_s), span)
        release_s = max(0.5, min(self.budget_s - 2.0 - (clock.monotonic() - started), deadline - clock.monotonic()))
        phases = (
            Phase("release", lambda: p.holdings.release(p.holdings.ids(), hint=True, reason="shutdown"), release_s),
            Phase("fence_remaining", self._fence_remaining, 1.0),
            Phase("draining_mark_done", lambda: draining, 1.5, quiet=True),
            Phase("disown_strays", p.reconciler.disown_strays, 2.0, quiet=True),
            Phase("end_session", p.session.end, 1.5, quiet=True),
        )
        for phase in phases:
            await self._phase(phase, span)

    async def _fence_remaining(self) -> None:
        if len(self.parts.holdings):
            log.warning("shutdown budget exhausted; remaining leases expire on their own",
                        extra={"held": len(self.parts.holdings)})
        self.parts.holdings.fence_remaining()

    async def _phase(self, phase: Phase, span: Span) -> None:
        clock = self.parts.ctx.clock
        started = clock.monotonic()
        outcome = "done"
        try:
            await asyncio.wait_for(phase.step(), phase.timeout_s)
        except TimeoutError:
            outcome = "timeout"
        except Exception as e:
            outcome = f"failed: {type(e).__name__}: {e}"
        level = logging.INFO if outcome == "done" or phase.quiet else logging.WARNING
        seconds = round(clock.monotonic() - started, 3)
        log.log(level, "shutdown phase", extra={"phase": phase.name, "outcome": outcome, "seconds": seconds})
        span.event("phase", phase=phase.name, outcome=outcome, seconds=seconds)


def main(cfg: Config, index: int = 0, reporter: Reporter | None = None, predecessor: str | None = None) -> int:
    """Run one shard in this process until SIGTERM/SIGINT; returns the exit code."""
    logs.setup(cfg.runtime.log_format, cfg.runtime.log_level)
    logs.set_context(shard=index)
    shard = Shard(cfg, index, reporter=reporter, predecessor=predecessor)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(shard.run())
