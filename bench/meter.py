"""Measuring a system under test from outside: its processes (psutil) and its DynamoDB traffic.

:class:`MeteringProxy` sits between the system under test and dynalite (through
``AWS_ENDPOINT_URL_DYNAMODB``) and tallies every request by operation and table,
with the capacity units it consumed:

* base-table units are dynalite's own ``ConsumedCapacity`` (the proxy asks for it
  with ``ReturnConsumedCapacity=TOTAL``; dynalite sizes items like DynamoDB does);
  a write refused by its condition still costs DynamoDB one write unit;
* GSI write units are modelled from the request, because dynalite does not report
  them: a write that SETs an index key attribute moves the item in that index
  (delete + put = 2 units), a REMOVE takes it out (1), a PutItem/DeleteItem adds or
  removes one entry per index whose keys the item carries (1).  Index entries are
  KEYS_ONLY, so each is ≤ 1 KB.

Prices: the seed's basis, $1.25 per million write units and $0.25 per million read units.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil
from aiohttp import web

from bench.faults.proxy import FaultProxy, ProxyThread, _response, operation_of

USD_PER_WRITE_UNIT = 1.25e-6
USD_PER_READ_UNIT = 0.25e-6
_WRITES = frozenset({"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem"})
_READS = frozenset({"GetItem", "BatchGetItem", "Query", "Scan"})
_CLAUSE = re.compile(r"\b(SET|REMOVE|ADD|DELETE)\b", re.IGNORECASE)

IndexKeys = dict[str, dict[str, frozenset[str]]]  # table → index → key attribute names


@dataclass
class Usage:
    """Requests of one operation on one table, and the capacity they consumed."""

    calls: int = 0
    errors: int = 0
    write_units: float = 0.0
    read_units: float = 0.0
    index_write_units: float = 0.0

    def add(self, other: Usage) -> None:
        self.calls += other.calls
        self.errors += other.errors
        self.write_units += other.write_units
        self.read_units += other.read_units
        self.index_write_units += other.index_write_units

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "errors": self.errors, "write_units": self.write_units,
                "read_units": self.read_units, "index_write_units": self.index_write_units}


@dataclass
class Tally:
    """Usage by (operation, table); thread-safe snapshots."""

    by_key: dict[tuple[str, str], Usage] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: str, table: str, usage: Usage) -> None:
        with self.lock:
            self.by_key.setdefault((op, table), Usage()).add(usage)

    def snapshot(self) -> dict[tuple[str, str], Usage]:
        with self.lock:
            out = {}
            for k, v in self.by_key.items():
                out[k] = Usage()
                out[k].add(v)
            return out


def diff(after: dict[tuple[str, str], Usage], before: dict[tuple[str, str], Usage]) -> dict[tuple[str, str], Usage]:
    """``after − before`` per key (a window of traffic)."""
    out: dict[tuple[str, str], Usage] = {}
    for key, a in after.items():
        b = before.get(key, Usage())
        out[key] = Usage(a.calls - b.calls, a.errors - b.errors, a.write_units - b.write_units,
                         a.read_units - b.read_units, a.index_write_units - b.index_write_units)
    return out


class MeteringProxy(FaultProxy):
    """A transparent proxy that tallies DynamoDB requests and their capacity (see the module docstring)."""

    def __init__(self, upstream_url: str, index_keys: IndexKeys) -> None:
        super().__init__(upstream_url)
        self.index_keys = index_keys
        self.tally = Tally()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        op = operation_of(request, body)
        req: dict[str, Any] = orjson.loads(body) if body.startswith(b"{") else {}
        if op in _WRITES | _READS and "ReturnConsumedCapacity" not in req:
            req["ReturnConsumedCapacity"] = "TOTAL"
            body = orjson.dumps(req)
        up = await self._forward(request, body)
        try:
            self._account(op, req, up.status, orjson.loads(up.body) if up.body.startswith(b"{") else {})
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.tally.record(op, "?", Usage(calls=1, errors=1))
        return _response(up)

    def _account(self, op: str, req: dict[str, Any], status: int, resp: dict[str, Any]) -> None:
        table = str(req.get("TableName") or next(iter(req.get("RequestItems") or {"": 0})))
        usage = Usage(calls=1, errors=int(status >= 300))
        consumed = resp.get("ConsumedCapacity")
        units = sum(float(c.get("CapacityUnits", 0)) for c in consumed) if isinstance(consumed, list) \
            else float((consumed or {}).get("CapacityUnits", 0))
        if op in _WRITES:
            # A conditional write that fails still consumes one write unit in DynamoDB.
            usage.write_units = units if status < 300 else float("ConditionalCheckFailed" in str(resp.get("__type")))
            if status < 300:
                usage.index_write_units = self._index_writes(op, req)
        elif op in _READS:
            usage.read_units = units
        self.tally.record(op, table, usage)

    def _index_writes(self, op: str, req: dict[str, Any]) -> float:
        if op == "BatchWriteItem":
            total = 0.0
            for table, writes in (req.get("RequestItems") or {}).items():
                for w in writes:
                    item = (w.get("PutRequest") or {}).get("Item")
                    entries = self._entries(table, set(item)) if item is not None else None
                    total += len(self.index_keys.get(table, {})) if entries is None else entries
            return total
        table = str(req.get("TableName"))
        if op == "PutItem":
            return self._entries(table, set(req.get("Item") or {}))
        if op == "DeleteItem":
            return float(len(self.index_keys.get(table, {})))
        return self._update_index_writes(table, req)

    def _entries(self, table: str, attrs: set[str]) -> float:
        return float(sum(1 for keys in self.index_keys.get(table, {}).values() if keys <= attrs))

    def _update_index_writes(self, table: str, req: dict[str, Any]) -> float:
        set_attrs, removed = touched(str(req.get("UpdateExpression", "")), req.get("ExpressionAttributeNames") or {})
        total = 0.0
        for keys in self.index_keys.get(table, {}).values():
            if keys & removed:
                total += 1
            elif keys & set_attrs:
                total += 2
        return total


def touched(expression: str, names: dict[str, str]) -> tuple[set[str], set[str]]:
    """Attribute names an UpdateExpression sets (SET/ADD) and removes (REMOVE), ``#name`` resolved."""
    set_attrs: set[str] = set()
    removed: set[str] = set()
    parts = _CLAUSE.split(expression)
    for verb, clause in zip(parts[1::2], parts[2::2], strict=True):
        for action in clause.split(","):
            target = action.strip().split("=")[0].split(" ")[0].strip()
            if not target:
                continue
            name = names.get(target, target)
            (removed if verb.upper() == "REMOVE" else set_attrs).add(name)
    return set_attrs, removed


