"""The network between each simulated process and each simulated AWS service, and the SDK clients.

Model
-----
* Every SDK *attempt* is a :class:`Request` sent at the caller's virtual time.  It
  reaches the service after a seeded latency and is **applied there, at its arrival
  time on the shared timeline**, whatever the caller does meanwhile (a cancelled
  ``await`` never recalls a request already sent; a crashed process's requests still
  land).  The answer travels back and is delivered onto the caller's event loop with
  ``call_at`` at its arrival time (a paused process sees it when it resumes).
* Per attempt, a seeded fault (only for attempts *sent* inside the fault window
  ``[0, FaultMix.until]``; scripted :meth:`Network.rule` s apply at any time):

  ========== ===================================================================
  ``ok``        normal latency both ways
  ``delay``     applied; the answer arrives late but before the read timeout
  ``slow``      applied; the answer arrives after the read timeout (caller: ReadTimeoutError)
  ``lost``      applied; the answer is lost (caller: ReadTimeoutError, the SDK retries the
                very same request, same parameters, same ``:now`` values)
  ``dup``       applied, answered, and applied **again** 1-5 s later (a retry sent before a
                timeout that lands late); the second answer goes nowhere
  ``throttle``  not applied; ``ProvisionedThroughputExceededException`` (400, retryable)
  ``5xx``       not applied; ``InternalServerError`` (500, retryable)
  ``blackhole`` never applied, never answered (caller: ReadTimeoutError)
  ========== ===================================================================

* :class:`SimClient` behaves like an aiobotocore client configured with
  ``retries={"mode": "standard", "total_max_attempts": N}`` and ``read_timeout``:
  retryable errors are throttling codes, 5xx, ``RequestTimeout*`` and read timeouts;
  backoff is botocore's legacy-standard ``random() * min(2 ** (attempt - 1), 20)``; the
  retry quota (500 tokens, 5 per retry, 10 per timeout retry, +1 per first-try success,
  refund on a retried success) is per client as in botocore.  A final ``ClientError``
  carries ``ResponseMetadata.RetryAttempts``; a final timeout is botocore's
  ``ReadTimeoutError`` (no metadata).

Not modelled: connect timeouts distinct from read timeouts, connection pools (no limit
on requests in flight), request signing or serialization errors, partial reads,
``x-amz-retry-after``, botocore's parameter validation.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from botocore.exceptions import ClientError, ReadTimeoutError

from bench.sim.vloop import Scheduler, VirtualLoop

FAULTS = ("delay", "slow", "lost", "dup", "throttle", "5xx", "blackhole")
APPLIED = frozenset({"ok", "delay", "slow", "lost", "dup"})
_THROTTLE_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "TransactionInProgressException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled", "SlowDown",
    "PriorRequestNotComplete", "EC2ThrottledException"})
_TRANSIENT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete"})

Reply = Callable[[dict[str, Any] | Exception], None]


class Service(Protocol):
    """A simulated AWS service: apply one request now; ``reply`` now or later (a long poll)."""

    def apply(self, op: str, params: dict[str, Any], reply: Reply) -> None: ...


def client_error(code: str, message: str, op: str, status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": 0}}, op)


@dataclass(slots=True)
class Request:
    """One SDK attempt on the wire."""

    rid: int
    proc: str
    service: str
    op: str
    params: dict[str, Any]
    attempt: int
    sent_at: float
    fault: str = "ok"

    @property
    def table(self) -> str:
        return str(self.params.get("TableName") or self.params.get("QueueUrl") or "")


Predicate = Callable[[Request], bool]


@dataclass(slots=True)
class Rule:
    """A scripted fault: the next ``times`` requests matching ``match`` get ``fault``."""

    match: Predicate
    fault: str
    times: int = 1
    delay_s: float | None = None  # for delay/slow/dup: how late (answer or second application)


@dataclass(slots=True)
class FaultMix:
    """Seeded per-attempt fault rates, on for requests sent in ``[0, until]``."""

    until: float = 0.0
    rates: dict[str, float] = field(default_factory=dict)
    latency_s: tuple[float, float] = (0.001, 0.02)
    sqs_factor: float = 0.3  # SQS sees this share of the DynamoDB fault rates
    bursts: list[tuple[float, float, str]] = field(default_factory=list)  # (from, to, fault): half of all requests

    @classmethod
    def random(cls, rng: random.Random, until: float) -> FaultMix:
        """Calm, moderate or brutal, with a seeded mix of kinds."""
        level = rng.choice((0.0, 0.0, 0.02, 0.05, 0.1, 0.2, 0.35))
        kinds = [k for k in FAULTS if rng.random() < 0.7] or [rng.choice(FAULTS)]
        weights = {k: rng.random() for k in kinds}
        total = sum(weights.values())
        return cls(until, {k: level * w / total for k, w in weights.items()},
                   (0.0005, rng.choice((0.005, 0.02, 0.1))))


class Network:
    """Carries requests between clients and services (see the module docstring)."""

    def __init__(self, sched: Scheduler, rng: random.Random, services: dict[str, Service], mix: FaultMix) -> None:
        self.sched = sched
        self.rng = rng
        self.services = services
        self.mix = mix
        self.rules: list[Rule] = []
        self._ids = itertools.count(1)
        self.on_send: list[Callable[[Request], None]] = []
        self.on_apply: list[Callable[[Request, dict[str, Any] | Exception], None]] = []
        self.trace: Callable[[str], None] | None = None
        self.sent = 0
        self.applied = 0

    def rule(self, match: Predicate, fault: str, times: int = 1, delay_s: float | None = None) -> Rule:
        """Script a fault for specific requests (scenarios); rules win over the seeded mix."""
        r = Rule(match, fault, times, delay_s)
        self.rules.append(r)
        return r

    def _choose(self, req: Request) -> tuple[str, float | None]:
        for r in self.rules:
            if r.times > 0 and r.match(req):
                r.times -= 1
                return r.fault, r.delay_s
        mix = self.mix
        if req.sent_at > mix.until or req.service == "cloudwatch":
            return "ok", None
        x = self.rng.random()
        for start, end, kind in mix.bursts:
            if start <= req.sent_at <= end and x < 0.5:
                return kind, None
        if req.service == "sqs":
            x /= mix.sqs_factor
        for kind, p in mix.rates.items():
            if x < p:
                return kind, None
            x -= p
        return "ok", None

    def _latency(self) -> float:
        lo, hi = self.mix.latency_s
        return lo + (hi - lo) * self.rng.random() ** 3  # mostly fast, a tail of slow ones

    def send(self, client: SimClient, op: str, params: dict[str, Any], attempt: int) -> asyncio.Future[Any]:
        """Put one attempt on the wire; the future resolves on the caller's loop (answer or timeout)."""
        now = self.sched.vt.now
        req = Request(next(self._ids), client.proc, client.service, op, params, attempt, now)
        req.fault, extra = self._choose(req)
        self.sent += 1
        for hook in self.on_send:
            hook(req)
        loop = client.loop
        fut: asyncio.Future[Any] = loop.create_future()
        timeout = loop.call_at(now + client.read_timeout_s, _timeout, fut, req)
        if self.trace:
            self.trace(f"send #{req.rid} {req.proc} {op} {_short_table(req.table)}{_key(params)} a{attempt} "
                       f"fault={req.fault}")
        arrive = now + self._latency()
        if req.fault in ("throttle", "5xx"):
            err = (client_error("ProvisionedThroughputExceededException", "simulated throttling", op)
                   if req.fault == "throttle" else client_error("InternalServerError", "simulated 5xx", op, 500))
            self._answer(req, client, fut, timeout, err, arrive)
        elif req.fault != "blackhole":
            self.sched.at(arrive, lambda: self._apply(req, client, fut, timeout, extra))
            if req.fault == "dup":
                again = arrive + (extra if extra is not None else 1.0 + 4.0 * self.rng.random())
                self.sched.at(again, lambda: self._apply(req, client, None, None, None))
        return fut

    def _apply(self, req: Request, client: SimClient, fut: asyncio.Future[Any] | None,
               timeout: asyncio.TimerHandle | None, extra: float | None) -> None:
        self.applied += 1

        def reply(resp: dict[str, Any] | Exception) -> None:
            for hook in self.on_apply:
                hook(req, resp)
            if self.trace:
                self.trace(f"apply #{req.rid} {req.proc} {req.op} -> {_summary(resp)}")
            if fut is None or timeout is None or req.fault == "lost":
                return
            at = self.sched.vt.now + self._latency()
            if req.fault == "delay":
                at += extra if extra is not None else self.rng.random() * client.read_timeout_s * 0.9
            elif req.fault == "slow":
                at += client.read_timeout_s + (extra if extra is not None else self.rng.random())
            self._answer(req, client, fut, timeout, resp, at)

        self.services[req.service].apply(req.op, req.params, reply)

    def _answer(self, req: Request, client: SimClient, fut: asyncio.Future[Any], timeout: asyncio.TimerHandle,
                resp: dict[str, Any] | Exception, at: float) -> None:
        client.loop.call_at(at, _deliver, fut, timeout, resp, req, self.trace)


