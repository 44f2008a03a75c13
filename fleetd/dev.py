"""``fleetd dev``: a demo fleet on the local stack, watched live.

Starts, as children that cannot outlive this process (``devstack.spawn``):

    dynalite + moto (DevStack) → ``fleetd init`` → fake upstream (``python -m bench.upstream``)
    → ``fleetd run --shards 2`` → N demo connections (items + START hints)

then shows connections per shard, messages/s, claims and restarts, scraped from
the supervisor's ``/metrics`` once a second, until Ctrl-C or ``--duration``.
Shutdown is the reverse order, each child SIGTERMed and waited for, so nothing is
left running.  ``--plain`` (implied when stdout is not a terminal) prints one status
line per second instead of redrawing the screen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from fleetd import config, exits, items
from fleetd.config import Config
from fleetd.devstack import DevStack, DevStackError, free_port, spawn, terminate

if TYPE_CHECKING:
    from fleetd.aws import Clients

SHARDS = 2
START_CONCURRENCY = 32  # UpdateItems in flight while creating the demo connections
_LISTENING = re.compile(rb"listening (ws://\S+)")


class DevError(Exception):
    """The demo could not start (one line for the operator)."""


# ----- status from /metrics -----------------------------------------------------------------------------


@dataclass(slots=True)
class Status:
    """What the live view shows, read from one scrape."""

    at: float = 0.0  # monotonic time of the scrape
    per_shard: dict[str, float] = field(default_factory=dict)  # active connections by shard
    messages: float = 0.0  # fleetd_messages_total over all shards
    claims_won: float = 0.0
    renewals_won: float = 0.0
    restarts: float = 0.0
    ready: bool = False

    @property
    def connections(self) -> float:
        return sum(self.per_shard.values())


def parse_status(text: str, at: float, ready: bool) -> Status:
    from fleetd.metrics import scrape

    st = Status(at=at, ready=ready)
    sums: dict[str, float] = defaultdict(float)
    for name, labels, value in scrape(text):
        if name == "fleetd_active_connections":
            st.per_shard[labels.get("shard", "?")] = value
        elif name == "fleetd_lease_claims_total" and labels.get("result") == "won":
            sums["claims"] += value
        elif name == "fleetd_lease_renewals_total" and labels.get("result") == "won":
            sums["renewals"] += value
        elif name in ("fleetd_messages_total", "fleetd_shard_restarts_total"):
            sums[name] += value
    st.messages, st.restarts = sums["fleetd_messages_total"], sums["fleetd_shard_restarts_total"]
    st.claims_won, st.renewals_won = sums["claims"], sums["renewals"]
    return st


def read_status(metrics_url: str) -> Status:
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=2) as resp:
        text = resp.read().decode()
    return parse_status(text, time.monotonic(), _ok(metrics_url + "/readyz"))


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def rate(prev: Status | None, cur: Status) -> float:
    """Messages per second between two scrapes (0 until there are two)."""
    if prev is None or cur.at <= prev.at:
        return 0.0
    return max(0.0, cur.messages - prev.messages) / (cur.at - prev.at)


def status_line(cur: Status, msgs_per_s: float, elapsed_s: float) -> str:
    shards = " ".join(f"s{k}={v:.0f}" for k, v in sorted(cur.per_shard.items()))
    return (f"t={elapsed_s:5.0f}s connections={cur.connections:.0f} ({shards or 'no shard'}) "
            f"messages/s={msgs_per_s:.1f} messages={cur.messages:.0f} claims={cur.claims_won:.0f} "
            f"renewals={cur.renewals_won:.0f} restarts={cur.restarts:.0f} ready={'yes' if cur.ready else 'no'}")


def screen(cur: Status, msgs_per_s: float, elapsed_s: float, workdir: Path) -> str:
    rows = [f"fleetd dev — {elapsed_s:.0f} s — Ctrl-C to stop — logs in {workdir}", "",
            f"{'shard':<8}{'connections':>12}"]
    rows += [f"{k:<8}{v:>12.0f}" for k, v in sorted(cur.per_shard.items())]
    rows += [f"{'total':<8}{cur.connections:>12.0f}", "",
             f"messages/s     {msgs_per_s:10.1f}", f"messages       {cur.messages:10.0f}",
             f"claims won     {cur.claims_won:10.0f}", f"renewals won   {cur.renewals_won:10.0f}",
             f"restarts       {cur.restarts:10.0f}", f"ready          {'yes' if cur.ready else 'no':>10}"]
    return "\x1b[H\x1b[2J" + "\n".join(rows) + "\n"


# ----- the demo fleet -----------------------------------------------------------------------------------


def _repo_root() -> Path:
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "upstream.py").exists():
        raise DevError("bench/upstream.py not found: run `fleetd dev` from a fleetd source checkout")
    return root


def _wait_for_line(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> str:
    """The fake upstream prints ``listening ws://HOST:PORT`` once it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _LISTENING.search(path.read_bytes()) if path.exists() else None
        if found:
            return found.group(1).decode()
        if proc.poll() is not None:
            raise DevError(f"fake upstream exited with code {proc.returncode}; see {path}")
        time.sleep(0.05)
    raise DevError(f"fake upstream did not start within {timeout_s:.0f} s; see {path}")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DevError(f"fleetd run exited with code {proc.returncode}; see {log_path}")
        if _ok(url + "/healthz"):
            return
        time.sleep(0.1)
    raise DevError(f"fleetd run did not serve {url} within {timeout_s:.0f} s; see {log_path}")


