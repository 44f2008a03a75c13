"""Every AWS request of the baseline worker: one DynamoDB and one SQS client (aiobotocore).

Written independently of :mod:`fleetd.lease` — the expressions are the seed's
(SPEC §2, §3, item mode).  Each request is counted per operation so a benchmark can
report DynamoDB calls per connection-minute.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

log = logging.getLogger("bench.baseline")
STARTED = "STARTED"
GSI_STATE_EXPIRY = "by_state_expiry"
HINT_BATCH = 10  # SQS SendMessageBatch / DeleteMessageBatch limit


class Outcome(enum.Enum):
    OK = "ok"
    LOST = "lost"  # ConditionalCheckFailed: the lease is not ours (any more)
    INVALID = "invalid"  # ValidationException, e.g. an item over 400 KB: retrying cannot help
    ERROR = "error"  # throttling, 5xx, timeouts, connection errors: try again later


def now_ms() -> int:
    return int(time.time() * 1000)


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def outcome_of(exc: BaseException) -> Outcome:
    code = error_code(exc)
    if code == "ConditionalCheckFailedException":
        return Outcome.LOST
    if code == "ValidationException":
        return Outcome.INVALID
    return Outcome.ERROR


def _n(value: int) -> dict[str, str]:
    return {"N": str(value)}


def _s(value: str) -> dict[str, str]:
    return {"S": value}


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a won claim returns (ReturnValues ALL_NEW)."""

    connection_id: str
    ws_url: str
    epoch: int
    last_seq: int  # -1: the item has no checkpoint, connect without from_seq


