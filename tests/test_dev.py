"""``fleetd dev`` end to end: its own stack, upstream and ``fleetd run``, stopped by SIGINT or --duration."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fleetd.dev import Status, parse_status, rate, status_line

_RATE = re.compile(r"messages/s=([0-9.]+)")


class Dev:
    """``python -m fleetd dev`` with its stdout collected line by line in a thread."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETD_", "AWS_"))}
        env["TMPDIR"] = str(tmp_path)  # the demo keeps its logs in a temporary directory: keep it in ours
        self.proc = subprocess.Popen([sys.executable, "-m", "fleetd", "dev", "--plain", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.tree: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def remember_tree(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.tree |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def rates(self) -> list[float]:
        return [float(m.group(1)) for line in self.lines if (m := _RATE.search(line))]

    def wait_for_flow(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(r > 0 for r in self.rates()):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < deadline, "no messages/s > 0:\n" + "\n".join(self.lines)
            self.remember_tree()
            time.sleep(0.2)
        self.remember_tree()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        for pid in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def strays(pids: set[int], grace_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + grace_s
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def dev_runs() -> Iterator[list[Dev]]:
    runs: list[Dev] = []
    yield runs
    for d in runs:
        d.kill()


def test_dev_streams_and_stops_cleanly_on_sigint(dev_runs: list[Dev], tmp_path: Path) -> None:
    dev = Dev(tmp_path, "--duration", "120", "--connections", "50")
    dev_runs.append(dev)
    dev.wait_for_flow(60)
    time.sleep(2)
    dev.remember_tree()
    assert len(dev.tree) >= 5, "stack, upstream, fleetd run and its shards should be running"
    dev.proc.send_signal(signal.SIGINT)
    assert dev.proc.wait(40) == 0, "\n".join(dev.lines)
    rates = dev.rates()
    assert max(rates) > 25, rates  # 50 streams at 1 msg/s each
    assert any("connections=50 " in line for line in dev.lines)
    assert dev.lines[-1] == "fleetd dev: stopped"
    assert strays(dev.tree) == []


def test_dev_stops_by_itself_after_duration(dev_runs: list[Dev], tmp_path: Path) -> None:
    dev = Dev(tmp_path, "--duration", "6", "--connections", "10", "--rate", "2")
    dev_runs.append(dev)
    dev.wait_for_flow(60)
    assert dev.proc.wait(60) == 0, "\n".join(dev.lines)
    assert dev.lines[-1] == "fleetd dev: stopped"
    assert strays(dev.tree) == []


def test_status_from_an_exposition() -> None:
    text = "\n".join([
        "# TYPE fleetd_active_connections gauge",
        'fleetd_active_connections{shard="0"} 30', 'fleetd_active_connections{shard="1"} 20',
        "# TYPE fleetd_messages counter",
        'fleetd_messages_total{shard="0"} 100', 'fleetd_messages_total{shard="1"} 50',
        "# TYPE fleetd_lease_claims counter",
        'fleetd_lease_claims_total{result="won",shard="0"} 30', 'fleetd_lease_claims_total{result="lost",shard="0"} 9',
        "# TYPE fleetd_shard_restarts counter", 'fleetd_shard_restarts_total{shard="1"} 1', "",
    ])
    cur = parse_status(text, at=12.0, ready=True)
    assert cur.connections == 50 and cur.messages == 150 and cur.claims_won == 30 and cur.restarts == 1
    assert rate(Status(at=10.0, messages=50), cur) == 50.0
    assert rate(None, cur) == 0.0
    line = status_line(cur, 50.0, 12)
    assert "connections=50 (s0=30 s1=20)" in line and "messages/s=50.0" in line and "ready=yes" in line
