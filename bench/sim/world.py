"""One seeded simulation: tasks of fleetd shards, their supervisors, ctl, AWS and upstreams.

Model
-----
* A *task* (an ECS task) has 1-2 shard processes and a supervisor process; each
  process has its own :class:`~bench.sim.vloop.VirtualLoop`, its own clients on the
  simulated network and (shards) its own clock: wall = virtual time + skew, monotonic
  = virtual time (= its loop's ``time()``).
* A shard process runs ``fleetd.shard.Shard(cfg, index, clock, None, predecessor,
  env).run()`` — fleetd's own code — with ``Environment(open_clients=<simulated>,
  connect=<simulated upstreams>, signals=False, nonce=<counter>)``.
* Lifecycle events (scheduled by the seed inside the fault window):
  ``crash`` (SIGKILL: never stepped again, sockets closed at once, requests already
  sent still land; the supervisor expires its session through its own client with
  ``LeaseStore.expire_session`` and starts a new shard with ``predecessor=sid`` after
  a backoff), ``term`` (SIGTERM: ``stopping.set()``; SIGKILL after the shutdown budget
  + 5 s; a fresh shard replaces it later), ``pause`` (SIGSTOP for longer than the TTL,
  then SIGCONT), ``task_kill`` (every process of a task SIGKILLed, no expiry; a new
  task may boot later), ``ctl_stop`` / ``ctl_start`` / ``ctl_new`` (the UpdateItem
  ``fleetd ctl`` writes, through a ctl process's client, and its START hint),
  ``up_close`` / ``up_stall`` / ``up_refuse`` (upstream faults) and ``burst``
  (a window of heavy request faults).
* A shard whose ``run()`` returns or raises without being told to stop is restarted
  by its supervisor like a crashed one.
* Determinism: fleetd's global ``random`` is seeded with the seed, the simulation
  draws from its own ``random.Random(seed)``, session nonces come from a counter, and
  the scheduler steps loops in a fixed order.  ``PYTHONHASHSEED`` must be fixed (the
  runner sees to it).

Not modelled: the supervisor's DEAD_SESSION hints, metrics endpoint and CloudWatch
publisher; crash-loop backoff growth; host loss of the network (a crashed process's
in-flight requests always land); memory limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import sys
from asyncio import events
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

from bench.sim.feeds import Feed, Upstreams
from bench.sim.invariants import HANDOVER_S, TAIL_S, Checker
from bench.sim.net import CloudWatchClient, DynamoClient, FaultMix, Network, SqsClient
from bench.sim.services import CloudWatchService, DynamoService, SqsService
from bench.sim.vloop import Livelock, Scheduler, VirtualLoop, VirtualTime
from fleetd import config, items, tracing
from fleetd.aws import Clients
from fleetd.config import Config
from fleetd.lease import LeaseStore
from fleetd.schema import TABLES, create_table_request
from fleetd.shard import Environment, Shard

START = 1000.0  # virtual monotonic time at which the world begins
EPOCH_MS = 1_800_000_000_000  # wall clock (ms) at virtual time 0
KILL_GRACE_S = 5.0
RESTART_BACKOFF_S = 0.5
EXPIRE_WAIT_S = 3.0
log = logging.getLogger("bench.sim")


def make_dynamo(now_ms: Callable[[], int], index_lag_ms: Callable[[], int]) -> Any:
    """The simulated DynamoDB (``bench.sim.dynamo``)."""
    from bench.sim.dynamo import SimDynamo

    return SimDynamo(now_ms, index_lag_ms)


class SimClock:
    """fleetd.clock.Clock on virtual time: wall = virtual + skew; monotonic = virtual (= loop.time())."""

    __slots__ = ("skew_ms", "vt")

    def __init__(self, vt: VirtualTime, skew_ms: int) -> None:
        self.vt = vt
        self.skew_ms = skew_ms

    def now_ms(self) -> int:
        return EPOCH_MS + int(self.vt.now * 1000) + self.skew_ms

    def monotonic(self) -> float:
        return self.vt.now


@dataclass(slots=True)
class Event:
    at: float
    kind: str
    arg: str = ""
    value: float = 0.0


@dataclass(slots=True)
class Params:
    """Everything a seed decides before the world is built (scenarios may change it)."""

    seed: int
    long: bool
    cfg: Config
    tasks: int
    shards_per_task: int
    conns: int
    faults_until: float  # seconds after START
    mix: FaultMix
    skews_ms: list[int]
    events: list[Event] = field(default_factory=list)
    first_seqs: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    index_lag_ms: tuple[int, int] = (0, 200)
    unsafe_skew: bool = False

    @property
    def bound_s(self) -> float:
        le, aw, up = self.cfg.lease, self.cfg.aws, self.cfg.upstream
        return (le.lease_ttl_s + le.safety_margin_s + 2 * le.reconcile_s * (1 + le.reconcile_jitter)
                + aw.aws_timeout_s * aw.aws_max_attempts + up.backoff_max_s + 3.0)


FAST = {"lease_ttl_s": 4.0, "heartbeat_s": 1.0, "safety_margin_s": 1.0, "reconcile_s": 1.0,
        "desired_state_s": 1.0, "desired_sweep_s": 3.0, "checkpoint_s": 1.0, "checkpoint_idle_s": 3.0,
        "dead_session_grace_s": 3.0, "aws_timeout_s": 1.0, "aws_max_attempts": 3, "hint_wait_s": 2,
        "shutdown_budget_s": 4.0, "backoff_min_s": 0.2, "backoff_max_s": 1.0, "ping_idle_s": 2.0,
        "ping_reply_s": 1.0, "handshake_timeout_s": 2.0}
"""The CI profile: a TTL of 4 s keeps a whole failure-and-recovery story within ~25 virtual seconds."""
MEDIUM = dict(FAST, lease_ttl_s=8.0, heartbeat_s=2.0, safety_margin_s=2.0, reconcile_s=2.0, desired_state_s=2.0,
              desired_sweep_s=6.0, dead_session_grace_s=6.0, aws_timeout_s=2.0, backoff_max_s=2.0)
DEFAULTS = {"backoff_max_s": 5.0, "hint_wait_s": 5}
"""The long profile's other half: fleetd's default timings (TTL 20 s), faster upstream backoff only."""


def build_config(rng: random.Random, long: bool) -> Config:
    profile = rng.choices((FAST, MEDIUM, DEFAULTS), (0.05, 0.15, 0.8) if long else (0.85, 0.15, 0.0))[0]
    changes: dict[str, Any] = dict(profile)
    changes["lease_mode"] = "item" if rng.random() < 0.2 else "session"
    changes["rebalance_s"] = 0.0 if rng.random() < 0.4 else (30.0 if profile is DEFAULTS else 3.0)
    changes["checkpoint_min_seqs"] = rng.choice((1, 5, 20, 100))
    changes["sink_linger_ms"] = rng.choice((10, 50))
    return config.replace(Config(), **changes)


def build_params(seed: int, long: bool = False) -> Params:
    rng = random.Random(seed)
    cfg = build_config(rng, long)
    tasks = rng.choices((1, 2, 3), (0.4, 0.45, 0.15))[0]
    spt = rng.choices((1, 2), (0.6, 0.4))[0]
    conns = rng.randint(3, 40 if long else 12)
    ttl = cfg.lease.lease_ttl_s
    faults_until = rng.uniform(240, 900) if long else rng.uniform(1.5, 3.5) * ttl
    margin_ms = cfg.lease.safety_margin_s * 1000
    n_shards = tasks * spt
    capacity = 700 if rng.random() < 0.7 else max(2, math.ceil(conns / max(1, n_shards - 1)) + rng.randint(0, 3))
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, max_connections_per_shard=capacity))
    p = Params(seed, long, cfg, tasks, spt, conns, faults_until, FaultMix.random(rng, faults_until),
               [int(rng.uniform(-0.5, 0.5) * margin_ms) for _ in range(64)])
    p.first_seqs = [rng.choice((0, 1)) for _ in range(conns + 64)]
    p.rates = [rng.choice((0.2, 0.5, 1.0)) * (0.25 if long else 1.0) for _ in range(conns + 64)]
    p.index_lag_ms = (0, rng.choice((5, 100, 500, 1500)))
    p.events = random_events(rng, p)
    return p


EVENT_WEIGHTS = {"crash": 3, "term": 2, "pause": 2, "task_kill": 1, "ctl_stop": 2, "ctl_start": 1, "ctl_new": 1,
                 "up_close": 2, "up_stall": 1, "up_refuse": 1, "burst": 1}


def random_events(rng: random.Random, p: Params) -> list[Event]:
    kinds = list(EVENT_WEIGHTS)
    weights = [EVENT_WEIGHTS[k] for k in kinds]
    n = rng.randint(0, 5) if not p.long else int(p.faults_until / rng.uniform(10, 40))
    ttl = p.cfg.lease.lease_ttl_s
    events: list[Event] = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        at = rng.uniform(1.0, p.faults_until)
        value = 0.0
        if kind == "pause":
            value = rng.uniform(ttl + 1, ttl * 2.5)
            at = min(at, max(1.0, p.faults_until - value))
        elif kind in ("up_refuse", "burst"):
            value = rng.uniform(1.0, 6.0)
        elif kind == "term":
            value = rng.uniform(0.5, 4.0)  # delay before its replacement starts
        events.append(Event(START + at, kind, "", value))
    events.sort(key=lambda e: e.at)
    return events


@dataclass(slots=True)
class Proc:
    """A simulated OS process."""

    name: str
    order: int
    kind: str  # shard | supervisor | ctl
    loop: VirtualLoop
    task: TaskState | None = None
    index: int = 0
    shard: Shard | None = None
    state: str = "running"  # running | paused | crashed | exited
    stop_requested: bool = False
    started_at: float = 0.0
    ended_at: float | None = None
    sockets: dict[Any, None] = field(default_factory=dict)  # an ordered set: a crash closes them in order
    clients: Clients | None = None
    main: asyncio.Task[Any] | None = None


@dataclass(slots=True)
class TaskState:
    task_id: str
    cfg: Config
    supervisor: Proc
    slots: dict[int, Proc | None] = field(default_factory=dict)
    dead: bool = False


class World:
    """Builds and runs one seeded simulation (see the module docstring)."""

    def __init__(self, p: Params, trace: bool = False) -> None:
        self.p = p
        self.cfg = p.cfg
        self.rng = random.Random(f"world:{p.seed}")
        self.vt = VirtualTime(START)
        self.sched = Scheduler(self.vt)
        self.lines: list[str] | None = [] if trace else None
        lag_lo, lag_hi = p.index_lag_ms
        self.dynamo_rng = random.Random(f"dynamo:{p.seed}")
        self.dynamo = make_dynamo(self.true_ms, lambda: self.dynamo_rng.randint(lag_lo, lag_hi))
        self.ddb_service = DynamoService(self.dynamo)
        self.sqs = SqsService(self.sched)
        self.net = Network(self.sched, random.Random(f"net:{p.seed}"),
                           {"dynamodb": self.ddb_service, "sqs": self.sqs, "cloudwatch": CloudWatchService()}, p.mix)
        aws = self.cfg.aws
        self.first_seq: dict[str, int] = {}
        self.checker = Checker(lambda: self.vt.now, self.dynamo, aws.connections_table, aws.messages_table,
                               self.first_seq)
        up_rng = random.Random(f"up:{p.seed}")
        self.ups = Upstreams(self.checker, self.cfg.upstream.resume_param, lambda: 0.002 + 0.02 * up_rng.random())
        self.net.on_send.append(self.checker.on_send)
        self.net.on_apply.append(self.checker.on_apply)
        self.sched.before_advance.append(self.checker.before_advance)
        self.sched.on_spin.append(self.checker.spinning)
        self.checker.origin = START
        if trace:
            self.net.trace = self.ups.trace = self.checker.trace = self.say
        self.procs: list[Proc] = []
        self.tasks: list[TaskState] = []
        self.nonces = 0
        self.shards_started = 0
        self.conn_ids: list[str] = []
        self.ctl: Proc | None = None
        self.end = START + p.faults_until + p.bound_s
        self.shard_seconds = 0.0
        self.last_resume = 0.0  # a paused process can act only from its SIGCONT on

    # ----- helpers -----------------------------------------------------------------------------------

    def true_ms(self) -> int:
        return EPOCH_MS + int(self.vt.now * 1000)

    def say(self, msg: str) -> None:
        if self.lines is not None:
            self.lines.append(f"{self.vt.now - START:10.4f} {msg}")

    def nonce(self) -> str:
        self.nonces += 1
        return f"n{self.nonces:04d}"

    def _new_proc(self, name: str, kind: str, task: TaskState | None = None, index: int = 0) -> Proc:
        loop = VirtualLoop(self.vt, name)
        proc = Proc(name, len(self.procs), kind, loop, task, index, started_at=self.vt.now)
        self.procs.append(proc)
        self.sched.add(loop)
        self.checker.set_running(name, True)
        return proc

    def _clients(self, proc: Proc, cfg: Config) -> Clients:
        aw = cfg.aws

        def rng(service: str) -> random.Random:
            return random.Random(f"{self.p.seed}:{proc.name}:{service}")

        ddb = DynamoClient(self.net, proc.loop, proc.name, "dynamodb", aw.aws_timeout_s, aw.aws_max_attempts,
                           rng("ddb"))
        sqs = SqsClient(self.net, proc.loop, proc.name, "sqs", aw.hint_wait_s + 10.0, aw.aws_max_attempts, rng("sqs"))
        cw = CloudWatchClient(self.net, proc.loop, proc.name, "cloudwatch", aw.aws_timeout_s, aw.aws_max_attempts,
                              rng("cw"))
        sink = DynamoClient(self.net, proc.loop, proc.name, "dynamodb", aw.aws_timeout_s, 1, rng("sink"))
        renew = DynamoClient(self.net, proc.loop, proc.name, "dynamodb", aw.aws_timeout_s, 1, rng("renew"))
        return Clients(ddb, sqs, cw, sink, renew)

    # ----- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        random.seed(self.p.seed)  # fleetd's own randomness
        for table in TABLES:
            self.ddb_service.create_table(create_table_request(table, self.cfg.aws))
        self.sqs.create_queue(self.cfg.aws.hints_queue)
        self.ctl = self._new_proc("ctl", "ctl")
        self.ctl.clients = self._clients(self.ctl, self.cfg)
        for _ in range(self.p.conns):
            self._create_item(direct=True)
        for t in range(self.p.tasks):
            self._start_task(t)
        for ev in self.p.events:
            self.sched.at(ev.at, lambda ev=ev: self._fire(ev))  # type: ignore[misc]

    def _create_item(self, direct: bool) -> str:
        i = len(self.conn_ids)
        cid = f"c{i:02d}"
        self.conn_ids.append(cid)
        self.first_seq[cid] = self.p.first_seqs[i % len(self.p.first_seqs)]
        self.ups.add(Feed(cid, self.first_seq[cid], self.p.rates[i % len(self.p.rates)], self.vt.now))
        if direct:
            self.dynamo.handle("UpdateItem", ctl_start_params(self.cfg, cid, self.ups.url(cid), self.true_ms()))
            self.checker.timelines.setdefault(cid, _timeline()).changes.append((self.vt.now, "STARTED"))
        return cid

    def _start_task(self, t: int) -> TaskState:
        task_id = f"t{t}"
        cfg = dataclasses.replace(self.cfg, runtime=dataclasses.replace(self.cfg.runtime, task_id=task_id))
        sup = self._new_proc(f"{task_id}/sup", "supervisor")
        sup.clients = self._clients(sup, cfg)
        task = TaskState(task_id, cfg, sup)
        sup.task = task
        self.tasks.append(task)
        for i in range(self.p.shards_per_task):
            self.start_shard(task, i)
        return task

    def start_shard(self, task: TaskState, index: int, predecessor: str | None = None) -> Proc | None:
        if task.dead:
            return None
        gen = sum(1 for p in self.procs if p.task is task and p.kind == "shard" and p.index == index)
        proc = self._new_proc(f"{task.task_id}/s{index}.{gen}", "shard", task, index)
        self.shards_started += 1
        skew = self.p.skews_ms[(self.shards_started - 1) % len(self.p.skews_ms)]
        clock = SimClock(self.vt, skew)
        proc.clients = self._clients(proc, task.cfg)
        clients = proc.clients

        async def open_clients(stack: AsyncExitStack, aws_cfg: Any) -> Clients:
            return clients

        # Never traced, whatever OTEL_* this process has: an exporter thread has no place on a virtual clock.
        env = Environment(open_clients=open_clients, connect=self.ups.connector(proc), signals=False,
                          nonce=self.nonce, tracer=lambda _: tracing.NULL)
        proc.shard = Shard(task.cfg, index, clock=clock, reporter=None, predecessor=predecessor, env=env)
        proc.main = proc.loop.create_task(proc.shard.run())
        proc.main.add_done_callback(lambda fut, proc=proc: self._exited(proc, fut))  # type: ignore[misc]
        task.slots[index] = proc
        self.say(f"proc start {proc.name} skew={skew}ms predecessor={predecessor or '-'}")
        return proc

    # ----- lifecycle -------------------------------------------------------------------------------------

    def _gone(self, proc: Proc, state: str) -> None:
        proc.state = state
        proc.ended_at = self.vt.now
        self.sched.remove(proc.loop)
        self.checker.set_running(proc.name, False)
        for tr in list(proc.sockets):
            tr.crash()
        proc.sockets.clear()
        if proc.kind == "shard":
            self.shard_seconds += self.vt.now - proc.started_at

    def _exited(self, proc: Proc, fut: asyncio.Future[Any]) -> None:
        if proc.state != "running":
            return
        exc = None if fut.cancelled() else fut.exception()
        self.say(f"proc exit {proc.name} {'exception ' + repr(exc) if exc else 'code ' + str(fut.result())}")
        if exc is not None:
            proc.loop.errors.append(f"shard raised {exc!r}")
        self._gone(proc, "exited")
        if not proc.stop_requested:
            self._bury(proc)

    def crash(self, proc: Proc, restart: bool = True) -> None:
        if proc.state not in ("running", "paused"):
            return
        self.say(f"proc crash {proc.name}")
        self._gone(proc, "crashed")
        if restart and proc.kind == "shard":
            self._bury(proc)

    def _bury(self, proc: Proc) -> None:
        """The supervisor: expire the dead shard's session, restart it with that predecessor."""
        task = proc.task
        if task is None or task.dead or proc.shard is None or task.slots.get(proc.index) is not proc:
            return
        sid = proc.shard.session_id
        sup = task.supervisor
        task.slots[proc.index] = None

        async def restart() -> None:
            assert sup.clients is not None
            expiring = None
            if sid:
                store = LeaseStore(sup.clients.dynamodb, task.cfg.aws, task.cfg.lease,
                                   SimClock(self.vt, 0))
                expiring = asyncio.ensure_future(store.expire_session(sid))
            await asyncio.sleep(RESTART_BACKOFF_S)
            if expiring is not None:
                await asyncio.wait([expiring], timeout=max(0.0, EXPIRE_WAIT_S - RESTART_BACKOFF_S))
            if task.slots.get(proc.index) is None:
                self.start_shard(task, proc.index, predecessor=sid or None)

        sup.loop.create_task(restart())

    def term(self, proc: Proc, replace_after: float) -> None:
        shard = proc.shard
        if proc.state != "running" or shard is None:
            return
        self.say(f"proc SIGTERM {proc.name}")
        proc.stop_requested = True
        stopping = shard.stopping
        proc.loop.call_soon(stopping.set)
        budget = proc.task.cfg.runtime.shutdown_budget_s if proc.task else 20.0
        self.sched.at(self.vt.now + budget + KILL_GRACE_S, lambda: self.crash(proc, restart=False))
        task = proc.task
        if task is not None:
            task.slots[proc.index] = None
            self.sched.at(self.vt.now + replace_after, lambda: self._replace(task, proc.index))

    def _replace(self, task: TaskState, index: int) -> None:
        if task.slots.get(index) is None:
            self.start_shard(task, index)

    def pause(self, proc: Proc, seconds: float) -> None:
        if proc.state != "running":
            return
        self.say(f"proc SIGSTOP {proc.name} for {seconds:.2f}s")
        proc.state = "paused"
        self.sched.remove(proc.loop)
        self.checker.set_running(proc.name, False)
        self.sched.at(self.vt.now + seconds, lambda: self.resume(proc))

    def resume(self, proc: Proc) -> None:
        if proc.state != "paused":
            return
        self.say(f"proc SIGCONT {proc.name}")
        self.last_resume = max(self.last_resume, self.vt.now)
        proc.state = "running"
        self.sched.add(proc.loop)
        self.sched.loops.sort(key=self._order)
        self.checker.set_running(proc.name, True)

    def _order(self, loop: VirtualLoop) -> int:
        return next(p.order for p in self.procs if p.loop is loop)

    def _new_task(self) -> None:
        self._start_task(len(self.tasks))

    def kill_task(self, task: TaskState) -> None:
        self.say(f"task kill {task.task_id}")
        task.dead = True
        for proc in self.procs:
            if proc.task is task:
                self.crash(proc, restart=False)

    # ----- ctl ------------------------------------------------------------------------------------------

    def ctl_start(self, cid: str) -> None:
        assert self.ctl is not None and self.ctl.clients is not None
        clients = self.ctl.clients
        params = ctl_start_params(self.cfg, cid, self.ups.url(cid), self.true_ms())
        self.say(f"ctl start {cid}")

        async def run() -> None:
            try:
                await clients.dynamodb.update_item(**params)
                url = (await clients.sqs.get_queue_url(QueueName=self.cfg.aws.hints_queue))["QueueUrl"]
                await clients.sqs.send_message(QueueUrl=url, MessageBody=f'{{"type":"START","connection_id":"{cid}"}}')
            except Exception as e:
                self.say(f"ctl start {cid} failed: {type(e).__name__}")

        self.ctl.loop.create_task(run())

    def ctl_stop(self, cid: str) -> None:
        assert self.ctl is not None and self.ctl.clients is not None
        clients = self.ctl.clients
        self.say(f"ctl stop {cid}")

        async def run() -> None:
            try:
                await clients.dynamodb.update_item(
                    TableName=self.cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                    UpdateExpression="SET desired_state = :stopped, updated_at_ms = :now",
                    ConditionExpression="attribute_exists(connection_id)",
                    ExpressionAttributeValues={":stopped": {"S": "STOPPED"}, ":now": {"N": str(self.true_ms())}},
                    ReturnValues="ALL_OLD")
            except Exception as e:
                self.say(f"ctl stop {cid} failed: {type(e).__name__}")

        self.ctl.loop.create_task(run())

    # ----- events ---------------------------------------------------------------------------------------

    def running_shards(self) -> list[Proc]:
        return [p for p in self.procs if p.kind == "shard" and p.state == "running"]

    def _fire(self, ev: Event) -> None:
        rng = self.rng
        shards = self.running_shards()
        if ev.kind in ("crash", "term", "pause") and shards:
            proc = rng.choice(shards)
            if ev.kind == "crash":
                self.crash(proc)
            elif ev.kind == "term":
                self.term(proc, ev.value)
            else:
                self.pause(proc, ev.value)
        elif ev.kind == "task_kill":
            live = [t for t in self.tasks if not t.dead]
            if live:
                self.kill_task(rng.choice(live))
                if len(live) == 1 or rng.random() < 0.5:  # the fleet keeps at least one task
                    self.sched.at(self.vt.now + rng.uniform(0.5, 3.0), self._new_task)
        elif ev.kind.startswith("ctl_"):
            self._fire_ctl(ev)
        elif ev.kind.startswith("up_"):
            cid = rng.choice(self.conn_ids)
            self.say(f"upstream {ev.kind} {cid}")
            if ev.kind == "up_close":
                self.ups.close(cid)
            elif ev.kind == "up_stall":
                self.ups.stall(cid)
            else:
                self.ups.refuse(cid, self.vt.now + ev.value)
        elif ev.kind == "burst":
            self.say(f"fault burst for {ev.value:.2f}s")
            self.net.mix.bursts.append((self.vt.now, self.vt.now + ev.value, rng.choice(("lost", "throttle",
                                                                                          "slow", "blackhole"))))

    def _fire_ctl(self, ev: Event) -> None:
        rng = self.rng
        states = {cid: (tl.changes[-1][1] if tl.changes else "") for cid, tl in self.checker.timelines.items()}
        if ev.kind == "ctl_stop":
            started = [c for c in self.conn_ids if states.get(c) == "STARTED"]
            if started:
                self.ctl_stop(rng.choice(started))
        elif ev.kind == "ctl_start":
            stopped = [c for c in self.conn_ids if states.get(c) == "STOPPED"]
            if stopped:
                self.ctl_start(rng.choice(stopped))
        else:
            self.ctl_start(self._create_item(direct=False))

    # ----- running ---------------------------------------------------------------------------------------

    def run(self) -> None:
        self.setup()
        try:
            self.sched.run_until(self.end)
        except Livelock as e:
            self.checker.fail("livelock", str(e))
            return
        self.final_checks()

    def final_checks(self) -> None:
        ck = self.checker
        ck.before_advance()
        aws, le = self.cfg.aws, self.cfg.lease
        items = ck.scan(aws.connections_table)
        started = sorted(i["connection_id"]["S"] for i in items if i.get("desired_state", {}).get("S") == "STARTED")
        shards = self.running_shards()
        names = {p.name for p in shards}
        if sum(p.task.cfg.runtime.max_connections_per_shard for p in shards if p.task) < len(started):
            self.say("end checks: the running shards cannot hold every STARTED connection; liveness not checked")
            self._count_shard_time()
            return
        ck.check_streamed(started, names, self.end, HANDOVER_S + aws.aws_timeout_s)
        ck.check_orphans(items, aws.sessions_table, self.true_ms(), int(le.safety_margin_s * 1000))
        # A pause may outlast the fault window: a stopped stream's owner cannot close it while paused.
        faults_until = max(START + self.p.faults_until, self.last_resume)
        ck.check_stopped(faults_until, le.desired_state_s + 1.0 + 2.0 + self.p.index_lag_ms[1] / 1000, self.end)
        for cid, tl in sorted(ck.timelines.items()):
            if tl.changes and tl.changes[0][0] <= START and all(s == "STARTED" for _, s in tl.changes):
                feed = self.ups.feeds[cid]
                ck.check_lost(cid, feed.first, feed.last_by(self.end - TAIL_S))
        self._count_shard_time()

    def _count_shard_time(self) -> None:
        for p in self.procs:
            if p.kind == "shard" and p.state in ("running", "paused"):
                self.shard_seconds += self.vt.now - p.started_at

    def teardown(self) -> None:
        """Drop every loop: close the coroutines still suspended (their ``finally`` blocks may run and
        fail: nothing they do reaches the world any more), silence asyncio's complaints."""
        hook = sys.unraisablehook
        sys.unraisablehook = _ignore
        try:
            for proc in self.procs:
                _drop_loop(proc.loop)
        finally:
            sys.unraisablehook = hook
        self.procs.clear()

    def trace_hash(self) -> str:
        lines = [ln for ln in (self.lines or []) if " log " not in ln]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]

    def errors(self) -> list[str]:
        return [f"{p.name}: {e}" for p in self.procs for e in p.loop.errors]