class DevFleet:
    """The local stack, a fake upstream and ``fleetd run``; :meth:`stop` ends them in reverse order."""

    def __init__(self, cfg: Config, workdir: Path, msg_rate: float) -> None:
        # The demo's fake upstream is a ws:// server on loopback, which the SSRF guard refuses unless allowed.
        networks = tuple(dict.fromkeys((*cfg.upstream.allowed_networks, *config.LOOPBACK_NETWORKS)))
        self.cfg = config.replace(cfg, allowed_schemes=("ws", "wss"), allowed_networks=networks)
        self.workdir = workdir
        self.msg_rate = msg_rate
        self.stack = DevStack(log_dir=workdir)
        self.upstream: subprocess.Popen[bytes] | None = None
        self.fleetd: subprocess.Popen[bytes] | None = None
        self.ws_base = ""
        self.metrics_url = ""

    def start(self) -> None:
        self.stack.start()
        self.stack.apply_env()  # this process talks to the stack too (init, demo items)
        asyncio.run(_init(self.cfg))
        env = dict(os.environ)
        self._start_upstream(env)
        self._start_fleetd(env)

    def _start_upstream(self, env: dict[str, str]) -> None:
        root = _repo_root()
        log_path = self.workdir / "upstream.log"
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))}
        self.upstream = spawn([sys.executable, "-m", "bench.upstream", "--port", "0", "--rate", str(self.msg_rate),
                               "--control-port", "0"], log_path, env=env)
        self.ws_base = _wait_for_line(log_path, self.upstream)

    def _start_fleetd(self, env: dict[str, str]) -> None:
        addr = f"127.0.0.1:{free_port()}"
        log_path = self.workdir / "fleetd-run.log"
        env = {**env, **config.as_env(self.cfg), "FLEETD_ALLOWED_SCHEMES": "ws,wss"}
        self.fleetd = spawn([sys.executable, "-m", "fleetd", "run", "--shards", str(SHARDS),
                             "--metrics-addr", addr], log_path, env=env)
        self.metrics_url = f"http://{addr}"
        _wait_healthy(self.metrics_url, self.fleetd, log_path)

    def add_connections(self, count: int) -> None:
        urls = {f"demo-{i:05d}": f"{self.ws_base}/stream/demo-{i:05d}" for i in range(count)}
        asyncio.run(start_connections(self.cfg, urls))

    def fleetd_exit_code(self) -> int | None:
        return None if self.fleetd is None else self.fleetd.poll()

    def stop(self) -> int | None:
        """SIGTERM ``fleetd run`` and wait (it releases every lease), then the upstream and the stack."""
        code = None
        if self.fleetd is not None:
            terminate(self.fleetd, timeout_s=self.cfg.runtime.shutdown_budget_s + 5)
            code = self.fleetd.returncode
        if self.upstream is not None:
            terminate(self.upstream)
        self.stack.stop()
        return code


