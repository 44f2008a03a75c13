"""Making items free for peers, with the START hints that let a peer take them in about a second."""

from __future__ import annotations

import logging

from fleetd.aio import bounded
from fleetd.aws import Outcome
from fleetd.hints import HintStream
from fleetd.shard.context import Context

log = logging.getLogger(__name__)


async def disown(ctx: Context, ids: list[str], owner: str, epoch: int | None = None) -> list[str]:
    """Make these items, owned by ``owner`` and streamed by nobody, free (conditioned on that owner, and
    on ``epoch`` if given), with START hints; returns those freed."""
    outcomes = await bounded(ids, ctx.cfg.lease.claim_concurrency,
                             lambda cid: ctx.leases.disown(cid, owner, epoch=epoch))
    freed = [cid for cid, o in zip(ids, outcomes, strict=True) if o is Outcome.WON]
    if freed:
        stream = HintStream(ctx.hints)
        for cid in freed:
            stream.add(cid)
        await finish_hints(ctx, stream, ctx.cfg.aws.aws_timeout_s)
    return freed


async def finish_hints(ctx: Context, stream: HintStream, timeout_s: float) -> None:
    """Wait for the START hints, bounded like one AWS call: they only speed a hand-over up, and an
    unreachable SQS (whose client waits out a long-poll read timeout per attempt) must not eat the
    shutdown budget.  Peers find unhinted items at their next reconcile."""
    unsent = await stream.close(timeout_s)
    if unsent:
        ctx.stats.inc("hints_total", float(unsent), kind="send_failed")
        log.warning("START hints not sent in time; peers will find the released items by reconcile",
                    extra={"count": unsent})