def _ignore(unraisable: Any) -> None:
    pass


def _drop_loop(loop: VirtualLoop) -> None:
    events._set_running_loop(loop)
    try:
        for task in list(asyncio.all_tasks(loop)):
            task._log_destroy_pending = False  # type: ignore[attr-defined]
            with suppress(BaseException):
                task.get_coro().close()
    finally:
        events._set_running_loop(None)
    loop._ready.clear()
    loop._scheduled.clear()


def _timeline() -> Any:
    from bench.sim.invariants import Timeline
    return Timeline()


def ctl_start_params(cfg: Config, cid: str, url: str, now_ms: int) -> dict[str, Any]:
    """The UpdateItem ``fleetd ctl start`` writes: fleetd's own one writer of it (fleetd/items.py)."""
    return dict(items.start_update(cfg.aws.connections_table, cid, url, now_ms), ReturnValues="ALL_OLD")


@contextlib.contextmanager
def silence_fleetd(trace: Callable[[str], None] | None) -> Iterator[None]:
    """fleetd's logs off during a run (in a trace, each record becomes a ``log`` line); restored after, so
    a run inside a test process leaves the loggers as it found them (caplog-based tests depend on it)."""
    root, aio = logging.getLogger("fleetd"), logging.getLogger("asyncio")
    saved = (root.handlers[:], root.propagate, root.level, aio.level)
    root.handlers[:] = []
    root.propagate = False
    if trace is None:
        root.setLevel(logging.CRITICAL + 1)
        aio.setLevel(logging.CRITICAL + 1)
    else:
        root.setLevel(logging.INFO)
        root.addHandler(_TraceHandler(trace))
    try:
        yield
    finally:
        root.handlers[:], root.propagate = saved[0], saved[1]
        root.setLevel(saved[2])
        aio.setLevel(saved[3])


class _TraceHandler(logging.Handler):
    def __init__(self, trace: Callable[[str], None]) -> None:
        super().__init__()
        self.trace = trace

    def emit(self, record: logging.LogRecord) -> None:
        extra = {k: v for k, v in record.__dict__.items() if k in _EXTRA_KEYS}
        self.trace(f"log {record.name} {record.getMessage()} {extra if extra else ''}")


_EXTRA_KEYS = frozenset({"connection_id", "session_id", "reason", "held", "error", "outcome", "dead_session", "to",
                         "moved", "released", "count", "signal", "step", "phase", "offered", "taken",
                         "offered_by"})
