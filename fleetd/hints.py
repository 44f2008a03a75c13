"""START hints over SQS (SPEC §2, §3).

A hint only says "this connection may be free now"; it is never ownership — the
receiver must still win the conditional claim.  Hints make a released connection
reappear on a peer in about a second instead of at the next reconcile.

Body: ``{"type": "START", "connection_id": ID}`` (SPEC §2; what ``ctl start`` and
other producers send) or ``{"type": "START", "connection_ids": [ID, …]}``, which a
stopping shard uses to hand over its streams ``IDS_PER_MESSAGE`` at a time: ten
times fewer SQS calls and messages, and a peer's receive returns a hundred hints.

``{"type": "DEAD_SESSION", "session_id": SID}`` is what a supervisor sends when a
crashed shard's successor will not boot at once (crash-loop backoff, a halt, a
stop): a peer that receives it runs its reconcile now, which takes over the
session the supervisor has just expired, instead of at its next ``reconcile_s``.

``{"type": "OFFER", "session_id": SID, "token": T, "offers": [[ID, EPOCH, LAST_SEQ], …]}`` is what a
stopping shard sends for streams it has closed and flushed: a peer with room checks the session's
offering mark (with token ``T``) and takes each with one write conditioned on that owner and epoch,
resuming after ``LAST_SEQ`` (-1: none known), so a hand-over costs one write instead of a release and
a claim (see ``fleetd.shard.handoff``).  A malformed entry is dropped alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from fleetd.aws import error_code
from fleetd.stats import Stats

log = logging.getLogger("fleetd.hints")
T = TypeVar("T")
SEND_BATCH_MAX = 10  # SendMessageBatch limit
SEND_CONCURRENCY = 16  # batch calls in flight at once (the SQS client pool holds more)
# Connection ids in one message: a hand-over of N streams costs N / 100 SendMessageBatch calls, not
# N / 10 (SQS bills per call), in 0.5 KB messages; a receive still spreads a burst over peers ten
# messages at a time.
IDS_PER_MESSAGE = 10
STREAM_LINGER_S = 0.05  # a HintStream sends what it has after this, even short of a full batch
# A received hint is handled in milliseconds.  A short visibility timeout bounds how long a
# hint swallowed by a dying receiver stays hidden from peers; a duplicate only costs a failed claim.
VISIBILITY_S = 3


@dataclass(frozen=True, slots=True)
class Offer:
    """A stream a stopping session closed and flushed, offered to whichever peer takes it first."""

    connection_id: str
    epoch: int
    last_seq: int  # -1: the stream has no resume point


@dataclass(frozen=True, slots=True)
class Hint:
    """One received message: the connections it names and its receipt (acked or given back as one)."""

    connection_ids: tuple[str, ...]
    receipt: str
    dead_session: str = ""  # a DEAD_SESSION message (it names no connection)
    offered_by: str = ""  # an OFFER message: the stopping session, its offering token, and what it offers
    offer_token: str = ""
    offers: tuple[Offer, ...] = ()


def dead_session_body(session_id: str) -> str:
    return orjson.dumps({"type": "DEAD_SESSION", "session_id": session_id}).decode()


def offer_body(session_id: str, token: str, offers: Sequence[Offer]) -> str:
    return orjson.dumps({"type": "OFFER", "session_id": session_id, "token": token,
                         "offers": [[o.connection_id, o.epoch, o.last_seq] for o in offers]}).decode()


def start_body(connection_ids: Sequence[str]) -> str:
    if len(connection_ids) == 1:
        return orjson.dumps({"type": "START", "connection_id": connection_ids[0]}).decode()
    return orjson.dumps({"type": "START", "connection_ids": list(connection_ids)}).decode()


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

    async def receive(self, max_ids: int) -> list[Hint]:
        """One long poll for about ``max_ids`` connections; malformed messages are counted, deleted and skipped."""
        url = await self._queue_url()
        messages = -(-max_ids // IDS_PER_MESSAGE)
        resp = await self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=max(1, min(10, messages)),
                                              WaitTimeSeconds=self.wait_s, VisibilityTimeout=VISIBILITY_S)
        hints: list[Hint] = []
        for msg in resp.get("Messages", []):
            hint = _parse(msg.get("Body", ""), msg["ReceiptHandle"])
            if hint is None:
                self.stats.inc("hints_total", kind="malformed")
                log.warning("malformed hint dropped", extra={"body": str(msg.get("Body", ""))[:200]})
                await self.ack([msg["ReceiptHandle"]])
                continue
            kind = "dead_session" if hint.dead_session else "offered" if hint.offered_by else "received"
            self.stats.inc("hints_total", float(len(hint.connection_ids) or 1), kind=kind)
            hints.append(hint)
        return hints

    async def ack(self, receipts: Iterable[str]) -> None:
        for chunk in _chunks(list(receipts)):
            entries = [{"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(chunk)]
            await self.sqs.delete_message_batch(QueueUrl=await self._queue_url(), Entries=entries)

    async def requeue(self, receipts: Iterable[str]) -> None:
        """Make hints we cannot use visible to peers again at once (we are full, or stopping)."""
        handles = list(receipts)
        for chunk in _chunks(handles):
            entries = [{"Id": str(i), "ReceiptHandle": r, "VisibilityTimeout": 0} for i, r in enumerate(chunk)]
            await self.sqs.change_message_visibility_batch(QueueUrl=await self._queue_url(), Entries=entries)
        self.stats.inc("hints_total", float(len(handles)), kind="returned")

    async def send_start(self, connection_ids: Iterable[str]) -> int:
        """Send START hints, ``IDS_PER_MESSAGE`` ids a message, ten messages a call, several calls
        in flight; returns how many ids were accepted (failures are logged and counted)."""
        messages = [(start_body(ids), len(ids)) for ids in _chunks(list(connection_ids), IDS_PER_MESSAGE)]
        return await self._send(messages, "START")

    async def _send(self, messages: list[tuple[str, int]], kind: str) -> int:
        """Send (body, how many it names) messages, ten a call, several calls in flight."""
        sem = asyncio.Semaphore(SEND_CONCURRENCY)

        async def one(chunk: list[tuple[str, int]]) -> int:
            entries = [{"Id": str(j), "MessageBody": body} for j, (body, _) in enumerate(chunk)]
            sizes = [n for _, n in chunk]
            async with sem:
                try:
                    resp = await self.sqs.send_message_batch(QueueUrl=await self._queue_url(), Entries=entries)
                except Exception as e:
                    log.warning(f"sending {kind} hints failed", extra={"count": sum(sizes), "code": error_code(e)})
                    self.stats.inc("hints_total", float(sum(sizes)), kind="send_failed")
                    return 0
            ok = sum(sizes[int(r["Id"])] for r in resp.get("Successful", []))
            self.stats.inc("hints_total", float(ok), kind="sent")
            if ok < sum(sizes):
                self.stats.inc("hints_total", float(sum(sizes) - ok), kind="send_failed")
            return ok

        return sum(await asyncio.gather(*(one(c) for c in _chunks(messages))))

    async def send_offers(self, session_id: str, token: str, offers: Sequence[Offer]) -> int:
        """Offer these streams to peers, ``IDS_PER_MESSAGE`` a message; returns how many were accepted."""
        bodies = [(offer_body(session_id, token, part), len(part))
                  for part in _chunks(list(offers), IDS_PER_MESSAGE)]
        return await self._send(bodies, "OFFER")

    async def send_dead_session(self, session_id: str, copies: int) -> None:
        """Tell up to ``copies`` peers (each message wakes the one that receives it) that
        ``session_id`` is expired and its streams are theirs to take now."""
        entries = [{"Id": str(i), "MessageBody": dead_session_body(session_id)} for i in range(min(copies, 10))]
        await self.sqs.send_message_batch(QueueUrl=await self._queue_url(), Entries=entries)


class HintStream:
    """START hints sent while the releases they announce are still running.

    A stopping shard used to release all its streams and then hint them all, so the first
    peer claim waited for the last release.  Here a full batch (or whatever ``STREAM_LINGER_S``
    collected) goes out at once, and peers claim while the rest is being released.
    """

    def __init__(self, hints: Hints, batch: int = SEND_BATCH_MAX * IDS_PER_MESSAGE,
                 linger_s: float = STREAM_LINGER_S) -> None:
        self.hints = hints
        self.batch = batch
        self.linger_s = linger_s
        self.pending: list[str] = []
        self.sends: dict[asyncio.Task[int], int] = {}  # send → how many ids it carries
        self._timer: asyncio.TimerHandle | None = None

    def add(self, connection_id: str) -> None:
        self.pending.append(connection_id)
        if len(self.pending) >= self.batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.pending:
            return
        task = asyncio.ensure_future(self.hints.send_start(self.pending))
        self.sends[task] = len(self.pending)
        self.pending = []
        task.add_done_callback(self.sends.pop)

    async def close(self, timeout_s: float) -> int:
        """Send what is pending and wait up to ``timeout_s`` for every send; returns how many ids
        were still unsent then (their sends are cancelled; failed sends ``send_start`` counted)."""
        self._flush()
        if not self.sends:
            return 0
        _, late = await asyncio.wait(set(self.sends), timeout=timeout_s)
        unsent = sum(self.sends.get(task, 0) for task in late)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
        return unsent


def _chunks(items: list[T], size: int = SEND_BATCH_MAX) -> Iterator[list[T]]:
    """SQS batch calls take at most ten entries."""
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _parse(body: str, receipt: str) -> Hint | None:
    """The hint a START, DEAD_SESSION or OFFER body makes; None when it is none of them, well formed."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    kind, sid = obj.get("type"), obj.get("session_id")
    if kind == "DEAD_SESSION":
        return Hint((), receipt, dead_session=sid) if isinstance(sid, str) and sid else None
    if kind == "OFFER":
        offers, token = _offers(obj.get("offers")), obj.get("token", "")
        if not offers or not isinstance(sid, str) or not sid or not isinstance(token, str):
            return None
        return Hint(tuple(o.connection_id for o in offers), receipt, offered_by=sid, offer_token=token, offers=offers)
    if kind != "START":
        return None
    single, many = obj.get("connection_id"), obj.get("connection_ids")
    ids = [single] if many is None else many
    if not isinstance(ids, list) or not ids or not all(isinstance(c, str) and c for c in ids):
        return None
    return Hint(tuple(ids), receipt)


def _offers(raw: Any) -> tuple[Offer, ...]:
    """[[id, epoch, last_seq], …] as offers, each malformed entry left out (the others stay takeable)."""
    if not isinstance(raw, list):
        return ()
    return tuple(Offer(e[0], e[1], e[2]) for e in raw
                 if isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[0]
                 and all(type(v) is int for v in e[1:]) and e[1] >= 1 and e[2] >= -1)
