"""The simulated AWS services behind the network: DynamoDB (``bench.sim.dynamo``), SQS, CloudWatch.

Model
-----
* DynamoDB: ``SimDynamo.handle(op, params)`` applies one request at once (its own
  expression semantics, GSIs with per-write lag).  ``DescribeTable`` is answered here
  from the tables created through ``CreateTable`` (always ACTIVE).
* SQS: named queues; ``SendMessage(Batch)``, ``ReceiveMessage`` with a long poll in
  virtual time (answered when a message becomes visible or at ``WaitTimeSeconds``),
  ``MaxNumberOfMessages`` and ``VisibilityTimeout``, ``DeleteMessageBatch``,
  ``ChangeMessageVisibilityBatch``.  Messages handed to a receiver stay invisible for
  their visibility timeout even if the receiver died or gave up the poll.  Any receipt
  handle of a message deletes it; only the latest changes its visibility.
* CloudWatch: ``PutMetricData`` is accepted and dropped.

Not modelled: SQS message ordering guarantees beyond FIFO-by-arrival, message
retention limits, dead-letter queues, receive-count attributes, queue attributes;
DynamoDB capacity (throttling comes from the network's fault mix).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from botocore.exceptions import ClientError

from bench.sim.net import Reply, client_error
from bench.sim.vloop import Scheduler


class Dynamo(Protocol):
    def handle(self, op: str, params: dict[str, Any]) -> dict[str, Any]: ...


class DynamoService:
    """Applies DynamoDB requests to a SimDynamo."""

    def __init__(self, dynamo: Dynamo) -> None:
        self.dynamo = dynamo
        self.tables: set[str] = set()

    def create_table(self, params: dict[str, Any]) -> None:
        self.dynamo.handle("CreateTable", params)
        self.tables.add(params["TableName"])

    def apply(self, op: str, params: dict[str, Any], reply: Reply) -> None:
        try:
            resp = self.dynamo.handle(op, params)
        except ClientError as e:
            reply(e)
            return
        reply(resp)


class CloudWatchService:
    def apply(self, op: str, params: dict[str, Any], reply: Reply) -> None:
        reply({})


@dataclass(slots=True)
class _Message:
    mid: str
    body: str
    visible_at: float = 0.0
    receipt: str = ""
    deleted: bool = False


@dataclass(slots=True)
class _Waiter:
    deadline: float
    max_messages: int
    visibility_s: float
    reply: Reply
    done: bool = False


@dataclass(slots=True)
class _Queue:
    url: str
    messages: dict[str, _Message] = field(default_factory=dict)  # insertion order = arrival order
    waiters: list[_Waiter] = field(default_factory=list)


class SqsService:
    """Named queues with long polls on virtual time (see the module docstring)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.queues: dict[str, _Queue] = {}
        self.by_url: dict[str, _Queue] = {}
        self._ids = itertools.count(1)
        self._handles: dict[str, str] = {}  # receipt handle → message id

    def create_queue(self, name: str) -> str:
        url = f"https://sqs.sim/000000000000/{name}"
        q = _Queue(url)
        self.queues[name] = q
        self.by_url[url] = q
        return url

    def apply(self, op: str, params: dict[str, Any], reply: Reply) -> None:
        handler: Callable[[dict[str, Any], Reply], None] | None = getattr(self, "_" + op, None)
        if handler is None:
            reply(client_error("InvalidAction", f"{op} not simulated", op))
            return
        handler(params, reply)

    def _queue(self, url: str, op: str) -> _Queue:
        q = self.by_url.get(url)
        if q is None:
            raise client_error("AWS.SimpleQueueService.NonExistentQueue", "no such queue", op)
        return q

    def _GetQueueUrl(self, params: dict[str, Any], reply: Reply) -> None:
        q = self.queues.get(params["QueueName"])
        reply({"QueueUrl": q.url} if q else client_error("AWS.SimpleQueueService.NonExistentQueue",
                                                          "no such queue", "GetQueueUrl"))

    def _SendMessage(self, params: dict[str, Any], reply: Reply) -> None:
        try:
            q = self._queue(params["QueueUrl"], "SendMessage")
        except ClientError as e:
            reply(e)
            return
        mid = self._add(q, params["MessageBody"])
        reply({"MessageId": mid})
        self._serve(q)

    def _SendMessageBatch(self, params: dict[str, Any], reply: Reply) -> None:
        try:
            q = self._queue(params["QueueUrl"], "SendMessageBatch")
        except ClientError as e:
            reply(e)
            return
        ok = [{"Id": e["Id"], "MessageId": self._add(q, e["MessageBody"])} for e in params["Entries"]]
        reply({"Successful": ok, "Failed": []})
        self._serve(q)

    def _add(self, q: _Queue, body: str) -> str:
        mid = f"m{next(self._ids)}"
        q.messages[mid] = _Message(mid, body, self.sched.vt.now)
        return mid

    def _ReceiveMessage(self, params: dict[str, Any], reply: Reply) -> None:
        try:
            q = self._queue(params["QueueUrl"], "ReceiveMessage")
        except ClientError as e:
            reply(e)
            return
        now = self.sched.vt.now
        w = _Waiter(now + float(params.get("WaitTimeSeconds", 0)), int(params.get("MaxNumberOfMessages", 1)),
                    float(params.get("VisibilityTimeout", 30)), reply)
        if self._take(q, w) or w.deadline <= now:
            if not w.done:
                w.done = True
                reply({})
            return
        q.waiters.append(w)
        self.sched.at(w.deadline, lambda: self._expire(q, w))

    def _expire(self, q: _Queue, w: _Waiter) -> None:
        if not w.done:
            w.done = True
            q.waiters.remove(w)
            w.reply({})

    def _take(self, q: _Queue, w: _Waiter) -> bool:
        """Hand ``w`` the visible messages it may take; True if it got any (and was answered)."""
        now = self.sched.vt.now
        got: list[dict[str, Any]] = []
        for m in q.messages.values():
            if len(got) >= w.max_messages:
                break
            if m.visible_at <= now:
                m.receipt = f"r{next(self._ids)}"
                self._handles[m.receipt] = m.mid
                m.visible_at = now + w.visibility_s
                self._wake_at(q, m.visible_at)
                got.append({"MessageId": m.mid, "ReceiptHandle": m.receipt, "Body": m.body})
        if got:
            w.done = True
            w.reply({"Messages": got})
        return bool(got)

    def _serve(self, q: _Queue) -> None:
        """Answer waiting long polls, oldest first, while visible messages remain."""
        while q.waiters:
            w = q.waiters[0]
            if not self._take(q, w):
                return
            q.waiters.pop(0)

    def _wake_at(self, q: _Queue, when: float) -> None:
        self.sched.at(when, lambda: self._serve(q))

    def _DeleteMessageBatch(self, params: dict[str, Any], reply: Reply) -> None:
        try:
            q = self._queue(params["QueueUrl"], "DeleteMessageBatch")
        except ClientError as e:
            reply(e)
            return
        for entry in params["Entries"]:
            mid = self._handles.get(entry["ReceiptHandle"])
            if mid is not None:
                q.messages.pop(mid, None)
        reply({"Successful": [{"Id": entry["Id"]} for entry in params["Entries"]], "Failed": []})

    def _ChangeMessageVisibilityBatch(self, params: dict[str, Any], reply: Reply) -> None:
        try:
            q = self._queue(params["QueueUrl"], "ChangeMessageVisibilityBatch")
        except ClientError as e:
            reply(e)
            return
        now = self.sched.vt.now
        for entry in params["Entries"]:
            m = q.messages.get(self._handles.get(entry["ReceiptHandle"], ""))
            if m is not None and m.receipt == entry["ReceiptHandle"]:
                m.visible_at = now + float(entry["VisibilityTimeout"])
                self._wake_at(q, m.visible_at)
        reply({"Successful": [{"Id": entry["Id"]} for entry in params["Entries"]], "Failed": []})

