"""Boot: fail fast on what a restart cannot fix, retry what passes, then open the first session.

Rule: only definitive errors (a missing table or queue, no credentials, access denied, a messages
table keyed otherwise) are boot errors, on which the supervisor halts the task; transient ones
(throttling, 5xx, timeouts, lost answers) are retried, since halting for them would turn a passing
AWS hiccup at deploy time into an outage.  SQS carries only hints, so boot does not wait for an
unreachable queue: the inbox looks it up once it answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fleetd.aio import Backoff, wait
from fleetd.aws import Outcome, classify, error_code, missing
from fleetd.schema import SchemaError, verify_messages_table
from fleetd.shard.context import Context
from fleetd.shard.session import SessionKeeper

log = logging.getLogger(__name__)
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError"})


class BootError(Exception):
    """The shard cannot start (missing tables or queue, no credentials): exit BOOT_ERROR."""


class _Transient(Exception):
    """A boot step that failed in a way worth retrying."""


def definitive(e: BaseException) -> bool:
    """An error a restart cannot fix (a boot error), as opposed to throttling, 5xx, timeouts."""
    return missing(e) or type(e).__name__ in _NO_CREDENTIALS or classify(e) is Outcome.FATAL


def boot_reason(e: BaseException, what: str) -> str:
    if missing(e):
        return f"{what} does not exist: run `fleetd init`"
    if type(e).__name__ in _NO_CREDENTIALS:
        return "no AWS credentials found"
    return f"{what}: {error_code(e) or type(e).__name__}: {e}"


async def boot(ctx: Context, ddb: Any, session: SessionKeeper) -> bool:
    """Every boot step in order; False if asked to stop before the first session was open."""
    aws = ctx.cfg.aws
    for name in (aws.connections_table, aws.sessions_table, aws.messages_table):
        if not await _step(ctx, f"table {name}", functools.partial(ddb.describe_table, TableName=name)):
            return False
    try:
        await asyncio.wait_for(ctx.hints.resolve(), aws.aws_timeout_s)
    except Exception as e:
        if definitive(e):
            raise BootError(boot_reason(e, f"queue {aws.hints_queue}")) from None
        log.warning("hints queue unreachable at boot; running without hints until it answers",
                    extra={"error": f"{type(e).__name__}: {e}"})
    if not await _step(ctx, "messages table", functools.partial(_check_messages_table, ctx, ddb)):
        return False
    return await _step(ctx, "session", functools.partial(_open_first_session, session))


async def _check_messages_table(ctx: Context, ddb: Any) -> None:
    """A messages table keyed otherwise would refuse every message: a boot error, not a stall."""
    try:
        await verify_messages_table(ddb, ctx.cfg.aws)
    except SchemaError as e:
        raise BootError(f"messages table: {e}") from None


async def _open_first_session(session: SessionKeeper) -> None:
    outcome = await session.open()
    if outcome is Outcome.FATAL:
        raise BootError("could not create a session item")
    if outcome is not Outcome.WON:
        # RETRYABLE, or LOST: an SDK retry of a create whose answer was lost found our own item.
        # That session owns nothing and simply expires; the next attempt uses a fresh id.
        raise _Transient(f"session create {outcome.value}")


async def _step(ctx: Context, what: str, step: Callable[[], Awaitable[Any]]) -> bool:
    """Run ``step`` until it succeeds, backing off on transient errors; False if stopping first."""
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            await step()
            return True
        except BootError:
            raise
        except Exception as e:
            if definitive(e):
                raise BootError(boot_reason(e, what)) from None
            log.warning("boot step failed, retrying", extra={"step": what, "error": f"{type(e).__name__}: {e}"})
        if await wait(ctx.stopping, backoff.next()):
            return False
