"""The one fast timing profile of tests and benchmark smoke runs: fleetd's product timings shortened.

Leases live 6 s and are renewed every second, so a takeover after a crash takes seconds, not a
minute; scans, checkpoints and desired-state checks run every second; upstream and AWS failures
are noticed within a few seconds.  :func:`fast` is the validated :class:`~fleetd.config.Config`,
:func:`fast_env` its environment form for child processes.  A caller that needs another value
passes it as an override, with its reason next to it; code that needs a timing reads it from the
config object (``fast().lease.lease_ttl_s``), never back from an environment string.
"""

from __future__ import annotations

from typing import Any

from fleetd import config
from fleetd.config import Config

# Setting name → fast value; every other setting keeps its product default.
FAST: dict[str, Any] = {
    # leases: a crashed shard's streams are taken over within TTL + margin + reconcile (8 s)
    "lease_ttl_s": 6.0,
    "heartbeat_s": 1.0,
    "safety_margin_s": 1.0,
    "reconcile_s": 1.0,
    "desired_state_s": 1.0,
    "checkpoint_s": 1.0,
    "checkpoint_idle_s": 1.0,
    "hint_wait_s": 1,
    "shutdown_budget_s": 8.0,
    # upstream and AWS failures noticed within seconds
    "backoff_max_s": 2.0,
    "ping_idle_s": 2.0,
    "ping_reply_s": 2.0,
    "aws_timeout_s": 2.0,
    # not a timing: the fake upstreams of tests and benchmarks listen on loopback, which the SSRF guard
    # refuses unless allowed (fleetd.validation.address_refusal)
    "allowed_networks": config.LOOPBACK_NETWORKS,
}


def fast(base: Config | None = None, /, **overrides: Any) -> Config:
    """``base`` (default: the product defaults) on the fast profile, then ``overrides`` (setting names).

    The result is validated: an override inconsistent with the profile (a heartbeat above the TTL)
    raises :class:`~fleetd.config.ConfigError` here rather than in a child process.
    """
    return config.replace(base if base is not None else Config(), **{**FAST, **overrides})


def fast_env(base: Config | None = None, /, **overrides: Any) -> dict[str, str]:
    """The ``FLEETD_*`` variables that turn ``base`` (default: the product defaults) into
    ``fast(base, **overrides)``: only what differs, so they can be laid over an environment that
    already holds ``base`` (or fleetd's defaults) with its tables and addresses."""
    before = config.as_env(base if base is not None else Config())
    return {k: v for k, v in config.as_env(fast(base, **overrides)).items() if before[k] != v}