def index_keys(client: Any, tables: Iterable[str]) -> IndexKeys:
    """Key attributes of every GSI of ``tables`` (boto3 DynamoDB client)."""
    out: IndexKeys = {}
    for table in tables:
        desc = client.describe_table(TableName=table)["Table"]
        out[table] = {g["IndexName"]: frozenset(k["AttributeName"] for k in g["KeySchema"])
                      for g in desc.get("GlobalSecondaryIndexes", [])}
    return out


def start_metering(upstream_url: str, keys: IndexKeys) -> tuple[ProxyThread, MeteringProxy]:
    """A running metering proxy on its own thread; point ``AWS_ENDPOINT_URL_DYNAMODB`` at ``thread.url``."""
    proxy = MeteringProxy(upstream_url, keys)
    thread = ProxyThread(upstream_url, proxy=proxy)
    thread.start()
    return thread, proxy


# ----- processes ---------------------------------------------------------------------------------------

@dataclass
class ProcSample:
    at: float
    rss_bytes: int
    cpu_s: float
    processes: int


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that still exist."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return procs


def sample(pids: Iterable[int]) -> ProcSample:
    """RSS and CPU seconds (user + system) summed over the process trees of ``pids``."""
    rss, cpu, n = 0, 0.0, 0
    for p in tree(pids):
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system
                n += 1
        except psutil.NoSuchProcess:
            continue
    return ProcSample(time.monotonic(), rss, cpu, n)


class CpuWatch:
    """CPU seconds each group of process trees spends over a window, polled (``poll``) while it runs.

    Each process is credited with what it used between its first and its last poll, so one that
    exits mid-window (a killed or stopping task) keeps what was seen of it, and one started
    mid-window (a restarted shard) counts from zero.
    """

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.first: dict[tuple[str, int], float] = {}
        self.last: dict[tuple[str, int], float] = {}
        self.t0 = time.monotonic()
        self.t1 = self.t0
        self._poll(initial=True)

    def poll(self) -> None:
        self._poll(initial=False)

    def _poll(self, initial: bool) -> None:
        for group, roots in self.groups.items():
            for p in tree(roots):
                try:
                    t = p.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                key = (group, p.pid)
                self.first.setdefault(key, t.user + t.system if initial else 0.0)
                self.last[key] = t.user + t.system
        self.t1 = time.monotonic()

    def cores(self) -> dict[str, float]:
        """Mean cores busy per group over the window (1.0 = one core all the time)."""
        window = max(1e-3, self.t1 - self.t0)
        busy = dict.fromkeys(self.groups, 0.0)
        for (group, pid), cpu in self.last.items():
            busy[group] += cpu - self.first[(group, pid)]
        return {group: round(cpu / window, 2) for group, cpu in busy.items()}
