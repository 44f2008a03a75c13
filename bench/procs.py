"""Process harness shared by the tests and the benchmarks.

Fake upstream and fleetd child processes (started with :func:`fleetd.devstack.spawn`,
so they die with us), item seeding with plain boto3, and table scans.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import orjson

from fleetd.devstack import spawn, terminate
from fleetd.items import new_item


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1, what: str = "") -> Any:
    """Poll until ``predicate()`` is truthy; return its value or raise AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(interval_s)


class UpstreamProc:
    """``python -m bench.upstream`` with its HTTP control port."""

    def __init__(self, log_dir: Path, rate: float = 5.0, size: int = 120, port: int = 0,
                 name: str = "upstream", first_seq: int = 1, ping_s: float = 0.0) -> None:
        out = log_dir / f"{name}.out"
        out.unlink(missing_ok=True)  # a stale file from an earlier run would announce a dead port
        self.proc = spawn([sys.executable, "-m", "bench.upstream", "--port", str(port), "--rate", str(rate),
                           "--size", str(size), "--control-port", "0", "--first-seq", str(first_seq),
                           "--ping-s", str(ping_s)], out)
        lines = wait_for(lambda: _listening(out), 20, what="fake upstream to listen")
        self.control = lines["control"]
        self.ws = lines["listening"]

    def url(self, cid: str) -> str:
        return f"{self.ws}/stream/{cid}"

    def _http(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.control + path, method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(orjson.loads(resp.read()))

    def stats(self) -> dict[str, dict[str, Any]]:
        return dict(self._http("GET", "/stats")["streams"])

    def post(self, path: str) -> dict[str, Any]:
        return self._http("POST", path)

    def stop(self) -> None:
        terminate(self.proc)


def _listening(out: Path) -> dict[str, str] | None:
    if not out.exists():
        return None
    found: dict[str, str] = {}
    for line in out.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word in ("listening", "control"):
            found[word] = rest.strip()
    return found if "listening" in found else None


@dataclass
class FleetdProc:
    """A system-under-test child process (``fleetd shard|run``, the baseline) with its log."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.proc = spawn(self.argv, self.log_path, env=self.env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                out.append({"raw": line})
        return out

    def stop(self) -> None:
        terminate(self.proc, timeout_s=15)


def ddb() -> Any:
    return boto3.client("dynamodb")


def seed_items(table: str, urls: dict[str, str]) -> None:
    """Write free STARTED items exactly as ``fleetd ctl start`` creates them (without hints), fast.

    A PutItem: meant for ids that do not exist yet (it would overwrite an item's lease and ``last_seq``).
    """
    client = ddb()
    now = int(time.time() * 1000)
    items = [{"PutRequest": {"Item": new_item(cid, url, now)}} for cid, url in urls.items()]
    for i in range(0, len(items), 25):
        batch = {table: items[i:i + 25]}
        while batch:
            batch = client.batch_write_item(RequestItems=batch).get("UnprocessedItems") or {}


def scan_all(table: str, **kwargs: Any) -> list[dict[str, Any]]:
    client = ddb()
    items: list[dict[str, Any]] = []
    start: dict[str, Any] | None = None
    while True:
        args = dict(kwargs, TableName=table)
        if start:
            args["ExclusiveStartKey"] = start
        resp = client.scan(**args)
        items += resp.get("Items", [])
        start = resp.get("LastEvaluatedKey")
        if not start:
            return items


def owners(table: str) -> dict[str, str]:
    """connection_id → lease_owner ('' when free)."""
    return {i["connection_id"]["S"]: i.get("lease_owner", {}).get("S", "")
            for i in scan_all(table, ConsistentRead=True)}


def stop_all(*procs: FleetdProc | UpstreamProc) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            p.stop()
