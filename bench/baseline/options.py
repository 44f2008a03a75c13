"""Command-line options of the baseline worker (defaults are the seed's and fleetd's names)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Options:
    """Everything one baseline worker is told; units in the names."""

    worker_id: str
    connections_table: str
    messages_table: str
    hints_queue: str
    heartbeat_s: float
    lease_ttl_s: float
    safety_margin_s: float
    reconcile_s: float
    desired_state_s: float
    hint_wait_s: int
    max_connections: int  # 0 = unlimited
    claim_concurrency: int
    release_hints: bool
    uvloop: bool
    stats_file: Path | None
    aws_timeout_s: float
    aws_max_attempts: int
    aws_max_pool: int
    backoff_min_s: float
    backoff_max_s: float
    shutdown_budget_s: float

    @property
    def ttl_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def skew_ms(self) -> int:
        # Like fleetd, the claim condition's clock-skew allowance is the safety margin.
        return int(self.safety_margin_s * 1000)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.baseline",
                                description="The seed design: asyncio + websockets, three tasks per connection, "
                                            "one DynamoDB lease item renewed per connection.")
    p.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="lease owner prefix; the owner is <worker-id>/<boot nonce>")
    p.add_argument("--connections-table", default="fleetd-connections")
    p.add_argument("--messages-table", default="fleetd-messages")
    p.add_argument("--hints-queue", default="fleetd-hints")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--lease-ttl-s", type=float, default=20.0)
    p.add_argument("--safety-margin-s", type=float, default=2.0)
    p.add_argument("--reconcile-s", type=float, default=60.0)
    p.add_argument("--desired-state-s", type=float, default=10.0)
    p.add_argument("--hint-wait-s", type=int, default=20, help="SQS long-poll wait (0-20)")
    p.add_argument("--max-connections", type=int, default=0, help="0 = unlimited")
    p.add_argument("--claim-concurrency", type=int, default=32, help="claims in flight during a reconcile")
    p.add_argument("--no-release-hints", dest="release_hints", action="store_false",
                   help="do not send START hints for released leases on SIGTERM (the seed's 'up to 60 s')")
    p.add_argument("--uvloop", action="store_true", help="run on uvloop (the seed uses stock asyncio)")
    p.add_argument("--stats-file", type=Path)
    p.add_argument("--aws-timeout-s", type=float, default=5.0)
    p.add_argument("--aws-max-attempts", type=int, default=3)
    p.add_argument("--aws-max-pool", type=int, default=64)
    p.add_argument("--backoff-min-s", type=float, default=0.5)
    p.add_argument("--backoff-max-s", type=float, default=30.0)
    p.add_argument("--shutdown-budget-s", type=float, default=20.0)
    return p


def parse(argv: list[str] | None = None) -> Options:
    p = _parser()
    ns = p.parse_args(argv)
    opts = Options(**vars(ns))
    if opts.heartbeat_s <= 0 or opts.lease_ttl_s - opts.safety_margin_s <= opts.heartbeat_s:
        p.error("need 0 < heartbeat-s < lease-ttl-s - safety-margin-s")
    if not 0 <= opts.hint_wait_s <= 20:
        p.error("--hint-wait-s must be within 0..20")
    if min(opts.reconcile_s, opts.desired_state_s, opts.claim_concurrency, opts.aws_max_pool) <= 0:
        p.error("intervals, --claim-concurrency and --aws-max-pool must be positive")
    return opts
