"""Scenario ``cold_start`` (issue #18): how fast an empty or restarted fleet gets every stream connected.

Cases, each for fleetd and for the seed design (``baseline``), on fresh tables:

* ``one_shard``: one task (fleetd: ``FLEETD_SHARDS=1``, ``max_connections_per_shard`` = N) and N
  free items;
* ``three_tasks``: three tasks started together (fleetd: three ``fleetd run`` tasks of one shard,
  default capacity) and the fleet's items free;
* ``restart``: the ``three_tasks`` fleet, once it holds every item: all three process trees SIGKILLed at once, three
  new tasks (new task ids) started at once: time until every stream has a new socket;
* ``burst``: a running, empty fleet of three tasks; the harness does N ``fleetd ctl start``\\ s in
  process (:func:`fleetd.items.start_update` and one START hint each, as ``ctl start`` does),
  ``BURST_CONCURRENCY`` in flight: time from the first start until all N are connected.

Per case: seconds from *ready* to all connected and from process start to all connected. Ready, for
fleetd, is every started task's ``/readyz`` answering 200; for the baseline it is the ``ready`` line
the worker prints once its clients and tables are checked, just before its first reconcile (it has
no other readiness signal).  For the burst the clock starts at the first ``ctl start`` instead.  A
stream is *connected* when the fake upstream has a client attached to it (``restart``: a socket
newer than those it had before the kill), polled every ``POLL_S``.  At that moment the connections
table is scanned: each task's share (items whose ``lease_owner`` starts with its task id) and every
item's ``lease_epoch``.  Then the fleet is watched for two of fleetd's rebalance periods
(:func:`watch_moves`): a stream whose owner changed twice or more was moved more than once (the
fake upstream's per-stream socket count and the ``lease_epoch`` writes are kept too).  CPU per
process group over the connect window (:class:`bench.meter.CpuWatch`) says what bounded it.

Both systems talk to dynalite directly, not through the metering proxy (one Python thread would
queue a claim burst), as in the failover scenario, unless the run meters keys (``--meter-keys``, implied
by ``--throttle-keys``): then the systems and the burst's ``ctl start`` writes go through it, and
each case reports the hottest key's busiest second over its connect window.  fleetd runs its product
defaults except under ``--smoke``, which uses the fast profile and a short rebalance period so the CI run stays short.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session

from bench.common import FAST_BASELINE, FAST_FLEETD, Context, UpstreamPool, seed
from bench.meter import CpuWatch
from bench.procs import scan_all
from bench.sut import System, Tables, baseline_worker, fleetd_task, kill_tree
from fleetd import hints, items
from fleetd.aws import client_config, region_of
from fleetd.config import AwsConfig, Config, UpstreamConfig
from fleetd.validation import validate_id, validate_url

SYSTEMS = ("fleetd", "baseline")
TASKS = 3
IDLE_RATE = 0.1  # msgs/s per stream, as in density
POLL_S = 0.2  # the fake upstreams' stats; readiness is polled every tick too
BURST_CONCURRENCY = 32  # ctl starts in flight at once
SMOKE_REBALANCE_S = 1.0  # smoke only: two periods are the watch window
OWNER_SCAN_S = 2.5  # owner scans while watching for moves (a shard rebalances every 30 s by default)
SETTLE_S = 2.0  # after a fleet is connected (restart) or ready (burst), before the event
SMOKE_SETTLE_S = 0.5
PRODUCT = Config()

# Issue #18's acceptance targets (fleetd), printed next to the figures.
TARGET_ONE_SHARD_S = {700: 2.0, 5000: 8.0}
TARGET_THREE_TASKS_S = 4.0
TARGET_SHARE_PCT = 15.0


@dataclass(frozen=True)
class Sizes:
    one_shard: tuple[int, ...]
    fleet: int  # three_tasks and restart
    burst: int


SIZES = {"smoke": Sizes((100,), 300, 200), "quick": Sizes((700, 5000), 1500, 2000),
         "full": Sizes((700, 5000), 1500, 2000)}


@dataclass
class Task:
    """One started system under test: its task id (the ``lease_owner`` prefix) and how to ask if it is ready."""

    kind: str
    task_id: str
    system: System
    ready_url: str = ""  # fleetd: /readyz
    log: Path | None = None  # baseline: prints "ready"

    def ready(self) -> bool:
        if self.kind == "fleetd":
            try:
                with urllib.request.urlopen(self.ready_url, timeout=1.0) as resp:
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False
        assert self.log is not None
        try:
            return any(line.strip() == "ready" for line in self.log.read_text(errors="replace").splitlines())
        except OSError:
            return False


@dataclass
class Timeline:
    """What one connect window saw (monotonic times)."""

    started: float
    ready: float | None = None
    connected: float | None = None
    best: int = 0
    cores: dict[str, float] = field(default_factory=dict)


def rebalance_s(ctx: Context) -> float:
    return SMOKE_REBALANCE_S if ctx.profile.fast_timings else PRODUCT.lease.rebalance_s


def settle_s(ctx: Context) -> float:
    return SMOKE_SETTLE_S if ctx.profile.fast_timings else SETTLE_S


def start_task(ctx: Context, kind: str, task_id: str, tables: Tables, capacity: int | None = None) -> Task:
    """A fleetd task of one shard (``capacity`` per shard, default the product's) or a baseline worker."""
    env = ctx.sut_env(metered=ctx.meter_keys)
    if kind == "fleetd":
        settings: dict[str, str] = {}
        if ctx.profile.fast_timings:
            settings.update(FAST_FLEETD, FLEETD_REBALANCE_S=str(SMOKE_REBALANCE_S))
        if capacity is not None:
            settings["FLEETD_MAX_CONNECTIONS_PER_SHARD"] = str(capacity)
        system, metrics_url = fleetd_task(task_id, 1, tables, ctx.logs, env, **settings)
        return Task(kind, task_id, ctx.started(system),
                    ready_url=metrics_url.removesuffix("/metrics") + "/readyz")
    extra = FAST_BASELINE if ctx.profile.fast_timings else ()
    system, _ = baseline_worker(task_id, tables, ctx.logs, env, *extra)
    return Task(kind, task_id, ctx.started(system), log=system.log_path)


def start_tasks(ctx: Context, kind: str, prefix: str, tables: Tables, count: int,
                capacity: int | None = None) -> tuple[float, list[Task]]:
    """``count`` tasks started back to back; returns the time just before the first and the tasks."""
    t0 = time.monotonic()
    return t0, [start_task(ctx, kind, f"{prefix}{i}", tables, capacity) for i in range(count)]


def connected(streams: dict[str, dict[str, Any]], cid: str, sockets_before: int) -> bool:
    s = streams.get(cid)
    return s is not None and int(s["attached"]) > 0 and int(s["connections"]) > sockets_before


def watch_connect(ctx: Context, pool: UpstreamPool, want: dict[str, int], tasks: list[Task], started: float,
                  timeout_s: float, what: str) -> Timeline:
    """Poll readiness and the fake upstreams until every stream of ``want`` (id → sockets it had
    before) is connected, a task dies or ``timeout_s`` passes.  Readiness is polled on until it is
    seen (bounded), so a system that connects before it says it is ready shows a negative figure."""
    line = Timeline(started)
    groups = cpu_groups(ctx, pool, tasks)
    cpu = CpuWatch(groups)
    deadline = started + timeout_s
    last_note = time.monotonic()
    while time.monotonic() < deadline:
        now = time.monotonic()
        if line.ready is None and all(t.ready() for t in tasks):
            line.ready = now
        if line.connected is None:
            streams = pool.streams()
            n = sum(1 for cid, before in want.items() if connected(streams, cid, before))
            line.best = max(line.best, n)
            if n >= len(want):
                line.connected = time.monotonic()
                cpu.poll()
                line.cores = cpu.cores()
            elif now - last_note > 5:
                ctx.progress(f"{what}: {n}/{len(want)} connected")
                last_note = now
            else:
                cpu.poll()
        if line.connected is not None and line.ready is not None:
            break
        if line.connected is not None and now - line.connected > 30:
            break  # never said it was ready
        if not all(t.system.alive() for t in tasks):
            ctx.progress(f"{what}: a task exited ({[t.task_id for t in tasks if not t.system.alive()]})")
            break
        time.sleep(max(0.0, POLL_S - (time.monotonic() - now)))
    if line.connected is None:
        cpu.poll()
        line.cores = cpu.cores()
    return line


def cpu_groups(ctx: Context, pool: UpstreamPool, tasks: list[Task]) -> dict[str, list[int]]:
    servers = ctx.stack.pids() if ctx.stack is not None else {}
    return {"dynalite": [servers["dynalite"]] if "dynalite" in servers else [],
            "moto (SQS)": [servers["moto"]] if "moto" in servers else [],
            "system": [t.system.pid for t in tasks],
            "upstreams": [p.proc.pid for p in pool.procs]}


@dataclass(frozen=True)
class Snapshot:
    """The connections table at one moment: owner and lease epoch per item."""

    owner: dict[str, str]
    epoch: dict[str, int]

    @staticmethod
    def take(tables: Tables) -> Snapshot:
        rows = scan_all(tables.connections, ConsistentRead=True,
                        ProjectionExpression="connection_id, lease_owner, lease_epoch")
        return Snapshot({r["connection_id"]["S"]: r.get("lease_owner", {}).get("S", "") for r in rows},
                        {r["connection_id"]["S"]: int(r.get("lease_epoch", {}).get("N", "0")) for r in rows})

    def shares(self, ids: list[str], tasks: list[Task]) -> dict[str, int]:
        out = {t.task_id: 0 for t in tasks}
        for cid in ids:
            task = self.owner.get(cid, "").split("/", 1)[0]
            if task in out:
                out[task] += 1
        return out


def share_spread(shares: dict[str, int]) -> tuple[float | None, float | None]:
    """The smallest and largest share relative to the fair share, in % (-10 = 10 % under)."""
    total = sum(shares.values())
    if not shares or not total:
        return None, None
    fair = total / len(shares)
    rel = [100.0 * (n / fair - 1.0) for n in shares.values()]
    return round(min(rel), 1), round(max(rel), 1)


def watch_moves(ctx: Context, tables: Tables, pool: UpstreamPool, ids: list[str], tasks: list[Task],
                at: Snapshot, window_s: float) -> dict[str, Any]:
    """Moves over ``window_s`` after all were connected, counted three ways per stream: owner changes
    seen by table scans every ``OWNER_SCAN_S`` (at most; a hand-over is one owner change), new sockets at the
    fake upstream (a moved stream is opened again by its new owner), and ``lease_epoch`` increments
    (fleetd writes two per hand-over, the push and the receiver's adopting claim)."""
    streams0 = pool.streams()
    changes = dict.fromkeys(ids, 0)
    last = at
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        time.sleep(min(OWNER_SCAN_S, window_s / 8, max(0.0, end - time.monotonic())))
        now = Snapshot.take(tables)
        for cid in ids:
            if now.owner.get(cid, "") != last.owner.get(cid, ""):
                changes[cid] += 1
        last = now
    streams1 = pool.streams()
    sockets = [int(streams1.get(c, {}).get("connections", 0)) - int(streams0.get(c, {}).get("connections", 0))
               for c in ids]
    epochs = [last.epoch.get(c, 0) - at.epoch.get(c, 0) for c in ids]
    return {"watch_s": window_s,
            "moved": sum(1 for n in changes.values() if n >= 1),
            "moved_twice": sum(1 for n in changes.values() if n >= 2),
            "new_socket": sum(1 for d in sockets if d >= 1), "new_sockets_twice": sum(1 for d in sockets if d >= 2),
            "epoch_writes": sum(epochs),
            "shares_after_watch": last.shares(ids, tasks),
            "attached_after_watch": sum(1 for c in ids if int(streams1.get(c, {}).get("attached", 0)) > 0)}


def measure(ctx: Context, case: str, kind: str, tables: Tables, pool: UpstreamPool, ids: list[str],
            tasks: list[Task], line: Timeline, watch: bool) -> dict[str, Any]:
    """The case's figures from its timeline; with ``watch``, the fleet watched 2 × rebalance_s after."""
    at = Snapshot.take(tables)
    shares = at.shares(ids, tasks)
    low, high = share_spread(shares)
    row: dict[str, Any] = {
        "case": case, "system": kind, "streams": len(ids), "tasks": len(tasks),
        "connected": line.connected is not None, "max_connected": line.best,
        "start_to_ready_s": _s(line.ready, line.started),
        "ready_to_all_s": _s(line.connected, line.ready),
        "start_to_all_s": _s(line.connected, line.started),
        "shares": shares, "share_min_pct": low, "share_max_pct": high,
        "unowned_at_all_connected": sum(1 for c in ids if not at.owner.get(c)),
        "cpu_cores": line.cores,
    }
    if ctx.meter_keys:
        row["hot_keys"] = ctx.hot_keys(line.started, line.connected or time.monotonic(), tables)
    if watch and line.connected is not None:
        window = 2 * rebalance_s(ctx)
        ctx.progress(f"cold_start {case} {kind}: connected; watching {window:g} s for moves")
        row.update(watch_moves(ctx, tables, pool, ids, tasks, at, window))
    ctx.progress(f"cold_start {case} {kind} {len(ids)}: ready→all {_fmt(row['ready_to_all_s'])} s, "
                 f"start→all {_fmt(row['start_to_all_s'])} s, shares {shares}"
                 + (f", moved {row['moved']} (≥2: {row['moved_twice']})" if "moved" in row else ""))
    return row


def _s(end: float | None, begin: float | None) -> float | None:
    return None if end is None or begin is None else round(end - begin, 2)


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def upstreams(ctx: Context, n: int) -> UpstreamPool:
    return ctx.upstreams(1 if n <= 2500 else 2, IDLE_RATE)


def close(ctx: Context, tasks: list[Task], pool: UpstreamPool) -> None:
    """SIGKILL the tasks (measured already: a graceful stop would only cost time) and the upstreams."""
    for t in tasks:
        if t.system.alive():
            kill_tree(t.system)
        ctx.stop(t.system)
    for p in pool.procs:
        ctx.stop(p)


# ----- the cases ---------------------------------------------------------------------------------------

def one_shard(ctx: Context, kind: str, n: int) -> dict[str, Any]:
    tables = ctx.fresh_tables()
    pool = upstreams(ctx, n)
    ids = seed(tables, pool, n)
    if ctx.meter_keys:
        ctx.prime_meter(tables)
    t0, tasks = start_tasks(ctx, kind, f"s{n}-", tables, 1, capacity=n)
    try:
        line = watch_connect(ctx, pool, dict.fromkeys(ids, 0), tasks, t0, 30 + n / 40,
                             f"cold_start one_shard {kind} {n}")
        return measure(ctx, f"one_shard_{n}", kind, tables, pool, ids, tasks, line, False)
    finally:
        close(ctx, tasks, pool)


def three_tasks_and_restart(ctx: Context, kind: str, n: int) -> list[dict[str, Any]]:
    """Three tasks started together on ``n`` free items; then, once they hold every stream, all three
    process trees SIGKILLed at once and three new tasks (new task ids) started at once."""
    tables = ctx.fresh_tables()
    pool = upstreams(ctx, n)
    ids = seed(tables, pool, n)
    if ctx.meter_keys:
        ctx.prime_meter(tables)
    t0, old = start_tasks(ctx, kind, "t", tables, TASKS)
    tasks: list[Task] = []
    try:
        line = watch_connect(ctx, pool, dict.fromkeys(ids, 0), old, t0, 60 + n / 40,
                             f"cold_start three_tasks {kind}")
        rows = [measure(ctx, "three_tasks", kind, tables, pool, ids, old, line, True)]
        refill = watch_connect(ctx, pool, dict.fromkeys(ids, 0), old, time.monotonic(), 60,
                               f"cold_start restart {kind}: all held before the kill")
        if refill.connected is None:
            ctx.progress(f"cold_start restart {kind}: skipped, only {refill.best}/{n} held")
            return rows
        time.sleep(settle_s(ctx))
        streams = pool.streams()
        before = {cid: int(streams[cid]["connections"]) for cid in ids}
        killed = time.monotonic()
        for t in old:
            kill_tree(t.system)
            ctx.stop(t.system)
        t1, tasks = start_tasks(ctx, kind, "r", tables, TASKS)
        line = watch_connect(ctx, pool, before, tasks, t1, 240, f"cold_start restart {kind}")
        rows.append(measure(ctx, "restart", kind, tables, pool, ids, tasks, line, True))
        rows[-1]["kill_to_all_s"] = _s(line.connected, killed)
        return rows
    finally:
        close(ctx, old + tasks, pool)


def burst(ctx: Context, kind: str, n: int) -> dict[str, Any]:
    """A running, empty fleet of three tasks; ``n`` ctl starts at once, from the harness."""
    tables = ctx.fresh_tables()
    pool = upstreams(ctx, n)
    t0, tasks = start_tasks(ctx, kind, "b", tables, TASKS)
    try:
        up = watch_connect(ctx, pool, {}, tasks, t0, 60, f"cold_start burst {kind} boot")
        if up.ready is None:
            raise RuntimeError(f"cold_start burst {kind}: the fleet never became ready")
        time.sleep(settle_s(ctx))
        ids = [f"n{i:05d}" for i in range(n)]
        urls = pool.urls(ids)
        sender = Burst(tables, urls, ctx.meter_thread.url if ctx.meter_keys and ctx.meter_thread else None)
        sender.start()
        line = watch_connect(ctx, pool, dict.fromkeys(ids, 0), tasks, time.monotonic(), 60 + n / 20,
                             f"cold_start burst {kind}")
        sender.join(60)
        if sender.error is not None:
            raise RuntimeError(f"cold_start burst {kind}: ctl starts failed: {sender.error!r}")
        # The clock of a burst starts at the first ctl start: the fleet was ready long before.
        line.started = line.ready = sender.first if sender.first is not None else line.started
        row = measure(ctx, "burst", kind, tables, pool, ids, tasks, line, True)
        row["start_to_all_s"] = None  # the processes started before the burst
        row["start_to_ready_s"] = _s(up.ready, t0)
        row["burst_send_s"] = _s(sender.last, sender.first)  # the harness's writes and hints (moto bounds it)
        row["last_start_to_all_s"] = _s(line.connected, sender.last)
        return row
    finally:
        close(ctx, tasks, pool)


class Burst(threading.Thread):
    """``fleetd ctl start`` of many ids in process: :func:`fleetd.items.start_update` then a START hint
    (:func:`fleetd.hints.start_body`), as ``ctl start`` writes them, ``BURST_CONCURRENCY`` at a time.
    Unlike a real ``ctl start`` the queue URL is looked up once, not once per start."""

    def __init__(self, tables: Tables, urls: dict[str, str], dynamodb_url: str | None = None) -> None:
        super().__init__(name="ctl-start-burst", daemon=True)
        self.tables = tables
        self.urls = urls
        self.dynamodb_url = dynamodb_url  # the metering proxy, when keys are metered
        self.first: float | None = None
        self.last: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._send())
        except BaseException as e:  # reported by the scenario
            self.error = e

    async def _send(self) -> None:
        aws = AwsConfig(connections_table=self.tables.connections, hints_queue=self.tables.queue)
        schemes = UpstreamConfig(allowed_schemes=("ws", "wss"))
        session = get_session()
        async with AsyncExitStack() as stack:
            ddb = await stack.enter_async_context(
                session.create_client("dynamodb", region_name=region_of(aws), config=client_config(aws),
                                      endpoint_url=self.dynamodb_url))
            sqs = await stack.enter_async_context(
                session.create_client("sqs", region_name=region_of(aws), config=client_config(aws)))
            queue_url = (await sqs.get_queue_url(QueueName=aws.hints_queue))["QueueUrl"]
            gate = asyncio.Semaphore(BURST_CONCURRENCY)

            async def start(cid: str, url: str) -> None:
                async with gate:
                    cid, url = validate_id(cid), validate_url(url, schemes)
                    await ddb.update_item(**items.start_update(aws.connections_table, cid, url,
                                                               int(time.time() * 1000)), ReturnValues="ALL_OLD")
                    await sqs.send_message(QueueUrl=queue_url, MessageBody=hints.start_body([cid]))

            self.first = time.monotonic()
            await asyncio.gather(*(start(cid, url) for cid, url in self.urls.items()))
            self.last = time.monotonic()


# ----- the scenario ------------------------------------------------------------------------------------

def run(ctx: Context) -> dict[str, Any]:
    sizes = SIZES[ctx.profile.name]
    rows: list[dict[str, Any]] = []
    for kind in SYSTEMS:
        for n in sizes.one_shard:
            rows.append(one_shard(ctx, kind, n))
        rows += three_tasks_and_restart(ctx, kind, sizes.fleet)
        rows.append(burst(ctx, kind, sizes.burst))
    return {"cases": rows, "rebalance_s": rebalance_s(ctx), "poll_s": POLL_S, "tasks": TASKS,
            "burst_concurrency": BURST_CONCURRENCY,
            "fleetd_timings": "fast profile" if ctx.profile.fast_timings else "product defaults",
            "metered": ctx.meter_keys, "throttle_keys": ctx.throttle_keys,
            "targets": {"one_shard_s": {str(k): v for k, v in TARGET_ONE_SHARD_S.items()},
                        "three_tasks_s": TARGET_THREE_TASKS_S, "share_pct": TARGET_SHARE_PCT}}