def _deliver(fut: asyncio.Future[Any], timeout: asyncio.TimerHandle, resp: dict[str, Any] | Exception,
             req: Request, trace: Callable[[str], None] | None) -> None:
    if fut.done():
        return  # timed out or cancelled: the answer is dropped on the floor
    timeout.cancel()
    if trace:
        trace(f"answer #{req.rid} {req.proc} {req.op} -> {_summary(resp)}")
    if isinstance(resp, Exception):
        fut.set_exception(resp)
    else:
        fut.set_result(resp)


def _timeout(fut: asyncio.Future[Any], req: Request) -> None:
    if not fut.done():
        fut.set_exception(ReadTimeoutError(endpoint_url=f"https://{req.service}.sim/{req.op}#{req.rid}"))


def _summary(resp: dict[str, Any] | Exception) -> str:
    if isinstance(resp, ClientError):
        return str(resp.response.get("Error", {}).get("Code"))
    if isinstance(resp, Exception):
        return type(resp).__name__
    return "ok"


def _key(params: dict[str, Any]) -> str:
    key = params.get("Key")
    if not key:
        return ""
    return "[" + ",".join(str(next(iter(v.values()))) for v in key.values()) + "]"


def _short_table(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class _Quota:
    """botocore's per-client retry quota (legacy-standard costs)."""

    __slots__ = ("available",)
    MAX = 500

    def __init__(self) -> None:
        self.available = self.MAX

    def acquire(self, amount: int) -> bool:
        if amount > self.available:
            return False
        self.available -= amount
        return True

    def release(self, amount: int) -> None:
        self.available = min(self.MAX, self.available + amount)


def _retryable(err: Exception) -> bool:
    if isinstance(err, ReadTimeoutError):
        return True
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 400))
        return code in _THROTTLE_CODES or code in _TRANSIENT_CODES or status in (500, 502, 503, 504)
    return False


