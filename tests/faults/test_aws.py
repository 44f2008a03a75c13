"""AWS faults (issue #7): DynamoDB blackhole, throttling, ambiguous writes, SQS down, and
rebalancing hand-overs under lost answers and throttling.

Every scenario runs randomized trials — a few in CI, ``LONG_TRIALS`` with ``pytest
--long`` — against real ``fleetd shard`` processes.  Each shard talks to DynamoDB
through its own fault proxy (:class:`bench.faults.proxy.ProxyThread`), so a fault can
hit one shard (a partition) or all of them; SQS goes through one proxy per trial.

A trial: fresh tables and queue, 2–3 shards, 30–50 streams of the fake upstream at
``RATE`` msg/s, one seeded random fault, then

* liveness: every connection is attached again, owned by a live shard and writing
  seqs received after the fault (waited for, within ``LIVE_TIMEOUT_S``);
* the invariants of SPEC §6 by :func:`bench.audit.check` (no missing seqs, no double
  streaming: overlapping session write windows or two sockets on one stream);
* no shard died or exited unless the trial stopped it, every stopped one exited 0
  within its shutdown budget, and no log line is an error or carries a traceback;
* the worst recovery time (:func:`recovery_s`), from the reception times of the
  messages themselves.

The trial's seed is printed and recorded; ``FLEETD_FAULTS_SEED=N`` pins the base seed,
so a failing trial can be replayed (fault *timing* depends on the machine's speed).
Results go to ``$FLEETD_FAULTS_RESULTS`` through :func:`tests.faults.record.record`.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.audit import Verdict, check
from bench.faults.proxy import ProxyThread
from bench.procs import FleetdProc, UpstreamProc, ddb, scan_all, stop_all, wait_for
from bench.profile import fast
from fleetd.config import Config
from tests.faults.record import record
from tests.fleet import audit, owners, seed_items, start_shard

MODES = ("session", "item")
LONG_TRIALS = 20
CI_TRIALS = {"dynamodb_blackhole": 2, "throttling": 2, "ambiguous_writes": 2, "sqs_down": 2, "rebalancing": 2}
RATE = 4.0  # msg/s per stream
GAP_MS = 600  # a stream silent this long (2.4 frame periods; bursts come closer) was not being streamed
FAST = fast()  # the shards' timings (tests.fleet.start_shard)
TTL_S = FAST.lease.lease_ttl_s
MARGIN_MS = int(FAST.lease.safety_margin_s * 1000)
RECONCILE_S = FAST.lease.reconcile_s
BUDGET_S = FAST.runtime.shutdown_budget_s
EXIT_SLACK_S = 2.0  # interpreter start-up of the signal handler and teardown around the budget
LIVE_TIMEOUT_S = 45.0
THROTTLE_CODES = ("ProvisionedThroughputExceededException", "ThrottlingException")
# What an unhandled exception leaves in a shard's log (besides ERROR/CRITICAL records).
_BAD_WORDS = ("traceback", "unhandled", "never retrieved", "was destroyed", "exception ignored")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``trial`` = 0..N-1: N from ``CI_TRIALS``, or ``LONG_TRIALS`` under ``--long``."""
    if "trial" in metafunc.fixturenames:
        scenario = metafunc.function.__name__.removeprefix("test_")
        n = LONG_TRIALS if metafunc.config.getoption("--long") else CI_TRIALS[scenario]
        metafunc.parametrize("trial", range(n))


_BASE_SEED = os.environ.get("FLEETD_FAULTS_SEED") or str(random.SystemRandom().randrange(2**32))
_MODE_OFFSET = random.Random(_BASE_SEED).randrange(2)


def trial_seed(scenario: str, trial: int) -> int:
    return random.Random(f"{_BASE_SEED}:{scenario}:{trial}").randrange(2**32)


# ----- the fleet of one trial ------------------------------------------------------------------------

@dataclass
class ShardRun:
    """One ``fleetd shard`` process and the DynamoDB proxy in front of it."""

    task: str
    proc: FleetdProc
    ddb: ProxyThread
    stopped: bool = False  # the trial stopped or killed it: its exit is expected

    @property
    def exited(self) -> bool:
        return self.proc.proc.poll() is not None