class Store:
    """The seed's lease, sink, desired-state and hint requests for one worker (``owner``)."""

    def __init__(self, ddb: Any, sqs: Any, owner: str, *, connections: str, messages: str, queue_url: str,
                 ttl_ms: int, skew_ms: int, hint_wait_s: int) -> None:
        self.ddb = ddb
        self.sqs = sqs
        self.owner = owner
        self.connections = connections
        self.messages = messages
        self.queue_url = queue_url
        self.ttl_ms = ttl_ms
        self.skew_ms = skew_ms
        self.hint_wait_s = hint_wait_s
        self.calls: Counter[str] = Counter()

    async def _ddb(self, op: str, method: str, **kwargs: Any) -> dict[str, Any]:
        self.calls[op] += 1
        resp: dict[str, Any] = await getattr(self.ddb, method)(**kwargs)
        return resp

    async def _outcome(self, op: str, method: str, **kwargs: Any) -> Outcome:
        try:
            await self._ddb(op, method, **kwargs)
        except Exception as e:
            return outcome_of(e)
        return Outcome.OK

    # ----- leases ------------------------------------------------------------------------------------------

    async def claim(self, cid: str) -> Claimed | None:
        """SPEC §3 claim: one conditional UpdateItem; None when the item is not free (or the call failed)."""
        now = now_ms()
        try:
            resp = await self._ddb(
                "UpdateItem", "update_item", TableName=self.connections, Key={"connection_id": _s(cid)},
                UpdateExpression="SET lease_owner = :me, lease_expires_at_ms = :exp, updated_at_ms = :now "
                                 "ADD lease_epoch :one",
                ConditionExpression="desired_state = :started AND (attribute_not_exists(lease_expires_at_ms) "
                                    "OR lease_expires_at_ms < :t)",
                ExpressionAttributeValues={":me": _s(self.owner), ":exp": _n(now + self.ttl_ms), ":now": _n(now),
                                           ":one": _n(1), ":started": _s(STARTED), ":t": _n(now - self.skew_ms)},
                ReturnValues="ALL_NEW")
        except Exception:
            return None
        item = resp["Attributes"]
        return Claimed(cid, item.get("ws_url", {}).get("S", ""), int(item["lease_epoch"]["N"]),
                       int(item.get("last_seq", {}).get("N", "-1")))

    async def renew(self, cid: str, epoch: int, last_seq: int) -> Outcome:
        """Heartbeat of one item; the ``last_seq`` checkpoint rides along."""
        now = now_ms()
        return await self._outcome(
            "UpdateItem", "update_item", TableName=self.connections, Key={"connection_id": _s(cid)},
            UpdateExpression="SET lease_expires_at_ms = :exp, last_seq = :seq, updated_at_ms = :now",
            ConditionExpression="lease_owner = :me AND lease_epoch = :epoch",
            ExpressionAttributeValues={":exp": _n(now + self.ttl_ms), ":seq": _n(max(last_seq, 0)),
                                       ":now": _n(now), ":me": _s(self.owner), ":epoch": _n(epoch)})

    async def release(self, cid: str, last_seq: int) -> Outcome:
        return await self._outcome(
            "UpdateItem", "update_item", TableName=self.connections, Key={"connection_id": _s(cid)},
            UpdateExpression="SET lease_expires_at_ms = :zero, last_seq = :seq, updated_at_ms = :now "
                             "REMOVE lease_owner",
            ConditionExpression="lease_owner = :me",
            ExpressionAttributeValues={":zero": _n(0), ":seq": _n(max(last_seq, 0)), ":now": _n(now_ms()),
                                       ":me": _s(self.owner)})

    async def desired_state(self, cid: str) -> str:
        """Eventually consistent read of ``desired_state`` ('' for a missing item); raises on errors."""
        resp = await self._ddb("GetItem", "get_item", TableName=self.connections, Key={"connection_id": _s(cid)},
                               ConsistentRead=False, ProjectionExpression="desired_state")
        return str(resp.get("Item", {}).get("desired_state", {}).get("S", ""))

    async def free_items(self) -> AsyncIterator[list[str]]:
        """Pages of STARTED items whose lease is free or expired (GSI: candidates only)."""
        start: dict[str, Any] | None = None
        while True:
            kwargs: dict[str, Any] = dict(
                TableName=self.connections, IndexName=GSI_STATE_EXPIRY,
                KeyConditionExpression="desired_state = :started AND lease_expires_at_ms < :t",
                ExpressionAttributeValues={":started": _s(STARTED), ":t": _n(now_ms() - self.skew_ms)})
            if start:
                kwargs["ExclusiveStartKey"] = start
            resp = await self._ddb("Query", "query", **kwargs)
            yield [k["connection_id"]["S"] for k in resp.get("Items", [])]
            start = resp.get("LastEvaluatedKey")
            if not start:
                return

    # ----- sink --------------------------------------------------------------------------------------------

    async def put_message(self, cid: str, seq: int, payload: str, epoch: int) -> Outcome:
        """One awaited PutItem per message, attributes exactly as fleetd's sink writes them."""
        return await self._outcome(
            "PutItem", "put_item", TableName=self.messages,
            Item={"connection_id": _s(cid), "seq": _n(seq), "payload": _s(payload),
                  "received_at_ms": _n(now_ms()), "lease_epoch": _n(epoch), "session_id": _s(self.owner)})

    # ----- hints -------------------------------------------------------------------------------------------

    async def receive_hints(self) -> list[tuple[str | None, str]]:
        """One long poll: (connection_id or None for a malformed body, receipt handle) per message."""
        self.calls["ReceiveMessage"] += 1
        resp = await self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10,
                                              WaitTimeSeconds=self.hint_wait_s)
        return [(_hint_target(m.get("Body", "")), m["ReceiptHandle"]) for m in resp.get("Messages", [])]

    async def delete_hints(self, receipts: list[str]) -> None:
        for i in range(0, len(receipts), HINT_BATCH):
            self.calls["DeleteMessageBatch"] += 1
            entries = [{"Id": str(j), "ReceiptHandle": r} for j, r in enumerate(receipts[i:i + HINT_BATCH])]
            await self.sqs.delete_message_batch(QueueUrl=self.queue_url, Entries=entries)

    async def return_hints(self, receipts: list[str]) -> None:
        """Make hints we will not act on visible to peers at once."""
        for i in range(0, len(receipts), HINT_BATCH):
            self.calls["ChangeMessageVisibilityBatch"] += 1
            entries = [{"Id": str(j), "ReceiptHandle": r, "VisibilityTimeout": 0}
                       for j, r in enumerate(receipts[i:i + HINT_BATCH])]
            await self.sqs.change_message_visibility_batch(QueueUrl=self.queue_url, Entries=entries)

    async def send_hints(self, cids: list[str], concurrency: int = 16) -> int:
        """START hints, 10 a batch, ``concurrency`` batches in flight; returns how many SQS accepted."""
        gate = asyncio.Semaphore(concurrency)

        async def send(chunk: list[str]) -> int:
            entries = [{"Id": str(j), "MessageBody": orjson.dumps({"type": "START", "connection_id": c}).decode()}
                       for j, c in enumerate(chunk)]
            async with gate:
                self.calls["SendMessageBatch"] += 1
                try:
                    resp = await self.sqs.send_message_batch(QueueUrl=self.queue_url, Entries=entries)
                except Exception as e:
                    log.warning("sending %d START hints failed: %r", len(chunk), e)
                    return 0
            return len(resp.get("Successful", []))

        chunks = [cids[i:i + HINT_BATCH] for i in range(0, len(cids), HINT_BATCH)]
        return sum(await asyncio.gather(*(send(c) for c in chunks)))


def _hint_target(body: str) -> str | None:
    try:
        msg = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(msg, dict) and msg.get("type") == "START" and isinstance(msg.get("connection_id"), str):
        return str(msg["connection_id"])
    return None
