"""Scenario ``failover``: three tasks share the connections; kill or stop one again and again.

fleetd: three ``fleetd run --shards 1`` tasks (separate supervisors and task ids);
events SIGTERM a task, SIGKILL a shard (its supervisor restarts it), SIGKILL a
whole task.  Baseline: three workers; events SIGTERM and SIGKILL a worker.  Each
trial picks the task holding the most streams, notes which streams it holds and
how many sockets each stream has seen so far, fires the event, and polls the fake
upstreams: a stream has *recovered* when a new socket is attached to it (resuming
with ``from_seq``).  Then the victim is restarted, the fleet settles, and the
affected streams are audited over the trial's seqs (:mod:`bench.audit`): missing
seqs, redelivered frames, and overlapping writers (double streaming).  At the end
the whole messages table is audited once more, with every stream's
``max_concurrent`` (never two sockets on one stream at once).

The systems talk to dynalite directly unless the run meters keys (``--meter-keys``, implied by
``--throttle-keys``): then through the metering proxy, and each trial reports the hottest key's busiest
second from the event until the last stream recovered (:meth:`bench.common.Context.hot_keys`).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.audit import Audit, check, windows
from bench.common import FAST_BASELINE, FAST_FLEETD, Context, UpstreamPool, seed, wait_attached
from bench.meter import CpuWatch
from bench.procs import ddb, owners
from bench.sut import System, Tables, baseline_worker, fleetd_task, kill_tree, live_sessions

TASKS = 3
EVENTS = {"fleetd": ("sigterm_task", "sigkill_shard", "sigkill_task"), "baseline": ("sigterm_task", "sigkill_task")}
RECOVERY_TIMEOUT_S = {"sigterm_task": 90.0, "sigkill_shard": 90.0, "sigkill_task": 150.0}
# fleetd rebalances every `rebalance_s` (30 s by default).  Trials follow each other within seconds, so
# its tasks look every 5 s here, and each trial waits until no task holds over 1.2 × its share, as a
# deploy that pauses between tasks would see (a fleet it restarted, balanced again).
REBALANCE_S = "5"
BALANCED = 1.2
BALANCE_TIMEOUT_S = 60.0


@dataclass
class Fleet:
    kind: str
    tables: Tables
    pool: UpstreamPool
    ids: list[str]
    systems: dict[str, System]

    def holdings(self) -> dict[str, list[str]]:
        """task id → connection ids its sessions own (lease_owner is ``<task>/…``)."""
        out: dict[str, list[str]] = {t: [] for t in self.systems}
        for cid, owner in owners(self.tables.connections).items():
            task = owner.split("/", 1)[0]
            if task in out:
                out[task].append(cid)
        return out


def run(ctx: Context, systems: tuple[str, ...] = tuple(EVENTS)) -> dict[str, Any]:
    return {kind: run_system(ctx, kind) for kind in systems}


def run_system(ctx: Context, kind: str) -> dict[str, Any]:
    made_by = commit()  # now: the checkout may move on while an hour of trials runs
    fleet = start_fleet(ctx, kind)
    trials: list[dict[str, Any]] = []
    try:
        for event in EVENTS[kind]:
            for i in range(ctx.profile.failover_trials):
                trial = run_trial(ctx, fleet, event)
                trials.append(trial)
                ctx.progress(f"failover {kind} {event} #{i + 1}: {trial['affected']} streams, recovered "
                             f"max {trial['recovery_max_s']} s, missing {trial['missing_seqs']}, "
                             f"double {trial['double_streaming']}")
        final = final_audit(ctx, fleet)
    finally:
        for system in fleet.systems.values():
            ctx.stop(system)
        for p in fleet.pool.procs:
            ctx.stop(p)
    return {"trials": trials, "final_audit": final, "summary": summarize(trials, EVENTS[kind]),
            "metered": ctx.meter_keys, "throttle_keys": ctx.throttle_keys,
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": made_by}


def commit() -> str:
    """The checkout's commit (results kept from an earlier run say which code made them)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def start_fleet(ctx: Context, kind: str) -> Fleet:
    tables = ctx.fresh_tables()
    n = ctx.profile.failover_connections
    pool = ctx.upstreams(2, ctx.profile.failover_rate, size=120)
    ids = seed(tables, pool, n)
    if ctx.meter_keys:
        ctx.prime_meter(tables)
    fleet = Fleet(kind, tables, pool, ids, {})
    for t in range(TASKS):
        task = f"task{t}"
        fleet.systems[task] = start_task(ctx, fleet, task)
    connected, best = wait_attached(pool, n, 120 + n / 20, ctx.progress, f"failover {kind} start")
    if connected is None:
        raise RuntimeError(f"failover {kind}: only {best}/{n} streams connected at start")
    ctx.progress(f"failover {kind}: {n} streams on {TASKS} tasks in {connected:.1f} s")
    return fleet