@dataclass
class FaultReport:
    """When a scenario's fault began and ended (epoch s) and what it did."""

    start: float
    end: float
    extra: dict[str, Any] = field(default_factory=dict)
    stopped_at: float | None = None  # when the scenario last stopped or killed a shard, if it did
    moved: list[str] = field(default_factory=list)  # the connections that shard owned then
    teardown: float = 0.0  # when the trial began stopping every shard (set by the harness)


@dataclass
class Fleet:
    """A trial's world: tables, streams, shards and proxies; every fault goes through here."""

    cfg: Config
    log_dir: Path
    upstream: UpstreamProc
    ids: list[str]
    mode: str
    rng: random.Random
    sqs: ProxyThread
    env: dict[str, str] = field(default_factory=dict)
    shards: list[ShardRun] = field(default_factory=list)
    rules: list[tuple[str | None, str, float, dict[str, Any]]] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)
    _tasks: Iterator[int] = field(default_factory=itertools.count)

    def start(self) -> ShardRun:
        """A new shard (new task id) behind its own DynamoDB proxy, with the fleet's current faults."""
        px = ProxyThread(os.environ["AWS_ENDPOINT_URL_DYNAMODB"], seed=self.rng.randrange(2**32))
        px.start()
        for op, action, probability, params in self.rules:
            px.add(op, action, probability, **params)
        task = f"s{next(self._tasks)}"
        proc = start_shard(self.cfg, self.log_dir, 0, task=task, FLEETD_LEASE_MODE=self.mode,
                           AWS_ENDPOINT_URL_DYNAMODB=px.url, AWS_ENDPOINT_URL_SQS=self.sqs.url, **self.env)
        run = ShardRun(task, proc, px)
        self.shards.append(run)
        return run

    def live(self) -> list[ShardRun]:
        return [s for s in self.shards if not s.stopped]

    def busiest(self) -> tuple[ShardRun, list[str]]:
        """The live shard owning the most connections (ties broken at random), and those connections."""
        held = self.owned_by()
        victim = max(self.live(), key=lambda s: (len(held.get(s.task, [])), self.rng.random()))
        return victim, held.get(victim.task, [])

    def fault(self, op: str | None, action: str, probability: float = 1.0, **params: Any) -> None:
        """A DynamoDB fault on every shard, present and future."""
        self.rules.append((op, action, probability, params))
        for s in self.shards:
            s.ddb.add(op, action, probability, **params)

    def fired(self) -> int:
        """How many requests the DynamoDB faults have hit so far."""
        return sum(r.fired for s in self.shards for r in list(s.ddb.proxy.rules))

    def heal(self) -> float:
        """Every DynamoDB proxy transparent again; returns the moment (epoch s)."""
        self.rules.clear()
        for s in self.shards:
            s.ddb.clear()
        return time.time()

    def kill(self, shard: ShardRun) -> None:
        shard.stopped = True
        shard.proc.signal(signal.SIGKILL)
        self.stops.append({"task": shard.task, "signal": "SIGKILL"})

    def terminate(self, *shards: ShardRun) -> None:
        """SIGTERM them together and wait: each must exit 0 within its shutdown budget."""
        began = time.monotonic()
        for shard in shards:
            shard.stopped = True
            shard.proc.signal(signal.SIGTERM)
        waiting = list(shards)
        while waiting and time.monotonic() < began + BUDGET_S + 15:
            for shard in [s for s in waiting if s.exited]:
                waiting.remove(shard)
                self.stops.append({"task": shard.task, "signal": "SIGTERM", "code": shard.proc.proc.returncode,
                                   "seconds": round(time.monotonic() - began, 2)})
            time.sleep(0.05)
        self.stops += [{"task": s.task, "signal": "SIGTERM", "code": None, "seconds": None} for s in waiting]

    def owned_by(self) -> dict[str, list[str]]:
        """task → connection ids its sessions own now."""
        out: dict[str, list[str]] = {}
        for cid, owner in owners(self.cfg).items():
            if cid in self.ids and owner:
                out.setdefault(owner.split("/")[0], []).append(cid)
        return out

    def close(self) -> None:
        stop_all(*(s.proc for s in self.shards))
        for s in self.shards:
            s.ddb.stop()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamProc]:
    """One fake upstream for the module; every trial uses its own stream ids."""
    up = UpstreamProc(tmp_path_factory.mktemp("upstream"), rate=RATE)
    yield up
    up.stop()