async def _init(cfg: Config) -> None:
    from fleetd import schema

    async with _clients(cfg) as clients:
        await schema.init(clients.dynamodb, clients.sqs, cfg.aws)


@contextlib.asynccontextmanager
async def _clients(cfg: Config) -> AsyncIterator[Clients]:
    from fleetd.aws import open_clients

    async with AsyncExitStack() as stack:
        yield await open_clients(stack, cfg.aws)


async def start_connections(cfg: Config, urls: dict[str, str]) -> None:
    """What ``fleetd ctl start`` does for each id: upsert the item as STARTED, then START hints."""
    from fleetd.hints import Hints
    from fleetd.stats import Stats

    async with _clients(cfg) as clients:
        sem = asyncio.Semaphore(START_CONCURRENCY)

        async def one(cid: str, url: str) -> None:
            async with sem:
                await upsert_started(clients.dynamodb, cfg, cid, url)

        await asyncio.gather(*(one(cid, url) for cid, url in urls.items()))
        hints = Hints(clients.sqs, cfg.aws.hints_queue, 0, Stats())
        await hints.resolve()
        await hints.send_start(urls)


async def upsert_started(ddb: Any, cfg: Config, cid: str, url: str) -> None:
    """The item ``ctl start`` writes (:mod:`fleetd.items`)."""
    await ddb.update_item(**items.start_update(cfg.aws.connections_table, cid, url, int(time.time() * 1000)))


# ----- the command --------------------------------------------------------------------------------------


class _StopFlag:
    """The first SIGINT/SIGTERM sets an event (a clean, ordered stop follows); a second one gives up.

    Giving up is safe: every child was spawned with a parent-death signal.
    """

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()


def _watch(fleet: DevFleet, args: argparse.Namespace, stop: threading.Event, plain: bool) -> int:
    """Show the status once a second until stopped; non-zero if ``fleetd run`` died."""
    started = time.monotonic()
    prev: Status | None = None
    while not stop.wait(max(0.0, 1.0 - (time.monotonic() - started) % 1.0)):
        elapsed = time.monotonic() - started
        if fleet.fleetd_exit_code() is not None:
            print(f"fleetd: error: fleetd run exited with code {fleet.fleetd_exit_code()}; "
                  f"see {fleet.workdir / 'fleetd-run.log'}", file=sys.stderr)
            return exits.FAILURE
        try:
            cur = read_status(fleet.metrics_url)
        except OSError:
            continue  # a missed scrape is not worth stopping the demo for
        line = status_line(cur, rate(prev, cur), elapsed) if plain else screen(
            cur, rate(prev, cur), elapsed, fleet.workdir)
        sys.stdout.write(line + "\n" if plain else line)
        sys.stdout.flush()
        prev = cur
        if args.duration and elapsed >= args.duration:
            return exits.OK
    return exits.OK


def main(args: argparse.Namespace, cfg: Config) -> int:
    plain = bool(args.plain) or not sys.stdout.isatty()
    flag = _StopFlag()
    flag.install()
    workdir = Path(tempfile.mkdtemp(prefix="fleetd-dev-"))
    fleet = DevFleet(cfg, workdir, args.rate)
    print(f"fleetd dev: starting the local stack, a fake upstream and fleetd run (logs in {workdir})", flush=True)
    code = exits.OK
    try:
        fleet.start()
        fleet.add_connections(args.connections)
        print(f"fleetd dev: {args.connections} connections started; metrics at {fleet.metrics_url}/metrics",
              flush=True)
        code = _watch(fleet, args, flag.event, plain)
    except (DevError, DevStackError) as e:
        print(f"fleetd: error: {e}", file=sys.stderr)
        code = exits.FAILURE
    finally:
        print("fleetd dev: stopping", flush=True)
        run_code = fleet.stop()
    if code == exits.OK and run_code not in (None, exits.OK):
        print(f"fleetd: error: fleetd run exited with code {run_code}; see {workdir / 'fleetd-run.log'}",
              file=sys.stderr)
        code = exits.FAILURE
    print("fleetd dev: stopped", flush=True)
    return code
