"""Test-side fleet harness: fast timings and fleetd processes configured from a test's Config.

The process plumbing (fake upstream and fleetd children, seeding, scans) and the
invariant checker live in :mod:`bench.procs` and :mod:`bench.audit`, shared with the
benchmarks; this module binds them to a test's :class:`~fleetd.config.Config`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from bench import audit as _audit
from bench import procs
from bench.audit import Audit
from bench.procs import FleetdProc, UpstreamProc, ddb, scan_all, stop_all, wait_for
from fleetd import config
from fleetd.config import Config

__all__ = ["FAST_TIMINGS", "Audit", "FleetdProc", "UpstreamProc", "audit", "ddb", "fleetd_env", "owners", "scan_all",
           "seed_items", "start_shard", "stop_all", "wait_for"]

FAST_TIMINGS = {
    "FLEETD_LEASE_TTL_S": "6",
    "FLEETD_HEARTBEAT_S": "1",
    "FLEETD_SAFETY_MARGIN_S": "1",
    "FLEETD_RECONCILE_S": "1",
    "FLEETD_DESIRED_STATE_S": "1",
    "FLEETD_CHECKPOINT_S": "1",
    "FLEETD_CHECKPOINT_IDLE_S": "1",
    "FLEETD_HINT_WAIT_S": "1",
    "FLEETD_SHUTDOWN_BUDGET_S": "8",
    "FLEETD_BACKOFF_MAX_S": "2",
    "FLEETD_PING_IDLE_S": "2",
    "FLEETD_PING_REPLY_S": "2",
    "FLEETD_AWS_TIMEOUT_S": "2",
    "FLEETD_LOG_FORMAT": "json",
}


def fleetd_env(cfg: Config, **overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(config.as_env(cfg))
    env.update(FAST_TIMINGS)
    env.update(overrides)
    return env


def start_shard(cfg: Config, log_dir: Path, index: int, task: str = "task", **overrides: str) -> FleetdProc:
    env = fleetd_env(cfg, FLEETD_TASK_ID=task, **overrides)
    return FleetdProc([sys.executable, "-m", "fleetd", "shard", "--index", str(index)], env,
                      log_dir / f"shard-{task}-{index}.log")



def seed_items(cfg: Config, urls: dict[str, str]) -> None:
    """Write STARTED items exactly as ``fleetd ctl start`` does (without hints), fast."""
    procs.seed_items(cfg.aws.connections_table, urls)


def owners(cfg: Config) -> dict[str, str]:
    """connection_id → lease_owner ('' when free)."""
    return procs.owners(cfg.aws.connections_table)


def audit(cfg: Config, ids: Iterable[str] | None = None) -> Audit:
    return _audit.audit(cfg.aws.messages_table, ids)
