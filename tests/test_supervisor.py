"""``fleetd run`` as a real process tree: shards, crash recovery, graceful stop, boot errors.

Each integration test starts ``python -m fleetd run`` against the local stack and a
fake upstream subprocess, sends it real signals, and judges the result from the
supervisor's ``/metrics``, the upstream's statistics and the DynamoDB tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd import config, exits
from fleetd.burial import announce_dead
from fleetd.config import Config
from fleetd.devstack import DevStack, spawn, terminate
from fleetd.metrics import scrape
from fleetd.shard.reconcile import BOOT_GATHER_S
from fleetd.supervisor import reap_orphans, usable_cpus
from tests import fleet
from tests.fleet import UpstreamProc, scan_all, seed_items

CONNECTIONS = 200
_METRICS_LINE = re.compile(r"metrics listening on (http://[0-9.]+:[0-9]+)")


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    return fleet.wait_for(predicate, timeout_s, interval_s, what)


class Run:
    """One ``fleetd run`` process tree with its log (stdout and stderr together)."""

    def __init__(self, cfg: Config, log_path: Path, *args: str, prefix: tuple[str, ...] = (), **env: str) -> None:
        """``cfg`` on the fast profile (:func:`tests.fleet.fleetd_env`), then ``env``."""
        self.log_path = log_path
        full_env = fleet.fleetd_env(cfg, FLEETD_ALLOWED_SCHEMES="ws,wss", **env)
        self.proc = spawn([*prefix, sys.executable, "-m", "fleetd", "run", "--metrics-addr", "127.0.0.1:0", *args],
                          log_path, env=full_env)
        self.started = time.monotonic()
        self.seen_pids: set[int] = {self.proc.pid}
        self.url = wait_for("the metrics endpoint", self._metrics_url, 30)

    def _metrics_url(self) -> str | None:
        assert self.proc.poll() is None, f"fleetd run exited with {self.proc.returncode}:\n{self.text()}"
        found = _METRICS_LINE.search(self.text())
        return found.group(1) if found else None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def shard_pids(self) -> dict[int, int]:
        """Latest pid per shard index, from the supervisor's "shard started" lines."""
        pids = {int(e["shard"]): int(e["pid"]) for e in self.events()
                if e.get("event") == "shard started" and e.get("logger") == "fleetd.supervisor"}
        self.seen_pids |= set(pids.values())
        return pids

    def remember_tree(self) -> None:
        """Record every process of the tree now, to prove later that none is left behind."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen_pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            return list(scrape(resp.read().decode()))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(v for n, lab, v in self.metrics() if n == name and labels.items() <= lab.items())

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def stop(self) -> None:
        self.remember_tree()
        terminate(self.proc, timeout_s=20)


def no_strays(pids: set[int]) -> bool:
    """None of ``pids`` is left (the forkserver and resource tracker exit just after the supervisor)."""
    deadline = time.monotonic() + 5
    while alive(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pids: set[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture
def upstream(stack: DevStack, tmp_path: Path) -> Iterator[UpstreamProc]:
    up = UpstreamProc(tmp_path, rate=2.0, size=120)
    yield up
    up.stop()


def send_hints(cfg: Config, ids: list[str]) -> None:
    sqs = boto3.client("sqs")
    url = sqs.get_queue_url(QueueName=cfg.aws.hints_queue)["QueueUrl"]
    for i in range(0, len(ids), 10):
        sqs.send_message_batch(QueueUrl=url, Entries=[
            {"Id": str(j), "MessageBody": json.dumps({"type": "START", "connection_id": cid})}
            for j, cid in enumerate(ids[i:i + 10])])


def start_connections(cfg: Config, upstream: UpstreamProc, count: int) -> list[str]:
    ids = [f"conn-{i:04d}" for i in range(count)]
    seed_items(cfg, {cid: upstream.url(cid) for cid in ids})
    send_hints(cfg, ids)
    return ids


def items(cfg: Config) -> dict[str, dict[str, Any]]:
    return {i["connection_id"]["S"]: i for i in scan_all(cfg.aws.connections_table, ConsistentRead=True)}


def session_of_pid(cfg: Config, pid: int) -> str:
    for s in scan_all(cfg.aws.sessions_table, ConsistentRead=True):
        if int(s["pid"]["N"]) == pid and int(s["expires_at_ms"]["N"]) > time.time() * 1000:
            return str(s["session_id"]["S"])
    raise AssertionError(f"no live session for pid {pid}")


def missing_seqs(cfg: Config) -> dict[str, list[int]]:
    """Per connection, seqs absent between the first and the last one written."""
    seqs: dict[str, set[int]] = {}
    for item in scan_all(cfg.aws.messages_table):
        seqs.setdefault(item["connection_id"]["S"], set()).add(int(item["seq"]["N"]))
    return {cid: gaps for cid, got in seqs.items()
            if (gaps := [s for s in range(min(got), max(got) + 1) if s not in got])}


def all_held(run: Run, count: int) -> bool:
    return run.value("fleetd_task_active_connections") == count


def test_run_recovers_a_killed_shard_and_hands_over_on_sigterm(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    ids = start_connections(cfg, upstream, CONNECTIONS)
    run = Run(cfg, tmp_path / "run1.log", "--shards", "2", FLEETD_CLOUDWATCH_MODE="emf", FLEETD_CLOUDWATCH_S="2")
    second: Run | None = None
    try:
        check_steady_state(run)
        check_emf_line(run)
        check_shard_kill_recovery(cfg, run, upstream, ids)
        sigterm_at = check_graceful_stop(cfg, run)
        second = Run(cfg, tmp_path / "run2.log", "--shards", "2")
        took = wait_for("the second run to hold everything", lambda: all_held(second, CONNECTIONS), 30)
        now = time.monotonic()
        print(f"\nsecond run holds all {CONNECTIONS} {now - second.started:.2f} s after its start, "
              f"{now - sigterm_at:.2f} s after the first run's SIGTERM "
              f"(hint claims {second.value('fleetd_hint_claims_total'):.0f}, "
              f"reconcile claims {second.value('fleetd_reconcile_claims_total'):.0f})")
        assert took
        streamed_again(upstream, ids, {k: v["sent"] for k, v in upstream.stats().items()}, 20)
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(15) == exits.OK
        assert not missing_seqs(cfg), "seqs missing in the messages table"
        assert {cid for cid, it in items(cfg).items() if it.get("lease_owner", {}).get("S")} == set()
    finally:
        for r in (run, second):
            if r is not None:
                r.stop()
    assert no_strays(run.seen_pids | (second.seen_pids if second else set())), "stray processes"


def check_steady_state(run: Run) -> None:
    wait_for("200 connections held", lambda: all_held(run, CONNECTIONS), 30)
    per_shard = {lab["shard"]: v for n, lab, v in run.metrics() if n == "fleetd_active_connections"}
    assert set(per_shard) == {"0", "1"} and all(v > 0 for v in per_shard.values()), per_shard
    assert sum(per_shard.values()) == CONNECTIONS
    wait_for("/readyz 200", lambda: run.status("/readyz") == 200, 10)
    assert run.status("/healthz") == 200
    assert len(run.shard_pids()) == 2
    run.remember_tree()
    time.sleep(3)  # messages flow and get checkpointed, so the crash below has something to resume


def check_emf_line(run: Run) -> None:
    def emf() -> dict[str, Any] | None:
        lines = [e for e in run.events() if "_aws" in e and e.get("ActiveConnections") == CONNECTIONS]
        return lines[-1] if lines else None

    record = wait_for("an EMF line with ActiveConnections", emf, 10)
    assert record["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "WsFleet"


def check_shard_kill_recovery(cfg: Config, run: Run, upstream: UpstreamProc, ids: list[str]) -> None:
    pid = run.shard_pids()[1]
    session = session_of_pid(cfg, pid)
    affected = [cid for cid, it in items(cfg).items() if it.get("lease_owner", {}).get("S") == session]
    assert affected, "shard 1 held nothing"
    stats = upstream.stats()
    before = {cid: stats[cid]["connections"] for cid in affected}
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def resumed() -> bool:
        stats = upstream.stats()
        return all(stats[cid]["connections"] > before[cid] and stats[cid]["attached"] >= 1 for cid in affected)

    wait_for("the dead shard's streams to reconnect", resumed, 15, interval_s=0.05)
    reconnected_s = time.monotonic() - killed_at
    wait_for("200 held again", lambda: all_held(run, CONNECTIONS), 15, interval_s=0.05)
    held_s = time.monotonic() - killed_at
    sent = {k: v["sent"] for k, v in upstream.stats().items()}
    streamed_again(upstream, affected, sent, 10)
    flowing_s = time.monotonic() - killed_at
    print(f"\nshard kill ({len(affected)} streams): reconnected {reconnected_s:.2f} s, "
          f"all held in /metrics {held_s:.2f} s, messages flowing {flowing_s:.2f} s")
    assert reconnected_s <= 10
    assert run.value("fleetd_shard_restarts_total") == 1
    assert run.value("fleetd_shard_restarts_total", shard="1") == 1
    new_pid = run.shard_pids()[1]
    assert new_pid != pid
    run.remember_tree()


def streamed_again(upstream: UpstreamProc, ids: list[str], sent_before: dict[str, int], timeout_s: float) -> None:
    """Every id was sent more frames since ``sent_before``: someone is streaming it."""
    wait_for("messages to flow", lambda: all(
        upstream.stats()[cid]["sent"] > sent_before.get(cid, 0) for cid in ids), timeout_s, interval_s=0.1)


def check_graceful_stop(cfg: Config, run: Run) -> float:
    """SIGTERM → exit 0 within the budget, every lease released; returns when SIGTERM was sent."""
    time.sleep(3)  # let checkpoints and sink writes of the new shard settle into the steady state
    run.remember_tree()
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code = run.proc.wait(cfg.runtime.shutdown_budget_s + 5)  # the test's budget is 8 s (+2 s kill grace)
    print(f"\nSIGTERM → fleetd run exited {code} in {time.monotonic() - t0:.2f} s")
    assert code == exits.OK, run.text()[-3000:]
    assert time.monotonic() - t0 <= 8 + 2 + 1
    owned = [cid for cid, it in items(cfg).items() if it.get("lease_owner", {}).get("S")]
    assert owned == [], f"{len(owned)} items still owned after a graceful stop"
    assert no_strays(run.seen_pids), "stray processes after SIGTERM"
    return t0


def test_a_shard_held_back_by_its_backoff_leaves_its_streams_to_a_peer_at_once(
        cfg: Config, upstream: UpstreamProc, tmp_path: Path) -> None:
    """Killed three times in a row, a shard's restart waits 2 s (crash-loop backoff): its supervisor
    tells the peers, and one with a 30 s reconcile takes its streams within seconds, before it."""
    start_connections(cfg, upstream, 40)
    run = Run(cfg, tmp_path / "run.log", "--shards", "1", FLEETD_REBALANCE_S="0")
    peer: fleet.FleetdProc | None = None
    try:
        wait_for("40 held by the task", lambda: all_held(run, 40), 30)
        peer = fleet.start_shard(cfg, tmp_path, 0, task="peer", FLEETD_RECONCILE_S="30", FLEETD_REBALANCE_S="0")
        wait_for("the peer's session", lambda: any(r.get("event") == "shard started" for r in peer.logs()), 20)
        # Past the peer's first reconcile round (after its boot gather): a round that ran right after the
        # first kill would rightly take the dead session's streams before the restarted shard could.
        time.sleep(BOOT_GATHER_S + 1.0)
        for kill in range(3):
            pid = run.shard_pids()[0]
            session = session_of_pid(cfg, pid)
            os.kill(pid, signal.SIGKILL)
            if kill < 2:  # restarted within a second, and claims its predecessor's streams back
                wait_for("the restarted shard", lambda: pid not in run.shard_pids().values(), 10)  # noqa: B023
                wait_for("40 held again", lambda: all_held(run, 40), 20)
        killed_at = time.monotonic()
        peers = wait_for("the peer to hold all 40", lambda: all(
            it.get("lease_owner", {}).get("S", "").startswith("peer/") for it in items(cfg).values()), 10, 0.05)
        took = time.monotonic() - killed_at
        print(f"\npeer took the dead shard's 40 streams {took:.2f} s after the third kill")
        assert peers
        assert any(r.get("event") == "dead session announced" for r in peer.logs())
        # Logged once the second wave is out, possibly after the peer took everything from the first.
        wait_for("the supervisor's announcement", lambda: any(
            e.get("event") == "dead session announced to peers" and e.get("session_id") == session
            for e in run.events()), 10)
        wait_for("every stream attached", lambda: all(s["attached"] == 1 for s in upstream.stats().values()), 20)
    finally:
        run.stop()
        if peer is not None:
            fleet.stop_all(peer)


LagBuckets = dict[tuple[str, str], float]  # (shard, le) → cumulative count


def lag_buckets(run: Run) -> LagBuckets:
    """The lag histogram's buckets from one scrape, checked: cumulative, +Inf equal to _count, _sum ≥ 0."""
    with urllib.request.urlopen(run.url + "/metrics", timeout=5) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    fam = families["fleetd_event_loop_lag_seconds"]
    assert fam.type == "histogram"
    buckets: dict[str, list[tuple[str, float]]] = {}
    totals: dict[tuple[str, str], float] = {}
    for sample in fam.samples:
        shard = sample.labels["shard"]
        if sample.name.endswith("_bucket"):
            buckets.setdefault(shard, []).append((sample.labels["le"], sample.value))
        else:
            totals[(shard, sample.name.rsplit("_", 1)[1])] = sample.value
    out: LagBuckets = {}
    for shard, series in buckets.items():
        counts = [n for _, n in series]
        assert counts == sorted(counts), f"shard {shard}: buckets not cumulative: {series}"
        assert series[-1] == ("+Inf", totals[(shard, "count")]) and totals[(shard, "sum")] >= 0
        out |= {(shard, le): n for le, n in series}
    return out