def start_task(ctx: Context, fleet: Fleet, task: str) -> System:
    n = ctx.profile.failover_connections
    if fleet.kind == "fleetd":
        timings = FAST_FLEETD if ctx.profile.fast_timings else {}
        system, _ = fleetd_task(task, 1, fleet.tables, ctx.logs, ctx.sut_env(metered=ctx.meter_keys),
                                FLEETD_MAX_CONNECTIONS_PER_SHARD=str(n), FLEETD_REBALANCE_S=REBALANCE_S,
                                **timings)
    else:
        extra = FAST_BASELINE if ctx.profile.fast_timings else ()
        system, _ = baseline_worker(task, fleet.tables, ctx.logs, ctx.sut_env(metered=ctx.meter_keys), *extra)
    return ctx.started(system)


def run_trial(ctx: Context, fleet: Fleet, event: str) -> dict[str, Any]:
    holdings = fleet.holdings()
    victim = max(holdings, key=lambda t: len(holdings[t]))
    affected = holdings[victim]
    streams = fleet.pool.streams()
    before = {cid: int(streams[cid]["connections"]) for cid in affected}
    floor = {cid: max(1, int(streams[cid]["produced"]) - 20) for cid in affected}
    watch = CpuWatch(cpu_groups(ctx, fleet, victim))
    t0 = time.monotonic()
    fire(fleet, victim, event)
    recovered = wait_recovered(fleet.pool, before, RECOVERY_TIMEOUT_S[event], watch.poll)
    times = sorted(t - t0 for t in recovered.values())
    hot = ctx.hot_keys(t0, time.monotonic(), fleet.tables) if ctx.meter_keys else None
    writes = ctx.writes_per_stream(t0, time.monotonic(), fleet.tables, affected) if ctx.meter_keys else None
    restart(ctx, fleet, victim, event)
    settle(ctx, fleet)
    verdict = check(audit_range(fleet.tables, floor), fleet.pool.streams(), margin_ms=2000)
    return {
        "event": event, "victim": victim, "affected": len(affected), "recovered": len(recovered),
        "recovery_p50_s": _q(times, 0.5), "recovery_p99_s": _q(times, 0.99),
        "recovery_max_s": round(times[-1], 3) if times else None,
        "missing_seqs": verdict.missing_seqs, "double_streaming": len(verdict.overlaps),
        "recovery_times_s": [round(t, 3) for t in times], "cpu_cores": watch.cores(),
        **({"hot_keys": hot} if hot is not None else {}),
        **({"writes_per_stream": writes} if writes is not None else {}),
    }


def cpu_groups(ctx: Context, fleet: Fleet, victim: str) -> dict[str, list[int]]:
    """Whose CPU a trial's recovery window is split into (the profile of a handover)."""
    servers = ctx.stack.pids() if ctx.stack is not None else {}
    return {"dynalite": [servers["dynalite"]] if "dynalite" in servers else [],
            "moto (SQS)": [servers["moto"]] if "moto" in servers else [],
            "victim": [fleet.systems[victim].pid],
            "peers": [s.pid for task, s in fleet.systems.items() if task != victim],
            "upstreams": [p.proc.pid for p in fleet.pool.procs]}


def fire(fleet: Fleet, victim: str, event: str) -> None:
    system = fleet.systems[victim]
    if event == "sigterm_task":
        system.signal(signal.SIGTERM)
    elif event == "sigkill_task":
        kill_tree(system)
    else:  # sigkill_shard: the shard process of the victim's live session
        pids = [s["pid"] for s in live_sessions(fleet.tables.sessions, victim).values() if s["pid"]]
        if not pids:
            raise RuntimeError(f"no live session of {victim}")
        os.kill(pids[0], signal.SIGKILL)