@pytest.fixture
def sqs_proxy() -> Iterator[ProxyThread]:
    with ProxyThread(os.environ["AWS_ENDPOINT_URL_SQS"]) as px:
        yield px


def drop_tables(cfg: Config) -> None:
    """Keep dynalite's memory flat over a long run: a trial's tables go with it (unless FLEETD_FAULTS_KEEP=1)."""
    if os.environ.get("FLEETD_FAULTS_KEEP") == "1":
        print(f"  kept tables {cfg.aws.connections_table}, {cfg.aws.sessions_table}, {cfg.aws.messages_table}")
        return
    client = ddb()
    for table in (cfg.aws.connections_table, cfg.aws.sessions_table, cfg.aws.messages_table):
        try:
            client.delete_table(TableName=table)
        except Exception as e:  # a leftover table costs memory, not correctness
            print(f"could not delete {table}: {e}")


# ----- observations ----------------------------------------------------------------------------------

def latest_received_ms(cfg: Config, cid: str) -> int:
    resp = ddb().query(TableName=cfg.aws.messages_table, KeyConditionExpression="connection_id = :c",
                       ExpressionAttributeValues={":c": {"S": cid}}, ScanIndexForward=False, Limit=1,
                       ProjectionExpression="received_at_ms")
    items = resp.get("Items", [])
    return int(items[0]["received_at_ms"]["N"]) if items else 0


def not_streaming(fleet: Fleet, since_ms: int) -> list[str]:
    """Connections not yet attached, owned by a live shard and writing messages received after ``since_ms``."""
    crashed = [s.task for s in fleet.live() if s.exited]
    assert not crashed, f"shards died on their own: {crashed}"
    stats = fleet.upstream.stats()
    bad = [cid for cid in fleet.ids if stats.get(cid, {}).get("attached") != 1]
    if bad:
        return bad
    live = {s.task for s in fleet.live()}
    own = owners(fleet.cfg)
    bad = [cid for cid in fleet.ids if own.get(cid, "").split("/")[0] not in live]
    if bad:
        return bad
    return [cid for cid in fleet.ids if latest_received_ms(fleet.cfg, cid) <= since_ms]


def wait_streaming(fleet: Fleet, since: float, timeout_s: float = LIVE_TIMEOUT_S) -> float:
    """Wait until every connection streams again (:func:`not_streaming`); seconds since ``since``."""
    last: list[str] = []

    def done() -> bool:
        last[:] = not_streaming(fleet, int(since * 1000))
        return not last

    try:
        wait_for(done, timeout_s, 0.25, "every connection streaming again")
    except AssertionError as e:
        raise AssertionError(f"{e}; {len(last)} connections not streaming, e.g. {last[:5]}") from None
    return time.time() - since


Reception = tuple[int, str]  # (received_at_ms, session_id) of one message item


def reception_times(cfg: Config, ids: list[str]) -> dict[str, list[Reception]]:
    """connection → its message items' receptions, in time order."""
    wanted = set(ids)
    out: dict[str, list[Reception]] = {cid: [] for cid in ids}
    for item in scan_all(cfg.aws.messages_table, ProjectionExpression="connection_id, received_at_ms, session_id"):
        cid = item["connection_id"]["S"]
        if cid in wanted:
            out[cid].append((int(item["received_at_ms"]["N"]), item["session_id"]["S"]))
    for times in out.values():
        times.sort()
    return out


def silences(times: dict[str, list[Reception]], since: float, until: float) -> Iterator[tuple[str, Reception,
                                                                                              Reception]]:
    """(connection, reception before, reception after) of each silence longer than ``GAP_MS`` that
    ended after ``since`` and before ``until`` (epoch s; until = the trial's own final stop)."""
    since_ms, until_ms = since * 1000, until * 1000
    for cid, ts in times.items():
        for a, b in itertools.pairwise(ts):
            if b[0] - a[0] > GAP_MS and since_ms < b[0] <= until_ms:
                yield cid, a, b


def recovery_s(times: dict[str, list[Reception]], since: float, until: float) -> float:
    """Worst, over connections, of how long after ``since`` (epoch s) each was streaming again.

    A connection streams again at the end of its last :func:`silences` after ``since``; one
    streaming throughout counts 0.  A replay after a resume rewrites the replayed items'
    reception times, which can only lengthen a silence, never end it later.
    """
    ends = [b[0] for _, _, b in silences(times, since, until)]
    return round(max((b - since * 1000 for b in ends), default=0.0) / 1000, 3)