def test_event_loop_lag_histogram_grows_and_never_goes_backwards_across_a_shard_kill(
        cfg: Config, tmp_path: Path) -> None:
    """Each shard's probe adds about 4 samples a second to its series; a SIGKILLed shard's samples stay
    counted and its successor's add to them: no bucket of any scrape is below the previous scrape's."""
    run = Run(cfg, tmp_path / "run.log", "--shards", "2")
    seen: list[LagBuckets] = []

    def scrape_until(done: Callable[[LagBuckets], bool]) -> bool:
        seen.append(lag_buckets(run))
        if len(seen) > 1:
            went_back = {k: (seen[-2][k], n) for k, n in seen[-1].items() if n < seen[-2].get(k, 0.0)}
            assert not went_back, f"lag buckets went backwards: {went_back}"
        return done(seen[-1])

    try:
        wait_for("lag samples from both shards", lambda: scrape_until(
            lambda b: b[("0", "+Inf")] >= 8 and b[("1", "+Inf")] >= 8), 30, 0.25)
        pid = run.shard_pids()[1]
        before = seen[-1][("1", "+Inf")]
        os.kill(pid, signal.SIGKILL)
        wait_for("shard 1 restarted", lambda: scrape_until(lambda b: pid not in run.shard_pids().values()), 15, 0.1)
        wait_for("the successor's samples", lambda: scrape_until(lambda b: b[("1", "+Inf")] >= before + 8), 30, 0.25)
        assert run.value("fleetd_shard_restarts_total", shard="1") == 1
        first, last = seen[0], seen[-1]
        assert set(last) == set(first) and len({le for _, le in last}) == 12  # 11 bounds and +Inf, per shard
    finally:
        run.stop()