def wait_recovered(pool: UpstreamPool, before: dict[str, int], timeout_s: float,
                   tick: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Monotonic time at which each stream got a new socket attached (polled every 0.1 s; ``tick`` each poll)."""
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(before) and time.monotonic() < deadline:
        streams = pool.streams()
        now = time.monotonic()
        tick()
        for cid, seen in before.items():
            s = streams[cid]
            if cid not in done and int(s["connections"]) > seen and int(s["attached"]) > 0:
                done[cid] = now
        time.sleep(0.1)
    return done


def restart(ctx: Context, fleet: Fleet, victim: str, event: str) -> None:
    system = fleet.systems[victim]
    if event == "sigkill_shard":
        return  # its supervisor restarts the shard
    if system.alive():
        system.wait(60)
    ctx.stop(system)
    fleet.systems[victim] = start_task(ctx, fleet, victim)


def settle(ctx: Context, fleet: Fleet) -> None:
    """Every stream attached again and a little more, so the next trial starts from a calm fleet; for
    fleetd, also balanced again (it rebalances; the baseline has no way to)."""
    wait_attached(fleet.pool, len(fleet.ids), 120, ctx.progress, f"failover {fleet.kind} settle")
    if fleet.kind == "fleetd":
        wait_balanced(ctx, fleet)
    time.sleep(2.0)


def wait_balanced(ctx: Context, fleet: Fleet) -> None:
    """Until no task holds more than ``BALANCED`` × its share (bounded: a trial then starts unbalanced)."""
    limit = BALANCED * len(fleet.ids) / TASKS
    deadline = time.monotonic() + BALANCE_TIMEOUT_S
    while time.monotonic() < deadline:
        counts = {task: len(ids) for task, ids in fleet.holdings().items()}
        if max(counts.values()) <= limit:
            return
        time.sleep(1.0)
    ctx.progress(f"failover {fleet.kind}: not balanced after {BALANCE_TIMEOUT_S:.0f} s: {counts}")


def audit_range(tables: Tables, floor: dict[str, int]) -> Audit:
    """The affected streams' message items from ``floor[cid]`` on (one Query per stream, in parallel)."""
    client = ddb()

    def one(cid: str) -> tuple[str, list[dict[str, Any]]]:
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "TableName": tables.messages, "KeyConditionExpression": "connection_id = :c AND seq >= :f",
            "ExpressionAttributeValues": {":c": {"S": cid}, ":f": {"N": str(floor[cid])}},
            "ProjectionExpression": "seq, session_id, received_at_ms", "ConsistentRead": True}
        while True:
            resp = client.query(**kwargs)
            items += resp.get("Items", [])
            if "LastEvaluatedKey" not in resp:
                return cid, items
            kwargs["ExclusiveStartKey"] = resp["LastEvaluatedKey"]

    seqs: dict[str, set[int]] = {}
    writers: dict[str, dict[str, tuple[int, int]]] = {}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for cid, items in pool.map(one, list(floor)):
            # Shift seqs so the audit's "1..top" range starts at the floor.
            rows = [(int(i["seq"]["N"]) - floor[cid] + 1, i["session_id"]["S"], int(i["received_at_ms"]["N"]))
                    for i in items]
            seqs[cid] = {seq for seq, _, _ in rows}
            writers[cid] = windows(rows)
    return Audit(seqs, writers)


def final_audit(ctx: Context, fleet: Fleet) -> dict[str, Any]:
    from bench.audit import audit

    ctx.progress(f"failover {fleet.kind}: final audit of the messages table")
    verdict = check(audit(fleet.tables.messages, fleet.ids), fleet.pool.streams(), margin_ms=2000)
    return verdict.summary()


def summarize(trials: list[dict[str, Any]], events: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for event in events:
        rows = [t for t in trials if t["event"] == event]
        times = sorted(x for t in rows for x in t["recovery_times_s"])
        out[event] = {
            "trials": len(rows), "streams": sum(t["affected"] for t in rows),
            "unrecovered": sum(t["affected"] - t["recovered"] for t in rows),
            "p50_s": _q(times, 0.5), "p99_s": _q(times, 0.99), "max_s": times[-1] if times else None,
            "trial_max_s": [t["recovery_max_s"] for t in rows],
            "missing_seqs": sum(t["missing_seqs"] for t in rows),
            "double_streaming": sum(t["double_streaming"] for t in rows),
            "cpu_cores": _mean_cores([t["cpu_cores"] for t in rows if "cpu_cores" in t]),
        }
        hot = [t["hot_keys"] for t in rows if "hot_keys" in t]
        if hot:
            out[event]["hot_keys"] = hottest(hot)
        writes = [t["writes_per_stream"] for t in rows if t.get("writes_per_stream", {}).get("streams")]
        if writes:
            streams = sum(w["streams"] for w in writes)
            out[event]["writes_per_stream"] = {
                "mean": round(sum(w["mean"] * w["streams"] for w in writes) / streams, 3),
                "max": max(w["max"] for w in writes)}
    return out


def hottest(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over several windows' :meth:`~bench.common.Context.hot_keys`: the busiest second of writes and of
    reads, and every throttled request."""
    def top(kind: str) -> dict[str, Any] | None:
        return max((w[kind] for w in windows if w[kind]), key=lambda p: float(p["units_per_s"]), default=None)

    return {"writes": top("writes"), "reads": top("reads"), "throttled": sum(w["throttled"] for w in windows)}


def _mean_cores(per_trial: list[dict[str, float]]) -> dict[str, float]:
    groups = dict.fromkeys(g for cores in per_trial for g in cores)
    return {g: round(sum(c.get(g, 0.0) for c in per_trial) / len(per_trial), 2) for g in groups}


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)
