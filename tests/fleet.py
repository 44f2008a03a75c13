"""Test-side fleet harness: fleetd processes (and in-process shards) configured from a test's Config.

The process plumbing (fake upstream and fleetd children, seeding, scans) and the
invariant checker live in :mod:`bench.procs` and :mod:`bench.audit`, shared with the
benchmarks; this module binds them to a test's :class:`~fleetd.config.Config`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import uvloop

from bench import audit as _audit
from bench import procs
from bench.audit import Audit
from bench.procs import FleetdProc, UpstreamProc, ddb, scan_all, stop_all, wait_for
from bench.profile import fast
from fleetd import config
from fleetd.config import Config
from fleetd.shard import Shard

__all__ = ["Audit", "FleetdProc", "ShardThread", "UpstreamProc", "audit", "ddb", "fleetd_env", "owners", "scan_all",
           "seed_items", "start_shard", "stop_all", "wait_for"]


def fleetd_env(cfg: Config, **overrides: str) -> dict[str, str]:
    """The environment of a fleetd child: this process's, ``cfg`` on the fast profile
    (:func:`bench.profile.fast`: ``cfg``'s own timings are replaced), then ``overrides`` (``FLEETD_*``
    settings, validated with the rest, and any other variable)."""
    env = {**config.as_env(fast(cfg)), **overrides}
    config.load(env=env)  # an override that breaks the profile fails here, not in the child
    return {**os.environ, **env}


def start_shard(cfg: Config, log_dir: Path, index: int, task: str = "task", **overrides: str) -> FleetdProc:
    env = fleetd_env(cfg, FLEETD_TASK_ID=task, **overrides)
    return FleetdProc([sys.executable, "-m", "fleetd", "shard", "--index", str(index)], env,
                      log_dir / f"shard-{task}-{index}.log")


class ShardThread:
    """A shard running in a thread of the test process (to read its counters)."""

    def __init__(self, cfg: Config, index: int = 0) -> None:
        self.cfg = cfg
        self.shard = Shard(cfg, index)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code: int = runner.run(self.shard.run())
            self.code = code

    def counter(self, name: str, **labels: str) -> float:
        return self.shard.stats.counter(name, **labels)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        wait_for(lambda: self.shard.loop is not None, 10, what="shard loop")
        self.shard.request_stop()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "shard did not stop"
        return self.code


def seed_items(cfg: Config, urls: dict[str, str]) -> None:
    """Write STARTED items exactly as ``fleetd ctl start`` does (without hints), fast."""
    procs.seed_items(cfg.aws.connections_table, urls)


def owners(cfg: Config) -> dict[str, str]:
    """connection_id → lease_owner ('' when free)."""
    return procs.owners(cfg.aws.connections_table)


def audit(cfg: Config, ids: Iterable[str] | None = None) -> Audit:
    return _audit.audit(cfg.aws.messages_table, ids)
