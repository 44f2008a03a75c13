"""START hints over SQS (SPEC §2, §3).

A hint only says "this connection may be free now"; it is never ownership — the
receiver must still win the conditional claim.  Hints make a released connection
reappear on a peer in about a second instead of at the next reconcile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from fleetd.aws import error_code
from fleetd.stats import Stats

log = logging.getLogger("fleetd.hints")
SEND_BATCH_MAX = 10  # SendMessageBatch limit
SEND_CONCURRENCY = 16  # batch calls in flight at once (the SQS client pool holds more)
# A received hint is handled in milliseconds.  A short visibility timeout bounds how long a
# hint swallowed by a dying receiver stays hidden from peers; a duplicate only costs a failed claim.
VISIBILITY_S = 3


@dataclass(frozen=True, slots=True)
class Hint:
    connection_id: str
    receipt: str


def start_body(connection_id: str) -> str:
    return orjson.dumps({"type": "START", "connection_id": connection_id}).decode()


class Hints:
    """Receive, acknowledge and send START hints on one queue."""

    def __init__(self, sqs: Any, queue_name: str, wait_s: int, stats: Stats) -> None:
        self.sqs = sqs
        self.queue_name = queue_name
        self.wait_s = wait_s
        self.stats = stats
        self.url = ""

    async def resolve(self) -> None:
        """Look the queue URL up once (raises if the queue does not exist)."""
        self.url = (await self.sqs.get_queue_url(QueueName=self.queue_name))["QueueUrl"]

    async def _queue_url(self) -> str:
        """The queue URL; looked up on first use when SQS was unreachable at boot."""
        if not self.url:
            await self.resolve()
        return self.url

    async def receive(self, max_messages: int) -> list[Hint]:
        """One long poll; malformed messages are counted, deleted and skipped."""
        url = await self._queue_url()
        resp = await self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=max(1, min(10, max_messages)),
                                              WaitTimeSeconds=self.wait_s, VisibilityTimeout=VISIBILITY_S)
        hints: list[Hint] = []
        for msg in resp.get("Messages", []):
            cid = _parse(msg.get("Body", ""))
            if cid is None:
                self.stats.inc("hints_total", kind="malformed")
                log.warning("malformed hint dropped", extra={"body": str(msg.get("Body", ""))[:200]})
                await self.ack([msg["ReceiptHandle"]])
                continue
            self.stats.inc("hints_total", kind="received")
            hints.append(Hint(cid, msg["ReceiptHandle"]))
        return hints

    async def ack(self, receipts: Iterable[str]) -> None:
        for chunk in _chunks(list(receipts)):
            entries = [{"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(chunk)]
            await self.sqs.delete_message_batch(QueueUrl=await self._queue_url(), Entries=entries)

    async def give_back(self, receipts: Iterable[str]) -> None:
        """Make hints we cannot take visible to peers at once (we are full)."""
        handles = list(receipts)
        for chunk in _chunks(handles):
            entries = [{"Id": str(i), "ReceiptHandle": r, "VisibilityTimeout": 0} for i, r in enumerate(chunk)]
            await self.sqs.change_message_visibility_batch(QueueUrl=await self._queue_url(), Entries=entries)
        self.stats.inc("hints_total", float(len(handles)), kind="returned")

    async def send_start(self, connection_ids: Iterable[str]) -> int:
        """Send START hints in batches, several in flight; returns how many were accepted (failures are logged).

        A shard stopping with 1,000 streams sends 100 batches: one after the other they took
        longer than the hand-over's time budget (bench failover), and the hints not sent left
        their streams to the peers' next reconcile.
        """
        sem = asyncio.Semaphore(SEND_CONCURRENCY)

        async def one(chunk: list[str]) -> int:
            entries = [{"Id": str(j), "MessageBody": start_body(cid)} for j, cid in enumerate(chunk)]
            async with sem:
                try:
                    resp = await self.sqs.send_message_batch(QueueUrl=await self._queue_url(), Entries=entries)
                except Exception as e:
                    log.warning("sending START hints failed", extra={"count": len(chunk), "code": error_code(e)})
                    self.stats.inc("hints_total", float(len(chunk)), kind="send_failed")
                    return 0
            ok = len(resp.get("Successful", []))
            self.stats.inc("hints_total", float(ok), kind="sent")
            return ok

        return sum(await asyncio.gather(*(one(c) for c in _chunks(list(connection_ids)))))


def _chunks(items: list[str]) -> Iterator[list[str]]:
    """SQS batch calls take at most ten entries."""
    for i in range(0, len(items), SEND_BATCH_MAX):
        yield items[i:i + SEND_BATCH_MAX]


def _parse(body: str) -> str | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("type") != "START":
        return None
    cid = obj.get("connection_id")
    return cid if isinstance(cid, str) and cid else None