def handover_s(times: dict[str, list[Reception]], since: float, until: float, ids: list[str]) -> float:
    """Worst, over ``ids`` (a stopped shard's connections), of when each streamed again after ``since``.

    Only each connection's first silence ending after the stop counts (0 if it never went
    silent for ``GAP_MS``): later, unrelated silences are :func:`recovery_s`'s business.
    """
    wanted = {cid: times.get(cid, []) for cid in ids}
    firsts: dict[str, int] = {}
    for cid, _, b in silences(wanted, since, until):
        firsts.setdefault(cid, b[0])  # a connection's silences come in time order
    return round(max((b - since * 1000 for b in firsts.values()), default=0.0) / 1000, 3)


def slowest(times: dict[str, list[Reception]], since: float, until: float) -> dict[str, Any] | None:
    """The silence that ended last after ``since``: which connection, when, between which sessions."""
    worst = max(silences(times, since, until), key=lambda t: t[2][0], default=None)
    if worst is None:
        return None
    cid, a, b = worst
    return {"connection": cid, "silent_from_s": round(a[0] / 1000 - since, 2),
            "back_at_s": round(b[0] / 1000 - since, 2), "sessions": [a[1], b[1]]}


def log_problems(shards: list[ShardRun]) -> list[str]:
    """Error records and traceback residue in the shards' logs (warnings are expected under faults)."""
    found = []
    for s in shards:
        for rec in s.proc.logs():
            text = str(rec.get("raw", rec.get("event", ""))).lower()
            if rec.get("level") in ("ERROR", "CRITICAL") or "exc" in rec or any(w in text for w in _BAD_WORDS):
                found.append(f"{s.task}: {str(rec)[:300]}")
    return found


# ----- one trial -------------------------------------------------------------------------------------

Scenario = Callable[[Fleet], FaultReport]


@dataclass
class Outcome:
    verdict: Verdict
    recovery_s: float
    problems: list[str]  # error lines in the shards' logs
    failures: list[str] = field(default_factory=list)  # everything this trial got wrong (empty = passed)


Check = Callable[[FaultReport, Outcome], list[str]]


def no_more_checks(report: FaultReport, outcome: Outcome) -> list[str]:
    return []