class SimClient:
    """An aiobotocore-like client of one process for one service (standard retry mode)."""

    def __init__(self, net: Network, loop: VirtualLoop, proc: str, service: str, read_timeout_s: float,
                 max_attempts: int, rng: random.Random) -> None:
        self.net = net
        self.loop = loop
        self.proc = proc
        self.service = service
        self.read_timeout_s = read_timeout_s
        self.max_attempts = max_attempts
        self.rng = rng
        self.quota = _Quota()

    async def _call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        attempt, acquired = 1, 0
        while True:
            try:
                resp: dict[str, Any] = await self.net.send(self, op, params, attempt)
            except (ClientError, ReadTimeoutError) as e:
                err: Exception = e
            else:
                self.quota.release(acquired or 1)
                return resp
            cost = 10 if isinstance(err, ReadTimeoutError) else 5
            if _retryable(err) and attempt < self.max_attempts and self.quota.acquire(cost):
                acquired = cost
                await asyncio.sleep(self.rng.random() * min(2 ** (attempt - 1), 20))
                attempt += 1
                continue
            raise _final(err, op, attempt)


def _final(err: Exception, op: str, attempt: int) -> Exception:
    if not isinstance(err, ClientError):
        return err
    response = copy.deepcopy(err.response)
    response.setdefault("ResponseMetadata", {})["RetryAttempts"] = attempt - 1
    final: Exception = ClientError(response, op)
    return final


class DynamoClient(SimClient):
    async def update_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("UpdateItem", kw)

    async def get_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("GetItem", kw)

    async def put_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("PutItem", kw)

    async def delete_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("DeleteItem", kw)

    async def query(self, **kw: Any) -> dict[str, Any]:
        return await self._call("Query", kw)

    async def scan(self, **kw: Any) -> dict[str, Any]:
        return await self._call("Scan", kw)

    async def batch_get_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("BatchGetItem", kw)

    async def batch_write_item(self, **kw: Any) -> dict[str, Any]:
        return await self._call("BatchWriteItem", kw)

    async def describe_table(self, **kw: Any) -> dict[str, Any]:
        return await self._call("DescribeTable", kw)


class SqsClient(SimClient):
    async def get_queue_url(self, **kw: Any) -> dict[str, Any]:
        return await self._call("GetQueueUrl", kw)

    async def send_message(self, **kw: Any) -> dict[str, Any]:
        return await self._call("SendMessage", kw)

    async def send_message_batch(self, **kw: Any) -> dict[str, Any]:
        return await self._call("SendMessageBatch", kw)

    async def receive_message(self, **kw: Any) -> dict[str, Any]:
        return await self._call("ReceiveMessage", kw)

    async def delete_message_batch(self, **kw: Any) -> dict[str, Any]:
        return await self._call("DeleteMessageBatch", kw)

    async def change_message_visibility_batch(self, **kw: Any) -> dict[str, Any]:
        return await self._call("ChangeMessageVisibilityBatch", kw)


class CloudWatchClient(SimClient):
    async def put_metric_data(self, **kw: Any) -> dict[str, Any]:
        return await self._call("PutMetricData", kw)
