"""An HTTP fault proxy for the AWS JSON APIs (DynamoDB, SQS, …) of the local stack.

``FaultProxy`` sits between an aiobotocore client and a local server (dynalite,
moto) and misbehaves on demand, so tests exercise fleetd's real error paths
instead of mocks::

    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL_DYNAMODB"])
    url = await proxy.start()                    # on the test's own event loop
    async with client_via(cfg.aws, "dynamodb", url) as ddb:
        proxy.add("BatchWriteItem", "throttle", probability=0.3)
        proxy.add("UpdateItem", "drop_response", count=1, mode="reset")
        ...
    await proxy.stop()

Rules are matched against the operation name (the ``X-Amz-Target`` suffix, e.g.
``BatchWriteItem``, ``UpdateItem``, ``ReceiveMessage``; ``op=None`` matches every
request) in the order they were added.  Every matching ``latency`` rule delays
the request; the first matching rule with any other action decides what happens
to it; with none, the request is forwarded unchanged.  A rule fires with its
``probability`` and, when it has a ``count``, expires after firing that often.

Actions (``params`` in brackets):

* ``latency`` (``seconds``)  — delay, then carry on;
* ``stall`` (``until``)      — hold the request until ``until`` (epoch seconds), then carry on: DynamoDB
  stalled, every request arriving meanwhile applied and answered at the stall's end;
* ``error500`` / ``error503`` — answer 500 ``InternalServerError`` / 503
  ``ServiceUnavailable`` without forwarding;
* ``throttle`` (``code``)    — answer 400 ``ProvisionedThroughputExceededException``
  (or ``code``, e.g. ``ThrottlingException``) without forwarding;
* ``drop_response`` (``mode="500"|"reset"``) — forward, so the server applies the
  request, then lose the answer: a 500 or a reset connection (the ambiguous write);
* ``reset``                  — close the connection (TCP RST) without forwarding;
* ``blackhole`` (``seconds``, default 3600) — never answer: hold the request until
  the client gives up (its read timeout) or the proxy stops;
* ``unprocessed``            — BatchWriteItem / BatchGetItem: forward only the first
  half (rounded up, so progress is guaranteed) of the request's items or keys and
  return the rest as ``UnprocessedItems`` / ``UnprocessedKeys`` in a valid answer.

Whenever the proxy rewrites a response body it recomputes ``x-amz-crc32``, which
botocore verifies for DynamoDB.  ``proxy.calls[op]`` counts requests per
operation, faulted or not.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from aiohttp import web

from fleetd.aws import client_config, region_of
from fleetd.config import AwsConfig

ACTIONS = frozenset({"latency", "stall", "error500", "error503", "throttle", "drop_response", "reset", "blackhole",
                     "unprocessed"})
T = TypeVar("T")
DYNAMODB_ERROR_PREFIX = "com.amazonaws.dynamodb.v20120810#"
# Headers that describe one hop, not the message: never copied across the proxy.
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                          "proxy-connection", "te", "trailer", "upgrade"})


@dataclass(slots=True)
class Rule:
    """One fault: which operation, what to do, how often.  ``fired`` counts its firings."""

    op: str | None
    action: str
    probability: float = 1.0
    count: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    fired: int = 0

    def matches(self, op: str) -> bool:
        return self.op is None or self.op == op


@dataclass(slots=True)
class Upstream:
    """What the server answered to a forwarded request."""

    status: int
    headers: dict[str, str]
    body: bytes


Action = Callable[[web.BaseRequest, bytes, Rule], Awaitable[web.StreamResponse]]


class FaultProxy:
    """A reverse proxy for one upstream URL that injects faults by rule (see the module docstring)."""

    def __init__(self, upstream_url: str, seed: int | None = None) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.calls: collections.Counter[str] = collections.Counter()
        self.rules: list[Rule] = []
        self.url = ""
        self._rng = random.Random(seed)
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._actions: dict[str, Action] = {
            "error500": self._error500, "error503": self._error503, "throttle": self._throttle,
            "drop_response": self._drop_response, "reset": self._reset, "blackhole": self._blackhole,
            "unprocessed": self._unprocessed,
        }

    # ----- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> str:
        """Listen on a free loopback port; returns the proxy's URL."""
        # auto_decompress=False: bodies (and their x-amz-crc32) pass through byte for byte.
        self._session = aiohttp.ClientSession(auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._runner = web.ServerRunner(web.Server(self._handle), shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop listening; held (blackholed) requests are abandoned."""
        self._stopping = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----- rules -------------------------------------------------------------------------------------

    def add(self, op: str | None, action: str, probability: float = 1.0, count: int | None = None,
            **params: Any) -> Rule:
        """Add a rule (see the module docstring); returns it so a test can ``remove`` it or read ``fired``."""
        if action not in ACTIONS:
            raise ValueError(f"unknown fault action {action!r} (one of {', '.join(sorted(ACTIONS))})")
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1] (got {probability})")
        rule = Rule(op, action, probability, count, dict(params))
        self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        if rule in self.rules:
            self.rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule: from now on the proxy is transparent."""
        self.rules.clear()

    def _fire(self, rule: Rule) -> bool:
        """Whether ``rule`` fires for this request; spends one of its ``count``."""
        if rule.probability < 1.0 and self._rng.random() >= rule.probability:
            return False
        rule.fired += 1
        if rule.count is not None:
            rule.count -= 1
            if rule.count <= 0:
                self.remove(rule)
        return True

    async def _decide(self, op: str) -> Rule | None:
        """Apply latency rules; return the first other rule that fires (None: forward as is)."""
        for rule in list(self.rules):
            if not rule.matches(op) or not self._fire(rule):
                continue
            if rule.action == "latency":
                await asyncio.sleep(float(rule.params.get("seconds", 0.1)))
                continue
            if rule.action == "stall":
                await asyncio.sleep(max(0.0, float(rule.params["until"]) - time.time()))
                continue
            return rule
        return None

    # ----- request handling --------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        op = operation_of(request, body)
        self.calls[op] += 1
        rule = await self._decide(op)
        if rule is None:
            return _response(await self._forward(request, body))
        return await self._actions[rule.action](request, body, rule)

    async def _forward(self, request: web.BaseRequest, body: bytes) -> Upstream:
        assert self._session is not None, "FaultProxy.start() was not awaited"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(request.method, self.upstream_url + request.path_qs,
                                         headers=headers, data=body) as resp:
            data = await resp.read()
            kept = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            return Upstream(resp.status, kept, data)

    async def _error500(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        return _error(500, "InternalServerError", "injected by FaultProxy")

    async def _error503(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        return _error(503, "ServiceUnavailable", "injected by FaultProxy")

    async def _throttle(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        code = str(rule.params.get("code", "ProvisionedThroughputExceededException"))
        return _error(400, code, "The level of configured provisioned throughput for the table was exceeded "
                                 "(injected by FaultProxy)")

    async def _drop_response(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        await self._forward(request, body)  # the server applies it; the client never learns
        if str(rule.params.get("mode", "500")) == "reset":
            return _abort(request)
        return _error(500, "InternalServerError", "response dropped by FaultProxy")

    async def _reset(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        return _abort(request)

    async def _blackhole(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        # aiohttp does not cancel a handler when its client leaves, so poll for that.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(rule.params.get("seconds", 3600.0))
        while not self._stopping and loop.time() < deadline and not _client_gone(request):  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # a transport has no "closed" event to wait on
        return _abort(request)

    async def _unprocessed(self, request: web.BaseRequest, body: bytes, rule: Rule) -> web.StreamResponse:
        op = operation_of(request, body)
        if op not in _SPLITTERS:
            return _response(await self._forward(request, body))
        split, merge = _SPLITTERS[op]
        req = json.loads(body)
        forwarded, held_back = split(req)
        if not held_back:
            return _response(await self._forward(request, body))
        up = await self._forward(request, json.dumps(forwarded).encode())
        if up.status != 200:
            return _response(up)
        answer = json.loads(_decoded(up))
        merge(answer, held_back)
        up.headers.pop("Content-Encoding", None)
        return _response(up, json.dumps(answer).encode())


# ----- BatchWriteItem / BatchGetItem halves ------------------------------------------------------------

def _split_write(req: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request with the first half of the put/delete requests, the rest keyed by table)."""
    flat = [(table, r) for table, reqs in req.get("RequestItems", {}).items() for r in reqs]
    keep = (len(flat) + 1) // 2
    fwd: dict[str, list[Any]] = {}
    back: dict[str, list[Any]] = {}
    for i, (table, r) in enumerate(flat):
        (fwd if i < keep else back).setdefault(table, []).append(r)
    return dict(req, RequestItems=fwd), back


def _merge_write(answer: dict[str, Any], back: dict[str, Any]) -> None:
    unprocessed = answer.setdefault("UnprocessedItems", {})
    for table, reqs in back.items():
        unprocessed.setdefault(table, []).extend(reqs)


def _split_get(req: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request with the first half of the keys, the rest as UnprocessedKeys entries)."""
    tables = req.get("RequestItems", {})
    flat = [(table, k) for table, spec in tables.items() for k in spec.get("Keys", [])]
    keep = (len(flat) + 1) // 2
    fwd: dict[str, Any] = {}
    back: dict[str, Any] = {}
    for i, (table, key) in enumerate(flat):
        target = fwd if i < keep else back
        target.setdefault(table, dict(tables[table], Keys=[]))["Keys"].append(key)
    return dict(req, RequestItems=fwd), back


def _merge_get(answer: dict[str, Any], back: dict[str, Any]) -> None:
    unprocessed = answer.setdefault("UnprocessedKeys", {})
    for table, spec in back.items():
        if table in unprocessed:
            unprocessed[table]["Keys"].extend(spec["Keys"])
        else:
            unprocessed[table] = spec


_SPLITTERS: dict[str, tuple[Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]],
                            Callable[[dict[str, Any], dict[str, Any]], None]]] = {
    "BatchWriteItem": (_split_write, _merge_write),
    "BatchGetItem": (_split_get, _merge_get),
}


# ----- helpers -----------------------------------------------------------------------------------------

def operation_of(request: web.BaseRequest, body: bytes) -> str:
    """The API operation: JSON protocols name it in X-Amz-Target, rpc-v2 in the path, query in Action."""
    target = request.headers.get("X-Amz-Target", "")
    if target:
        return target.rpartition(".")[2]
    if "/operation/" in request.path:
        return request.path.rpartition("/")[2]
    if body.startswith(b"Action=") or b"&Action=" in body:
        return parse_qs(body.decode("utf-8", "replace")).get("Action", ["?"])[0]
    return "?"


def _error(status: int, code: str, message: str) -> web.Response:
    prefix = "" if "#" in code else DYNAMODB_ERROR_PREFIX
    body = json.dumps({"__type": prefix + code, "message": message}).encode()
    return web.Response(status=status, body=body, headers=_json_headers(body))


def _json_headers(body: bytes) -> dict[str, str]:
    return {"Content-Type": "application/x-amz-json-1.0", "x-amz-crc32": str(zlib.crc32(body) & 0xFFFFFFFF)}


def _response(up: Upstream, new_body: bytes | None = None) -> web.Response:
    headers = dict(up.headers)
    if new_body is not None:
        # botocore checks x-amz-crc32 against the body it receives.
        for name in [h for h in headers if h.lower() == "x-amz-crc32"]:
            del headers[name]
        headers["x-amz-crc32"] = str(zlib.crc32(new_body) & 0xFFFFFFFF)
    return web.Response(status=up.status, body=up.body if new_body is None else new_body, headers=headers)


def _decoded(up: Upstream) -> bytes:
    encoding = next((v for k, v in up.headers.items() if k.lower() == "content-encoding"), "")
    if encoding.lower() == "gzip":
        return zlib.decompress(up.body, 16 + zlib.MAX_WBITS)
    return up.body


def _client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _abort(request: web.BaseRequest) -> web.StreamResponse:
    """Reset the client's connection (RST, not FIN) and give aiohttp nothing to send."""
    transport = request.transport
    if transport is not None and not transport.is_closing():
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    # aiohttp drops the response of a handler whose connection is gone.
    return web.Response(status=500)


@asynccontextmanager
async def client_via(aws: AwsConfig, service: str, url: str,
                     total_attempts: int | None = None) -> AsyncIterator[Any]:
    """An aiobotocore client for ``service`` with fleetd's settings, aimed at ``url`` (a proxy).

    ``total_attempts`` overrides the SDK's retries (1 = none: every fault reaches the caller).
    """
    conf = client_config(aws)
    if total_attempts is not None:
        conf = conf.merge(AioConfig(retries={"mode": "standard", "total_max_attempts": total_attempts}))
    async with get_session().create_client(service, region_name=region_of(aws), endpoint_url=url,
                                           config=conf) as client:
        yield client


class ProxyThread:
    """A :class:`FaultProxy` on its own thread and event loop, for child processes to talk through.

    Fault tests and benchmarks run fleetd as separate processes; point their
    ``AWS_ENDPOINT_URL_*`` at :attr:`url`.  ``add`` / ``clear`` / ``remove`` are safe to
    call from the caller's thread (they run on the proxy's loop)::

        with ProxyThread(os.environ["AWS_ENDPOINT_URL_DYNAMODB"]) as px:
            env["AWS_ENDPOINT_URL_DYNAMODB"] = px.url
            rule = px.add("UpdateItem", "drop_response", probability=0.2)
    """

    def __init__(self, upstream_url: str, seed: int | None = None, proxy: FaultProxy | None = None) -> None:
        self.proxy = proxy if proxy is not None else FaultProxy(upstream_url, seed)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        started: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="fault-proxy", daemon=True)
        self._thread.start()
        self.url = started.result(timeout=30)
        return self.url

    def _run(self, started: concurrent.futures.Future[str]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            started.set_result(loop.run_until_complete(self.proxy.start()))
            loop.run_forever()
            loop.run_until_complete(self.proxy.stop())
        except BaseException as e:  # the caller waits on `started`: never leave it hanging
            if not started.done():
                started.set_exception(e)
            raise
        finally:
            loop.close()

    def _call(self, fn: Callable[[], T]) -> T:
        assert self._loop is not None, "ProxyThread.start() was not called"

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def add(self, op: str | None, action: str, probability: float = 1.0, count: int | None = None,
            **params: Any) -> Rule:
        return self._call(lambda: self.proxy.add(op, action, probability, count, **params))

    def remove(self, rule: Rule) -> None:
        self._call(lambda: self.proxy.remove(rule))

    def clear(self) -> None:
        self._call(self.proxy.clear)

    @property
    def calls(self) -> collections.Counter[str]:
        """Requests per operation so far (a copy)."""
        return self._call(lambda: collections.Counter(self.proxy.calls))

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop = None

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