def run_trial(scenario: str, trial: int, cfg: Config, log_dir: Path, upstream: UpstreamProc,
              sqs: ProxyThread, fault: Scenario, env: dict[str, str] | None = None,
              check_more: Check = no_more_checks, modes: tuple[str, ...] = MODES) -> Outcome:
    """Set up, inject ``fault``, check liveness, the invariants and ``check_more``; record the trial.

    The caller asserts ``not outcome.failures``; recording first lets a long run count every failure.
    """
    seed = trial_seed(scenario, trial)
    print(f"{scenario} trial {trial}: seed {seed} (FLEETD_FAULTS_SEED={_BASE_SEED})")
    rng = random.Random(seed)
    ids = [f"{scenario[:4]}{trial:02d}-{i:03d}" for i in range(rng.randint(30, 50))]
    mode = modes[(trial + _MODE_OFFSET) % len(modes)]  # consecutive trials alternate; a lone CI trial gets either
    env = {"FLEETD_MAX_CONNECTIONS_PER_SHARD": "100", **(env or {})}  # claim steps of 20: shards share the load
    fleet = Fleet(cfg, log_dir, upstream, ids, mode, rng, sqs, env)
    try:
        report, live_s = _exercise(fleet, fault, rng.randint(2, 3))
        outcome = _judge(fleet, report)
        outcome.failures = failures(fleet, outcome) + check_more(report, outcome)
    except Exception as e:
        record(scenario, trial, None, None, seed=seed, mode=fleet.mode, stops=fleet.stops,
               failure=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        fleet.close()
        drop_tables(cfg)
    record(scenario, trial, outcome.verdict, outcome.recovery_s, seed=seed, mode=fleet.mode,
           connections=len(ids), shards=len(fleet.shards), stops=fleet.stops, live_after_s=round(live_s, 3),
           log_problems=len(outcome.problems), failure="; ".join(outcome.failures)[:1000] or None, **report.extra)
    print(f"  mode {fleet.mode}, {len(ids)} connections, {len(fleet.shards)} shards; {report.extra}; "
          f"stops {fleet.stops}; recovery {outcome.recovery_s} s; {outcome.verdict.summary()}")
    return outcome


def _exercise(fleet: Fleet, fault: Scenario, n_shards: int) -> tuple[FaultReport, float]:
    seed_items(fleet.cfg, {cid: fleet.upstream.url(cid) for cid in fleet.ids})
    for _ in range(n_shards):
        fleet.start()
    wait_streaming(fleet, time.time() - 3600, timeout_s=40)
    time.sleep(fleet.rng.uniform(1.0, 3.0))
    report = fault(fleet)
    live_s = wait_streaming(fleet, report.end)
    time.sleep(2.0)  # some steady streaming after recovery, then a clean stop of all at once (no handovers)
    report.teardown = time.time()
    fleet.terminate(*fleet.live())
    return report, live_s


def _judge(fleet: Fleet, report: FaultReport) -> Outcome:
    stats = fleet.upstream.stats()
    verdict = check(audit(fleet.cfg, fleet.ids), {cid: stats[cid] for cid in fleet.ids}, MARGIN_MS)
    times = reception_times(fleet.cfg, fleet.ids)
    # Counted from the fault's start too: a partitioned shard's streams may be back on peers before the end.
    report.extra["back_after_start_s"] = recovery_s(times, report.start, report.teardown)
    if report.stopped_at is not None:  # how long the stopped shard's streams took to come back, under the fault
        report.extra["after_stop_s"] = handover_s(times, report.stopped_at, report.teardown, report.moved)
    report.extra["slowest"] = slowest(times, report.end, report.teardown)
    return Outcome(verdict, recovery_s(times, report.end, report.teardown), log_problems(fleet.shards))


def failures(fleet: Fleet, outcome: Outcome) -> list[str]:
    """What every scenario demands of every trial, as messages for what went wrong."""
    found = []
    if not outcome.verdict.ok:
        found.append(f"invariant violated: {outcome.verdict.summary()}")
    bad_stops = [s for s in fleet.stops
                 if s["signal"] == "SIGTERM" and (s["code"] != 0 or s["seconds"] > BUDGET_S + EXIT_SLACK_S)]
    if bad_stops:
        found.append(f"a SIGTERMed shard did not exit 0 within its budget: {bad_stops}")
    if outcome.problems:
        found.append("errors in shard logs:\n" + "\n".join(outcome.problems[:10]))
    return found


# ----- scenarios -------------------------------------------------------------------------------------

def blackhole(fleet: Fleet) -> FaultReport:
    """All DynamoDB calls of all shards, or of one (a partition), vanish for TTL + 1-3 s."""
    rng = fleet.rng
    victims = fleet.live() if rng.random() < 0.5 else [fleet.busiest()[0]]
    reset_p = rng.choice([0.0, 0.0, rng.uniform(0.1, 0.5)])  # some calls fail fast instead of hanging
    duration = TTL_S + rng.uniform(1.0, 3.0)
    held = fleet.owned_by()
    fenced = [cid for s in victims for cid in held.get(s.task, [])]
    start = time.time()
    for s in victims:
        if reset_p:
            s.ddb.add(None, "reset", reset_p)
        s.ddb.add(None, "blackhole")
    fence_s = _wait_fenced(fleet, fenced, start)
    time.sleep(max(0.0, start + duration - time.time()))
    fired = fleet.fired()
    end = fleet.heal()
    return FaultReport(start, end, {"partitioned": len(victims), "of": len(fleet.live()), "reset_p": round(reset_p, 2),
                                    "duration_s": round(duration, 2), "fence_s": round(fence_s, 3),
                                    "faults_fired": fired})


def _wait_fenced(fleet: Fleet, ids: list[str], since: float) -> float:
    """The partitioned shards' sockets must all close before their leases can expire (SPEC §3)."""
    def all_closed() -> bool:
        stats = fleet.upstream.stats()
        return all(stats[cid]["attached"] == 0 for cid in ids)

    wait_for(all_closed, TTL_S - (time.time() - since), 0.05, "self-fencing before the lease TTL")
    return time.time() - since


def test_dynamodb_blackhole(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                            sqs_proxy: ProxyThread) -> None:
    outcome = run_trial("dynamodb_blackhole", trial, cfg, tmp_path, upstream, sqs_proxy, blackhole)
    assert not outcome.failures, "\n".join(outcome.failures)


def throttling(fleet: Fleet, duration: float) -> FaultReport:
    """30 % of all DynamoDB calls throttled (both codes); one shard stopped or killed meanwhile."""
    rng = fleet.rng
    first = rng.uniform(0.1, 0.2)  # P(first code); the second rule takes 30 % overall
    code_a, code_b = rng.sample(THROTTLE_CODES, 2)
    start = time.time()
    fleet.fault(None, "throttle", first, code=code_a)
    fleet.fault(None, "throttle", (0.3 - first) / (1 - first), code=code_b)
    action = rng.choice(["none", "SIGTERM", "SIGKILL"])
    replace = rng.random() < 0.5
    stopped_at: float | None = None
    moved: list[str] = []
    if action != "none":
        time.sleep(rng.uniform(0.2, 0.6) * duration)
        victim, moved = fleet.busiest()
        stopped_at = time.time()
        if action == "SIGTERM":
            fleet.terminate(victim)
        else:
            fleet.kill(victim)
        if replace:
            fleet.start()  # boots, opens a session and claims while throttled
    time.sleep(max(0.0, start + duration - time.time()))
    calls = sum(sum(s.ddb.calls.values()) for s in fleet.shards)
    fired = fleet.fired()
    end = fleet.heal()
    return FaultReport(start, end, {"duration_s": round(duration, 1), "stop": action,
                                    "replaced": action != "none" and replace, "moved": len(moved), "ddb_calls": calls,
                                    "faults_fired": fired}, stopped_at, moved)


def test_throttling(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc, sqs_proxy: ProxyThread,
                    long_run: bool) -> None:
    duration = 60.0 if long_run else 15.0
    outcome = run_trial("throttling", trial, cfg, tmp_path, upstream, sqs_proxy, lambda f: throttling(f, duration))
    assert not outcome.failures, "\n".join(outcome.failures)


def ambiguous(fleet: Fleet) -> FaultReport:
    """Lost answers to applied writes (claims, renewals, releases, heartbeats) while shards come and go."""
    rng = fleet.rng
    p = rng.uniform(0.2, 0.4)
    ops = ["UpdateItem"] + (["PutItem"] if rng.random() < 0.5 else [])  # PutItem: session creation
    start = time.time()
    for op in ops:
        fleet.fault(op, "drop_response", p / 2, mode="500")
        fleet.fault(op, "drop_response", (p / 2) / (1 - p / 2), mode="reset")
    events = []
    stopped_at, moved = start, []
    for _ in range(rng.randint(2, 3)):
        time.sleep(rng.uniform(3.0, 6.0))
        victim = rng.choice(fleet.live())
        moved = fleet.owned_by().get(victim.task, [])
        stopped_at = time.time()
        if rng.random() < 0.5:
            fleet.terminate(victim)
            events.append("SIGTERM")
        else:
            fleet.kill(victim)
            events.append("SIGKILL")
        fleet.start()
    time.sleep(rng.uniform(TTL_S + 2, TTL_S + 4))  # killed sessions expire and are taken over, still faulted
    fired = fleet.fired()
    end = fleet.heal()
    return FaultReport(start, end, {"p": round(p, 2), "ops": ops, "events": events, "moved": len(moved),
                                    "faults_fired": fired}, stopped_at, moved)


def test_ambiguous_writes(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                          sqs_proxy: ProxyThread) -> None:
    outcome = run_trial("ambiguous_writes", trial, cfg, tmp_path, upstream, sqs_proxy, ambiguous)
    assert not outcome.failures, "\n".join(outcome.failures)


SQS_TTL_S = 20.0  # far above the reconcile bound: a takeover through expiry would show as ≥ 20 s
SQS_RECOVERY_BOUND_S = 2 * RECONCILE_S * 1.2 + 2.0  # two jittered reconcile rounds + close, flush, connect


def sqs_down(fleet: Fleet, action: str) -> FaultReport:
    """SQS has been down since before boot; a SIGTERMed shard's streams must reach peers by reconcile."""
    victim, moved = fleet.busiest()
    start = time.time()
    fleet.terminate(victim)
    return FaultReport(start, start, {"sqs": action, "moved": len(moved)})


def test_sqs_down(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc, sqs_proxy: ProxyThread) -> None:
    rng = random.Random(trial_seed("sqs_down", trial) ^ 0x5A5)
    action = rng.choice(["blackhole", "error500"])
    sqs_proxy.add(None, action)  # for the whole trial, boot included
    env = {"FLEETD_LEASE_TTL_S": str(SQS_TTL_S)}

    def by_reconcile(report: FaultReport, outcome: Outcome) -> list[str]:
        found = [] if sum(sqs_proxy.calls.values()) > 0 else ["the shards never even tried SQS"]
        if outcome.recovery_s > SQS_RECOVERY_BOUND_S:
            found.append(f"the stopped shard's streams came back after {outcome.recovery_s} s "
                         f"(> {SQS_RECOVERY_BOUND_S} s): not through reconcile")
        return found

    outcome = run_trial("sqs_down", trial, cfg, tmp_path, upstream, sqs_proxy, lambda f: sqs_down(f, action),
                        env=env, check_more=by_reconcile)
    print(f"  SQS {action}: {dict(sqs_proxy.calls)}")
    assert not outcome.failures, "\n".join(outcome.failures)


REBALANCE_S = 1.0  # every shard looks every second: hand-overs happen within the trial
# A look leaves out peers younger than 2 × heartbeat + 2 s (fleetd.shard: their `held` lags their claims).
SETTLE_S = 2 * FAST.lease.heartbeat_s + 2.0


def rebalancing(fleet: Fleet) -> FaultReport:
    """Empty shards join while UpdateItem answers get lost and calls are throttled: the others hand
    them streams (one conditional write each, whose outcome may be unknown), and the first newcomer
    may be killed or stopped just after it was handed its first streams, mid-adoption."""
    rng = fleet.rng
    lost, throttled = rng.uniform(0.1, 0.3), rng.uniform(0.05, 0.15)
    start = time.time()
    fleet.fault("UpdateItem", "drop_response", lost / 2, mode="500")
    fleet.fault("UpdateItem", "drop_response", (lost / 2) / (1 - lost / 2), mode="reset")
    fleet.fault(None, "throttle", throttled, code=rng.choice(THROTTLE_CODES))
    joined = [fleet.start() for _ in range(rng.randint(1, 2))]
    victim = joined[0]
    wait_for(lambda: fleet.owned_by().get(victim.task), SETTLE_S + 15, 0.05, "a hand-over to a newcomer")
    action = rng.choice(["none", "SIGKILL", "SIGTERM"])
    stopped_at: float | None = None
    moved: list[str] = []
    if action != "none":
        time.sleep(rng.uniform(0.0, 1.0))
        moved = fleet.owned_by().get(victim.task, [])
        stopped_at = time.time()
        if action == "SIGKILL":
            fleet.kill(victim)
        else:
            fleet.terminate(victim)
    time.sleep(rng.uniform(3.0, 5.0))
    fired = fleet.fired()
    end = fleet.heal()
    return FaultReport(start, end, {"lost_p": round(lost, 2), "throttled_p": round(throttled, 2),
                                    "joined": len(joined), "newcomer": action, "moved": len(moved),
                                    "faults_fired": fired}, stopped_at, moved)


def handed_over(fleet: Fleet) -> int:
    """Streams the trial's shards handed to a peer (their "streams handed to a peer" log lines)."""
    return sum(int(r.get("moved", 0)) for s in fleet.shards for r in s.proc.logs()
               if r.get("event") == "streams handed to a peer")


def test_rebalancing(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc, sqs_proxy: ProxyThread) -> None:
    fleets: list[Fleet] = []

    def keep(fleet: Fleet) -> FaultReport:
        fleets.append(fleet)
        return rebalancing(fleet)

    def some_handed(report: FaultReport, outcome: Outcome) -> list[str]:
        report.extra["handed"] = n = handed_over(fleets[0])
        return [] if n > 0 else ["no stream was handed over: the trial exercised nothing"]

    outcome = run_trial("rebalancing", trial, cfg, tmp_path, upstream, sqs_proxy, keep,
                        env={"FLEETD_REBALANCE_S": str(REBALANCE_S)}, check_more=some_handed, modes=("session",))
    assert not outcome.failures, "\n".join(outcome.failures)


# ----- the default session timings' tolerance (issue #14) ------------------------------------------------
# Session mode's defaults (TTL 6 s, heartbeat 1.5 s, margin 2 s) fence a session 4 s after its last
# successful renewal was sent.  These scenarios run the shards at those defaults (and the product's AWS
# timeout) and demand that DynamoDB answering every call 1 s late, losing 30 % of its answers, or stalling
# for 2 s at a time makes no shard give up its session.

PRODUCT = Config()
DEFAULT_TIMINGS = {"FLEETD_LEASE_TTL_S": str(PRODUCT.lease.lease_ttl_s),
                   "FLEETD_HEARTBEAT_S": str(PRODUCT.lease.heartbeat_s),
                   "FLEETD_SAFETY_MARGIN_S": str(PRODUCT.lease.safety_margin_s),
                   "FLEETD_AWS_TIMEOUT_S": str(PRODUCT.aws.aws_timeout_s)}
CI_TRIALS.update({"one_second_latency": 1, "lost_answers": 1, "stalls": 1})
STALL_S = 2.0


def given_up(fleet: Fleet) -> list[str]:
    """Shards that gave a session up: opened more than one, fenced themselves, or lost one."""
    found = []
    for s in fleet.shards:
        events = [str(r.get("event", "")) for r in s.proc.logs()]
        opened = events.count("session opened")
        fences = [e for e in events if e.startswith("self-fencing") or e == "session lost"]
        if opened != 1 or fences:
            found.append(f"{s.task}: {opened} sessions opened, {fences[:3]}")
    return found


def hiccups(fleet: Fleet, kind: str, duration: float) -> FaultReport:
    """``kind`` on every shard's DynamoDB for ``duration``; then a TTL of calm before the sessions are judged."""
    start = time.time()
    if kind == "one_second_latency":
        fleet.fault(None, "latency", 1.0, seconds=1.0)
        time.sleep(duration)
    elif kind == "lost_answers":  # applied, then the answer lost: half as a 500, half as a reset connection
        fleet.fault(None, "drop_response", 0.15, mode="500")
        fleet.fault(None, "drop_response", 0.15 / 0.85, mode="reset")
        time.sleep(duration)
    else:  # stalls of STALL_S at random phases of the heartbeat, a little apart
        stalled = 0
        while time.time() < start + duration:
            time.sleep(fleet.rng.uniform(1.0, 3.0))
            fleet.fault(None, "stall", 1.0, until=time.time() + STALL_S)
            time.sleep(STALL_S)
            stalled += fleet.fired()
            fleet.heal()
    fired = stalled if kind == "stalls" else fleet.fired()
    end = fleet.heal()
    time.sleep(PRODUCT.lease.lease_ttl_s)  # a renewal the fault delayed has landed or failed by now
    return FaultReport(start, end, {"kind": kind, "duration_s": duration, "faults_fired": fired,
                                    "given_up": given_up(fleet)})


def _tolerance_trial(kind: str, trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                     sqs: ProxyThread, long_run: bool) -> None:
    duration = 40.0 if long_run else 12.0

    def kept_sessions(report: FaultReport, outcome: Outcome) -> list[str]:
        return [f"a session was given up under {kind}: {g}" for g in report.extra["given_up"]]

    outcome = run_trial(kind, trial, cfg, tmp_path, upstream, sqs, lambda f: hiccups(f, kind, duration),
                        env=DEFAULT_TIMINGS, check_more=kept_sessions, modes=("session",))
    assert not outcome.failures, "\n".join(outcome.failures)


def test_one_second_latency(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                            sqs_proxy: ProxyThread, long_run: bool) -> None:
    _tolerance_trial("one_second_latency", trial, cfg, tmp_path, upstream, sqs_proxy, long_run)


def test_lost_answers(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                      sqs_proxy: ProxyThread, long_run: bool) -> None:
    _tolerance_trial("lost_answers", trial, cfg, tmp_path, upstream, sqs_proxy, long_run)


def test_stalls(trial: int, cfg: Config, tmp_path: Path, upstream: UpstreamProc,
                sqs_proxy: ProxyThread, long_run: bool) -> None:
    _tolerance_trial("stalls", trial, cfg, tmp_path, upstream, sqs_proxy, long_run)
