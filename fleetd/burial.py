"""Burying a dead shard's session: the supervisor's only AWS work (SPEC §6).

The supervisor's own loop never hosts AWS code.  Each function here is synchronous,
meant for a worker thread, and runs its AWS calls in a short-lived event loop of its
own; failures are logged and never raised (without a burial the session expires on
its own after the TTL, and peers find it at their next reconcile).

* ``expire_session`` expires the dead shard's session now, so its successor may claim
  its items at once.
* ``announce_dead`` sends DEAD_SESSION hints, so that peers take the dead shard's
  streams over now when no successor is about to.
* ``warm_up`` imports the AWS stack ahead of the first crash.

Importing this module costs nothing: the AWS stack is imported only by these
functions, in the thread that calls them.  Their log lines are the supervisor's.
"""

from __future__ import annotations

import logging
import time

from fleetd.config import Config

log = logging.getLogger("fleetd.supervisor")

DEAD_SESSION_COPIES = 3  # each wakes one peer; one may be too full to take them all
# Every shard that died in the last `hint_wait_s` may still have a long poll open at SQS, and each
# such poll takes one wave and hides it for 3 s.  Waves after the first go out DEAD_SESSION_WAVE_GAP_S apart.
DEAD_SESSION_WAVES = 4
DEAD_SESSION_WAVE_GAP_S = 0.3


def warm_up() -> None:
    """The first crash's recovery must not pay for imports: import the AWS stack now."""
    import aiobotocore.session  # noqa: F401

    import fleetd.lease  # noqa: F401


def expire_session(cfg: Config, session_id: str, pid: int = 0) -> str:
    """A successor may claim a dead shard's items only once its session is dead: end it now (and any later
    one its process ``pid`` opened without reporting it yet); returns the outcome, ``"error"`` on failure.
    """
    import asyncio

    started = time.monotonic()
    try:
        outcome = asyncio.run(_expire(cfg, session_id, pid))
    except Exception as e:
        log.warning("could not expire dead session", extra={"session_id": session_id,
                                                           "error": f"{type(e).__name__}: {e}"})
        return "error"
    log.info("dead session expired", extra={"session_id": session_id, "outcome": outcome,
                                            "seconds": round(time.monotonic() - started, 3)})
    return outcome


async def _expire(cfg: Config, session_id: str, pid: int) -> str:
    from aiobotocore.session import get_session

    from fleetd.aws import client_config, region_of
    from fleetd.clock import SystemClock
    from fleetd.lease import LeaseStore

    async with get_session().create_client("dynamodb", region_name=region_of(cfg.aws),
                                           config=client_config(cfg.aws)) as ddb:
        store = LeaseStore(ddb, cfg.aws, cfg.lease, SystemClock(cfg.lease.clock_offset_ms))
        return (await store.bury_process(session_id, pid)).value


def announce_dead(cfg: Config, session_id: str) -> None:
    """Peers take a dead shard's streams over now, not at their next reconcile: DEAD_SESSION hints.
    Best effort: without them, peers find the expired session at their next reconcile."""
    import asyncio

    started = time.monotonic()
    try:
        asyncio.run(_announce_dead(cfg, session_id))
    except Exception as e:
        log.warning("could not announce the dead session", extra={"session_id": session_id,
                                                                   "error": f"{type(e).__name__}: {e}"})
        return
    log.info("dead session announced to peers", extra={"session_id": session_id,
                                                       "seconds": round(time.monotonic() - started, 3)})


async def _announce_dead(cfg: Config, session_id: str) -> None:
    import asyncio

    from aiobotocore.session import get_session

    from fleetd.aws import client_config, region_of
    from fleetd.hints import Hints
    from fleetd.stats import Stats

    async with get_session().create_client("sqs", region_name=region_of(cfg.aws),
                                           config=client_config(cfg.aws)) as sqs:
        hints = Hints(sqs, cfg.aws.hints_queue, 0, Stats())
        for wave in range(DEAD_SESSION_WAVES):
            if wave:
                await asyncio.sleep(DEAD_SESSION_WAVE_GAP_S)
            await hints.send_dead_session(session_id, DEAD_SESSION_COPIES)
