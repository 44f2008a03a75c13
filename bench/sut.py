"""The systems under test: fleetd tasks and seed-design baseline workers, as child processes.

Both read the same tables and queue and reach DynamoDB through the harness's
metering proxy.  Each exposes the same small surface to the scenarios: its root
pids (psutil measures their process trees), a signal, a wait, a stop.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.procs import FleetdProc
from fleetd.config import LOOPBACK_NETWORKS
from fleetd.devstack import free_port

# fleetd's defaults are its product timings; only what a benchmark needs differs.
FLEETD_BENCH_ENV = {
    "FLEETD_ALLOWED_SCHEMES": "ws,wss",
    "FLEETD_ALLOWED_NETWORKS": ",".join(LOOPBACK_NETWORKS),  # the fake upstream listens on loopback
    "FLEETD_CLOUDWATCH_MODE": "off",
    "FLEETD_LOG_FORMAT": "json",
    "FLEETD_LOG_LEVEL": "WARNING",
}


@dataclass
class Tables:
    connections: str = "fleetd-connections"
    sessions: str = "fleetd-sessions"
    messages: str = "fleetd-messages"
    queue: str = "fleetd-hints"


System = FleetdProc  # a started child process (fleetd supervisor or baseline worker) and its log


def fleetd_task(task_id: str, shards: int, tables: Tables, log_dir: Path, env: dict[str, str],
                **settings: str) -> tuple[System, str]:
    """``fleetd run`` as one ECS task would; returns it and its metrics URL."""
    addr = f"127.0.0.1:{free_port()}"
    child_env = dict(env, **FLEETD_BENCH_ENV)
    child_env.update(FLEETD_TASK_ID=task_id, FLEETD_SHARDS=str(shards), FLEETD_METRICS_ADDR=addr,
                     FLEETD_CONNECTIONS_TABLE=tables.connections, FLEETD_SESSIONS_TABLE=tables.sessions,
                     FLEETD_MESSAGES_TABLE=tables.messages, FLEETD_HINTS_QUEUE=tables.queue, **settings)
    system = System([sys.executable, "-m", "fleetd", "run"], child_env, log_dir / f"fleetd-{task_id}.log")
    return system, f"http://{addr}/metrics"


def baseline_worker(worker_id: str, tables: Tables, log_dir: Path, env: dict[str, str],
                    *extra: str) -> tuple[System, Path]:
    """``python -m bench.baseline``; returns it and its stats file."""
    stats = log_dir / f"baseline-{worker_id}.stats.json"
    argv = [sys.executable, "-m", "bench.baseline", "--worker-id", worker_id,
            "--connections-table", tables.connections, "--messages-table", tables.messages,
            "--hints-queue", tables.queue, "--stats-file", str(stats), *extra]
    return System(argv, dict(env), log_dir / f"baseline-{worker_id}.log"), stats


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(orjson.loads(path.read_bytes()))
    except (OSError, orjson.JSONDecodeError):
        return {}


def live_sessions(sessions_table: str, task_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Unexpired session items (optionally of one task): session_id → {pid, shard, task_id}."""
    import time

    from bench.procs import scan_all

    now_ms = time.time() * 1000
    out: dict[str, dict[str, Any]] = {}
    for item in scan_all(sessions_table, ConsistentRead=True):
        if float(item.get("expires_at_ms", {}).get("N", "0")) < now_ms:
            continue
        task = item.get("task_id", {}).get("S", "")
        if task_id is None or task == task_id:
            out[item["session_id"]["S"]] = {"pid": int(item.get("pid", {}).get("N", "0")), "task_id": task,
                                            "shard": int(item.get("shard", {}).get("N", "-1"))}
    return out


def kill_tree(system: System) -> None:
    """SIGKILL a supervisor and its shards at once: a task (host) lost."""
    import psutil

    try:
        family = [p.pid for p in psutil.Process(system.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for pid in [system.pid, *family]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    system.proc.wait(10)
