"""What the shard unit tests share: components assembled as ``runtime.assemble`` does, on a ManualClock.

A :class:`Rig` is one shard's components against the test's fresh tables (dynalite) and queue (moto),
with real clients and an injected :class:`~fleetd.clock.ManualClock`: no loop of the shard runs unless
a test starts one, so the clock only moves when the test moves it.  Upstream sockets are fakes
(:class:`Upstreams`): a connect succeeds at once and the socket stays open until closed or fenced.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from aiobotocore.session import get_session

from bench import profile
from fleetd import config
from fleetd.aws import Clients, open_clients
from fleetd.clock import ManualClock
from fleetd.config import Config
from fleetd.items import new_item
from fleetd.lease import STOPPED, ConnItem, LeaseStore, SessionInfo
from fleetd.shard.runtime import Components, assemble
from fleetd.shard.session import Identity
from fleetd.stats import Stats
from fleetd.tracing import NULL, Attr, Tenure, Tracer
from fleetd.upstream import Connector

URL = "ws://upstream.test/{cid}"
# One botocore session for every test: it caches the service models, so opening a test's clients costs
# milliseconds instead of a few hundred (clients are still opened per test, on the test's loop).
AIO = get_session()


def fast(cfg: Config, **overrides: Any) -> Config:
    """The shared fast profile on the test's tables (TTL 6 s, margin 1 s: a session's first fence deadline
    is 5 s after its open on the ManualClock)."""
    return profile.fast(cfg, **overrides)


# ----- fake upstream sockets ------------------------------------------------------------------------


class _Paused:
    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class FakeSocket:
    """A picows-like transport that delivers nothing; a CLOSE is echoed only when the test says so
    (``echo_close=False`` keeps a polite close waiting, to act while it is in flight)."""

    def __init__(self, url: str, echo_close: bool) -> None:
        self.url = url
        self.echo_close = echo_close
        self.is_disconnected = False
        self.is_close_frame_sent = False
        self.underlying_transport = _Paused()
        self._gone = asyncio.Event()

    def send_close(self, code: Any = None) -> None:
        self.is_close_frame_sent = True
        if self.echo_close:
            self.disconnect()

    def disconnect(self, graceful: bool = True) -> None:
        self.is_disconnected = True
        self._gone.set()

    async def wait_disconnected(self) -> None:
        await self._gone.wait()


@dataclass
class Upstreams:
    """The ``connect`` seam: records every socket opened, by URL."""

    echo_close: bool = True
    sockets: list[FakeSocket] = field(default_factory=list)

    async def connect(self, listener_factory: Callable[[], Any], url: str, **_: Any) -> tuple[FakeSocket, Any]:
        sock = FakeSocket(url, self.echo_close)
        self.sockets.append(sock)
        return sock, listener_factory()

    def urls(self) -> list[str]:
        return [s.url for s in self.sockets]

    def open(self) -> list[str]:
        return [s.url for s in self.sockets if not s.is_disconnected]


# ----- a tracer that records ----------------------------------------------------------------------------


@dataclass
class Recorded(Tenure):
    """One tenure as the shard reported it: how it began, its events, and every end called on it."""

    connection_id: str
    session_id: str
    epoch: int
    resume_seq: int | None
    attrs: dict[str, Attr]
    events: list[tuple[str, dict[str, Attr]]] = field(default_factory=list)
    ends: list[tuple[str, dict[str, Attr]]] = field(default_factory=list)

    def event(self, name: str, **attrs: Attr) -> None:
        self.events.append((name, attrs))

    def end(self, reason: str, **attrs: Attr) -> None:
        self.ends.append((reason, attrs))


class Recorder(Tracer):
    """The tenures a shard began, without OpenTelemetry (its spans are the null ones)."""

    def __init__(self) -> None:
        self.tenures: list[Recorded] = []

    def tenure(self, connection_id: str, session_id: str, epoch: int, resume_seq: int | None,
               **attrs: Attr) -> Tenure:
        t = Recorded(connection_id, session_id, epoch, resume_seq, attrs)
        self.tenures.append(t)
        return t

    def of(self, cid: str) -> list[Recorded]:
        return [t for t in self.tenures if t.connection_id == cid]


async def settle(rounds: int = 5) -> None:
    """Let ready callbacks run (a connection task reaching its connect), without waiting on time."""
    for _ in range(rounds):
        await asyncio.sleep(0)


# ----- the rig -----------------------------------------------------------------------------------------


@dataclass
class Rig:
    cfg: Config
    clock: ManualClock
    stats: Stats
    clients: Clients
    parts: Components
    upstreams: Upstreams

    @property
    def leases(self) -> LeaseStore:
        return self.parts.ctx.leases

    @property
    def ddb(self) -> Any:
        return self.clients.dynamodb

    @property
    def me(self) -> str:
        return self.parts.session.session_id

    def count(self, name: str, **labels: str) -> float:
        return self.stats.counter(name, **labels)

    async def put_items(self, *ids: str, url: str = URL) -> None:
        """STARTED items as ``ctl start`` writes them (free, no last_seq)."""
        now = self.clock.now_ms()
        for cid in ids:
            await self.ddb.put_item(TableName=self.cfg.aws.connections_table,
                                    Item=new_item(cid, url.format(cid=cid), now))

    async def update(self, cid: str, expression: str, **values: Any) -> None:
        """One unconditional UpdateItem; ``values`` name ``:placeholders`` without the colon."""
        attrs = {f":{k}": ({"N": str(v)} if isinstance(v, int) else {"S": v}) for k, v in values.items()}
        await self.ddb.update_item(TableName=self.cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                                   UpdateExpression=expression, **({"ExpressionAttributeValues": attrs}
                                                                  if attrs else {}))

    async def stop_item(self, cid: str) -> None:
        await self.update(cid, "SET desired_state = :s", s=STOPPED)

    async def raw(self, cid: str) -> dict[str, Any]:
        resp = await self.ddb.get_item(TableName=self.cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                                       ConsistentRead=True)
        item: dict[str, Any] = resp.get("Item", {})
        return item

    async def item(self, cid: str) -> ConnItem:
        got = await self.leases.get(cid)
        assert got is not None, f"no item {cid}"
        return got

    async def owner(self, cid: str) -> str:
        return (await self.item(cid)).lease_owner

    async def session_record(self, sid: str) -> dict[str, Any]:
        resp = await self.ddb.get_item(TableName=self.cfg.aws.sessions_table, Key={"session_id": {"S": sid}},
                                       ConsistentRead=True)
        item: dict[str, Any] = resp.get("Item", {})
        return item

    async def open(self) -> str:
        """Open our session (as boot does); its fence deadline is ``now + TTL − margin``."""
        outcome = await self.parts.session.open()
        assert outcome.value == "won", outcome
        return self.me

    async def peer_session(self, sid: str, capacity: int = 10) -> None:
        """Another shard's live session (created now on our clock)."""
        assert (await self.leases.create_session(SessionInfo(sid, "peer", 0, capacity))).value == "won"

    async def claim_as(self, owner: str, *ids: str) -> None:
        """Items owned by ``owner`` (a peer, a dead session, or our own strays)."""
        for cid in ids:
            result = await self.leases.claim(cid, owner, dead_owner=owner)
            assert result.outcome.value == "won", (cid, result)

    async def queued_hints(self) -> int:
        """Messages in the hints queue (visible or in flight), without receiving them."""
        sqs = self.clients.sqs
        url = (await sqs.get_queue_url(QueueName=self.cfg.aws.hints_queue))["QueueUrl"]
        attrs = (await sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        ))["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])

    async def hinted_ids(self) -> list[str]:
        """The connection ids named by the START hints queued now (received, then left to expire)."""
        hints = await self.parts.ctx.hints.receive(100)
        return sorted(cid for h in hints for cid in h.connection_ids)

    async def background(self) -> None:
        """Wait for the session's background tasks (a replacement opened from a send's check)."""
        tasks = list(self.parts.session.tasks._tasks)
        if tasks:
            await asyncio.gather(*tasks)


def wrap(obj: Any, name: str, around: Callable[..., Awaitable[Any]]) -> None:
    """Replace the coroutine method ``obj.name`` by ``around(original, *args, **kwargs)``: a test acts
    between a request's send and its answer (moves the clock, abandons the session)."""
    original = getattr(obj, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        return await around(original, *args, **kwargs)

    setattr(obj, name, wrapped)


@asynccontextmanager
async def rig(cfg: Config, capacity: int = 10, echo_close: bool = True, tracer: Tracer = NULL,
              **overrides: Any) -> AsyncIterator[Rig]:
    """One shard's components on ``fast(cfg, **overrides)``, a ManualClock at the real wall time, and fake
    upstreams.  Session ids are ``task/0/n1``, ``task/0/n2``… in the order sessions are opened."""
    c = fast(cfg, **overrides)
    clock = ManualClock(time.time_ns() // 1_000_000)
    stats = Stats()
    nonces = itertools.count(1)
    ups = Upstreams(echo_close=echo_close)
    async with AsyncExitStack() as stack:
        clients = await open_clients(stack, c.aws, AIO)
        parts = assemble(c, clock, stats, clients, asyncio.Event(), Identity("task", 0, capacity,
                                                                             lambda: f"n{next(nonces)}"),
                         cast(Connector, ups.connect), tracer)  # a fake picows transport
        await parts.ctx.hints.resolve()
        try:
            yield Rig(c, clock, stats, clients, parts, ups)
        finally:
            parts.ctx.stopping.set()
            parts.holdings.fence_all("test_end")  # no connection task outlives the test
            for task in list(parts.session.tasks._tasks):
                task.cancel()


async def empty(cfg: Config) -> Config:
    """Delete every connection and session item (tables shared by a module); ``cfg`` with a new, empty
    queue (SQS allows one purge a minute)."""
    async with AsyncExitStack() as stack:
        clients = await open_clients(stack, cfg.aws, AIO)
        ddb = clients.dynamodb
        for table, key in ((cfg.aws.connections_table, "connection_id"), (cfg.aws.sessions_table, "session_id")):
            start: dict[str, Any] | None = None
            while True:
                page = await ddb.scan(TableName=table, ProjectionExpression=key,
                                      **({"ExclusiveStartKey": start} if start else {}))
                for item in page.get("Items", []):
                    await ddb.delete_item(TableName=table, Key={key: item[key]})
                start = page.get("LastEvaluatedKey")
                if not start:
                    break
        queue = f"{cfg.aws.hints_queue.split('-')[0]}-hints-{uuid.uuid4().hex[:8]}"
        await clients.sqs.create_queue(QueueName=queue)
    return config.replace(cfg, hints_queue=queue)