_DANGLING_POLL = """
import sys, boto3
sqs = boto3.client("sqs")
url = sqs.get_queue_url(QueueName=sys.argv[1])["QueueUrl"]
print("polling", flush=True)
sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=20, VisibilityTimeout=3)
"""


def test_dead_session_hints_reach_peers_past_dead_shards_open_polls(cfg: Config, tmp_path: Path) -> None:
    """A SIGKILLed shard leaves its SQS long poll open; SQS answers it with the first messages, which
    then stay hidden for its 3 s visibility timeout.  A crash loop leaves several such polls (here
    two): the announcement's later waves get through."""
    pollers = [spawn([sys.executable, "-c", _DANGLING_POLL, cfg.aws.hints_queue], tmp_path / f"poll{i}.log",
                     env=dict(os.environ)) for i in range(2)]
    try:
        for i in range(2):
            wait_for("the poll to be open", lambda: "polling" in (tmp_path / f"poll{i}.log").read_text(),  # noqa: B023
                     20)
        time.sleep(1.0)  # the requests are on the wire, waiting
        for poller in pollers:
            poller.kill()  # as SIGKILL leaves it: the server still holds the request
            poller.wait(5)
        sent_at = time.monotonic()
        announce_dead(cfg, "t/0/dead")
        sqs = boto3.client("sqs")
        url = sqs.get_queue_url(QueueName=cfg.aws.hints_queue)["QueueUrl"]
        got = wait_for("a DEAD_SESSION message", lambda: sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages"), 10, 0.0)
        took = time.monotonic() - sent_at
        print(f"\na peer received the announcement {took:.2f} s after it was sent")
        assert json.loads(got[0]["Body"]) == {"type": "DEAD_SESSION", "session_id": "t/0/dead"}
        assert took < 2.5, "only the messages hidden by the dead polls arrived (after their visibility timeout)"
    finally:
        for poller in pollers:
            terminate(poller, timeout_s=5)


def test_second_sigint_kills_at_once(cfg: Config, tmp_path: Path) -> None:
    run = Run(cfg, tmp_path / "run.log", "--shards", "2")
    try:
        wait_for("/readyz 200", lambda: run.status("/readyz") == 200, 30)
        run.remember_tree()
        os.kill(run.shard_pids()[0], signal.SIGSTOP)  # a shard that cannot finish its graceful shutdown
        run.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert run.proc.poll() is None, "must wait for the stuck shard"
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(5) == 128 + signal.SIGINT
    finally:
        run.stop()
    assert no_strays(run.seen_pids)


def test_straggler_is_killed_after_the_budget(cfg: Config, tmp_path: Path) -> None:
    run = Run(cfg, tmp_path / "run.log", "--shards", "2", FLEETD_SHUTDOWN_BUDGET_S="2")
    try:
        wait_for("/readyz 200", lambda: run.status("/readyz") == 200, 30)
        run.remember_tree()
        os.kill(run.shard_pids()[1], signal.SIGSTOP)
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = run.proc.wait(10)
        elapsed = time.monotonic() - t0
    finally:
        run.stop()
    assert code == 128 + signal.SIGTERM
    assert 2 + 2 - 0.5 <= elapsed <= 2 + 2 + 2, elapsed  # budget + kill grace
    assert no_strays(run.seen_pids)


def test_shards_follow_a_dead_supervisor(cfg: Config, tmp_path: Path) -> None:
    run = Run(cfg, tmp_path / "run.log", "--shards", "2")
    try:
        wait_for("/readyz 200", lambda: run.status("/readyz") == 200, 30)
        shards = set(run.shard_pids().values())
        run.remember_tree()
        run.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for("the orphaned shards to exit", lambda: not alive(shards), 8 + 2 + 2)
        print(f"\nshards exited {time.monotonic() - t0:.2f} s after their supervisor was killed")
        stopped = [e for e in run.events() if e.get("event") == "shard stopped"]
        assert len(stopped) == 2, "the shards shut down gracefully (leases released, session ended)"
    finally:
        run.stop()
    assert no_strays(run.seen_pids)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_as_pid_1_it_reaps_orphans_and_stops_on_sigterm(cfg: Config, tmp_path: Path) -> None:
    """In its own PID namespace the supervisor is PID 1: killing the forkserver orphans the shards to it."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace: {probe.stderr.decode().strip()}")
    run = Run(cfg, tmp_path / "run.log", "--shards", "2", prefix=("unshare", "--pid", "--fork"))
    try:
        wait_for("/readyz 200", lambda: run.status("/readyz") == 200, 30)
        supervisor = psutil.Process(run.proc.pid).children()[0]
        forkserver = next(p for p in supervisor.children() if "forkserver" in " ".join(p.cmdline()))
        forkserver.kill()  # its children (the shards) are re-parented to PID 1: the supervisor
        wait_for("both shards replaced", lambda: run.value("fleetd_shard_restarts_total") == 2, 10)
        wait_for("/readyz 200 again", lambda: run.status("/readyz") == 200, 15)

        def zombies() -> list[int]:
            return [p.pid for p in supervisor.children() if p.status() == psutil.STATUS_ZOMBIE]

        wait_for("no zombie children of PID 1", lambda: not zombies(), 5)
        run.remember_tree()
        supervisor.send_signal(signal.SIGTERM)
        assert run.proc.wait(15) == exits.OK
    finally:
        run.stop()
    assert no_strays(run.seen_pids)


def test_bad_config_exits_2_with_one_line(stack: DevStack, cfg: Config) -> None:
    env = {**os.environ, **config.as_env(cfg), "FLEETD_LEASE_TTL_S": "20", "FLEETD_HEARTBEAT_S": "30"}
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "fleetd", "run", "--shards", "2", "--metrics-addr", "127.0.0.1:0"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == exits.USAGE
    assert time.monotonic() - started < 10
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fleetd: error:") and "heartbeat_s" in lines[0], res.stderr
    assert "shard started" not in res.stdout + res.stderr


def test_missing_tables_halt_with_a_pointer_to_init(stack: DevStack, tmp_path: Path) -> None:
    prefix = f"never{uuid.uuid4().hex[:8]}"
    cfg = config.replace(config.load(env={}), connections_table=f"{prefix}-c", sessions_table=f"{prefix}-s",
                         messages_table=f"{prefix}-m", hints_queue=f"{prefix}-q")
    started = time.monotonic()
    run = Run(cfg, tmp_path / "run.log", "--shards", "2")
    try:
        code = run.proc.wait(20)
    finally:
        run.stop()
    elapsed = time.monotonic() - started
    print(f"\nmissing tables: supervisor halted with {code} after {elapsed:.2f} s")
    assert code == exits.BOOT_ERROR
    assert elapsed < 15
    last = run.text().strip().splitlines()[-1]
    assert last.startswith("fleetd: error: shard") and "fleetd init" in last, run.text()
    started_lines = [e for e in run.events() if e.get("event") == "shard started"
                     and e.get("logger") == "fleetd.supervisor"]
    assert len(started_lines) == 2, "a shard that cannot boot must not be restarted"
    assert no_strays(run.seen_pids)


def test_metrics_address_in_use_is_one_line(stack: DevStack, cfg: Config) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "fleetd", "run", "--metrics-addr", f"127.0.0.1:{port}"],
                             env={**os.environ, **config.as_env(cfg)}, capture_output=True, text=True, timeout=30)
    assert res.returncode == exits.USAGE
    assert res.stderr.strip().splitlines()[-1].startswith("fleetd: error: cannot serve metrics")


# ----- pure helpers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "expected"), [
    ("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1), ("garbage", None),
])
def test_usable_cpus_honours_the_cgroup_quota(tmp_path: Path, content: str, expected: int | None) -> None:
    cpus = len(os.sched_getaffinity(0))
    path = tmp_path / "cpu.max"
    path.write_text(content)
    assert usable_cpus(path) == (cpus if expected is None else min(cpus, expected))
    assert usable_cpus(tmp_path / "absent") == cpus


def test_reap_orphans_leaves_protected_children_alone() -> None:
    protected = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(protected.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert protected.pid not in reap_orphans({protected.pid})
    assert protected.wait(1) == 0  # its status was still there for its owner
    orphan = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(orphan.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert orphan.pid in reap_orphans(set())
    orphan.returncode = 0  # reaped behind Popen's back, as PID 1 reaps re-parented strays


def test_report_relay_keeps_only_the_latest_snapshot_and_flushes_on_close() -> None:
    import multiprocessing

    from fleetd.child import ReportRelay

    recv, send = multiprocessing.Pipe(duplex=False)
    relay = ReportRelay(send)
    for i in range(1000):  # far faster than one per second: most are superseded before being sent
        relay.offer({"n": i})
    relay.close(final={"boot_error": "table x does not exist: run `fleetd init`"})
    got = []
    while recv.poll(0.5):
        got.append(recv.recv())
    assert got[-1] == {"boot_error": "table x does not exist: run `fleetd init`"}
    numbers = [m["n"] for m in got[:-1]]
    assert numbers == sorted(numbers) and numbers[-1] == 999
