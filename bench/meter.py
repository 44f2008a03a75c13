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

Per key and second (:class:`HotKeys`), every unit is also charged to the partition key value it
lands on: ``table:value`` (the base table's hash key value) or ``table/index:value`` (a GSI's hash
key value), in one-second buckets of the proxy's clock, so :meth:`HotKeys.peak` tells the hottest
key of any window and its units/s.  A write that moves an item in a GSI charges one unit to the
entry it deletes (the *old* index hash value) and one to the entry it puts (the *new* one); an
index key SET to the value it already had moves nothing.  A write refused by its condition charges
one unit to its base key.  Reads are charged to the key they name (a Query to its hash key value,
on the table or the index); a Scan to none (it spreads over every partition).

Old index key values: a write names its new values (a plain ``SET a = :v``, ``REMOVE a``, a
PutItem's item) but seldom its old ones, so the proxy asks dynalite for them: a PutItem, UpdateItem
or DeleteItem on a table with GSIs sent without ``ReturnValues`` is forwarded with
``ReturnValues=ALL_OLD``, and the ``Attributes`` it brings back are cut from the answer before the
client sees it (``x-amz-crc32`` recomputed).  A write that asks for return values itself (a claim's
``ALL_NEW``), and BatchWriteItem, which cannot, learn the rest from a shadow map (item key → its
index key attributes) fed by every write and every read answer the proxy sees, and from the
condition's top-level ``attr = :v`` terms (true once the write succeeded).  A value known nowhere is
charged to the key ``?``; an attribute of unknown presence counts as in the index for an update or
delete and as absent for a put.

Throttling (``throttle=True``, off by default): a request whose base or index key has already been
charged its limit in the current second (:class:`KeyLimits`: DynamoDB's 1,000 write and 3,000 read
units per second per partition key value, a GSI key value alike) is answered 400
``ProvisionedThroughputExceededException`` without being forwarded, as DynamoDB answers, and costs
no units.  Fixed one-second windows, no burst credit.

Prices: the seed's basis, $1.25 per million write units and $0.25 per million read units.
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import psutil
from aiohttp import web

from bench.faults.proxy import FaultProxy, ProxyThread, _error, _response, operation_of

USD_PER_WRITE_UNIT = 1.25e-6
USD_PER_READ_UNIT = 0.25e-6
_WRITES = frozenset({"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem"})
_SINGLE_WRITES = frozenset({"PutItem", "UpdateItem", "DeleteItem"})
_READS = frozenset({"GetItem", "BatchGetItem", "Query", "Scan"})
_CLAUSE = re.compile(r"\b(SET|REMOVE|ADD|DELETE)\b", re.IGNORECASE)
_EQUALS = re.compile(r"^([#\w]+)\s*=\s*(:\w+)$")
_NOT_EXISTS = re.compile(r"^attribute_not_exists\s*\(\s*([#\w]+)\s*\)$", re.IGNORECASE)
THROTTLED = "ProvisionedThroughputExceededException"
THROTTLED_MESSAGE = ("The level of configured provisioned throughput for the table was exceeded. "
                     "Consider increasing your provisioning level with the UpdateTable API.")

Kind = Literal["write", "read"]
Known = dict[str, str | None]  # attribute → its value as text, None: absent; a missing attribute: unknown
UNKNOWN_VALUE = "?"  # an attribute present with a value the proxy cannot tell (set by an expression)


@dataclass(frozen=True)
class TableKeys:
    """A table's key attributes and, per GSI, the index's (hash, range or None)."""

    hash: str
    range: str | None = None
    indexes: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    def index_attrs(self, index: str) -> frozenset[str]:
        h, r = self.indexes[index]
        return frozenset({h} if r is None else {h, r})

    @property
    def gsi_attrs(self) -> frozenset[str]:
        return frozenset(a for index in self.indexes for a in self.index_attrs(index))

    def item_id(self, item: dict[str, Any]) -> str | None:
        """The item's primary key as text (None if ``item`` lacks it)."""
        if self.hash not in item or (self.range is not None and self.range not in item):
            return None
        return scalar(item[self.hash]) + ("" if self.range is None else "\x00" + scalar(item[self.range]))


Schemas = dict[str, TableKeys]


@dataclass(frozen=True)
class KeyLimits:
    """Units per second one partition key value (of a table or of a GSI) may take before DynamoDB throttles."""

    write_units_per_s: float = 1000.0
    read_units_per_s: float = 3000.0

    def of(self, kind: Kind) -> float:
        return self.write_units_per_s if kind == "write" else self.read_units_per_s


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


@dataclass(frozen=True)
class Peak:
    """The hottest key of one second: its units in that second (= units/s)."""

    units_per_s: float
    key: str
    second: int


class HotKeys:
    """Capacity units per key per second (``floor`` of the clock); thread-safe.

    The newest ``OPEN_SECONDS`` seconds are kept whole (a request is charged to the second it
    arrived in, even if answered later; one older than those goes to the oldest open second);
    older seconds are folded to their hottest key per kind, so memory grows with time, not keys.
    """

    OPEN_SECONDS = 3

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, dict[Kind, collections.defaultdict[str, float]]] = {}
        self._tops: dict[Kind, list[Peak]] = {"write": [], "read": []}
        self._refused: list[tuple[float, str]] = []

    def charge(self, kind: Kind, key: str, units: float, at: float) -> None:
        with self._lock:
            self._bucket(math.floor(at))[kind][key] += units

    def refuse(self, key: str, at: float) -> None:
        """Record a request throttled because of ``key``."""
        with self._lock:
            self._refused.append((at, key))

    def used(self, kind: Kind, key: str, at: float) -> float:
        """Units ``key`` took in the second of ``at`` so far."""
        with self._lock:
            bucket = self._open.get(math.floor(at))
            return bucket[kind].get(key, 0.0) if bucket is not None else 0.0

    def units(self, kind: Kind, at: float) -> dict[str, float]:
        """Every key's units in the second of ``at`` (an open second; empty once folded)."""
        with self._lock:
            bucket = self._open.get(math.floor(at))
            return dict(bucket[kind]) if bucket is not None else {}

    def peak(self, kind: Kind, since: float, until: float | None = None) -> Peak | None:
        """The hottest key's busiest second among the seconds that overlap ``[since, until]``."""
        end = math.inf if until is None else until
        with self._lock:
            peaks = [p for p in self._tops[kind] if since < p.second + 1 and p.second <= end]
            peaks += [_top(second, bucket[kind]) for second, bucket in self._open.items()
                      if since < second + 1 and second <= end and bucket[kind]]
        return max(peaks, key=lambda p: p.units_per_s, default=None)

    def refused(self, since: float, until: float | None = None) -> collections.Counter[str]:
        """Throttled requests in ``[since, until]`` per key that caused them."""
        end = math.inf if until is None else until
        with self._lock:
            return collections.Counter(key for at, key in self._refused if since <= at <= end)

    def _bucket(self, second: int) -> dict[Kind, collections.defaultdict[str, float]]:
        if self._open and second < min(self._open):
            second = min(self._open)
        if second not in self._open:
            self._open[second] = {"write": collections.defaultdict(float), "read": collections.defaultdict(float)}
            newest = max(self._open)
            for old in [s for s in self._open if s <= newest - self.OPEN_SECONDS]:
                for kind, units in self._open.pop(old).items():
                    if units:
                        self._tops[kind].append(_top(old, units))
        return self._open[second]


def _top(second: int, units: dict[str, float]) -> Peak:
    key, top = max(units.items(), key=lambda kv: kv[1])
    return Peak(top, key, second)


@dataclass
class ItemWrite:
    """One item a write touches: its key, what is known of its index key attributes before and after,
    and the attributes it changes (None: the whole item, a put or a delete)."""

    table: str
    keys: TableKeys
    key: dict[str, Any]
    old: Known
    new: Known
    touched: frozenset[str] | None
    put: bool = False

    def base_key(self) -> str:
        return key_label(self.table, None, scalar(self.key[self.keys.hash]))

    def index_keys(self) -> list[str]:
        """One key per index entry the write deletes (old value) or puts (new value)."""
        out: list[str] = []
        for index, (h, _) in self.keys.indexes.items():
            attrs = self.keys.index_attrs(index)
            if self.touched is not None and not attrs & self.touched:
                continue
            if all(a in self.old and a in self.new and self.old[a] == self.new[a] != UNKNOWN_VALUE for a in attrs):
                continue  # every key attribute known and unchanged: the entry stays
            if _in_index(self.old, attrs, unknown=not self.put):
                out.append(key_label(self.table, index, self.old.get(h) or UNKNOWN_VALUE))
            if _in_index(self.new, attrs, unknown=True):
                out.append(key_label(self.table, index, self.new.get(h) or UNKNOWN_VALUE))
        return out


class MeteringProxy(FaultProxy):
    """A transparent proxy that tallies DynamoDB requests and their capacity, per operation and table
    and per key and second, and throttles hot keys on request (see the module docstring)."""

    def __init__(self, upstream_url: str, schemas: Schemas, throttle: bool = False,
                 limits: KeyLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(upstream_url)
        self.schemas = schemas
        self.throttle = throttle
        self.limits = limits if limits is not None else KeyLimits()
        self.clock = clock
        self.tally = Tally()
        self.hot = HotKeys()
        self.shadow: dict[tuple[str, str], Known] = {}  # (table, item id) → its index key attributes
        self._shadow_lock = threading.Lock()  # the proxy's loop and prime() (another thread) share it
        # (time, base key) of every single-item write that wrote or failed its condition: what a
        # hand-over cost per stream (a failed conditional write is billed too).
        self._item_writes: list[tuple[float, str]] = []

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        at = self.clock()
        op = operation_of(request, body)
        req: dict[str, Any] = orjson.loads(body) if body.startswith(b"{") else {}
        asked_old = self._ask_old(op, req)
        if asked_old or (op in _WRITES | _READS and "ReturnConsumedCapacity" not in req):
            req.setdefault("ReturnConsumedCapacity", "TOTAL")
            body = orjson.dumps(req)
        hot = self._over_limit(op, req, at) if self.throttle else None
        if hot is not None:
            self.hot.refuse(hot, at)
            self.tally.record(op, _table_of(req), Usage(calls=1, errors=1))
            return _error(400, THROTTLED, THROTTLED_MESSAGE)
        up = await self._forward(request, body)
        resp: dict[str, Any] = {}
        try:
            resp = orjson.loads(up.body) if up.body.startswith(b"{") else {}
            self._account(op, req, up.status, resp, at)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            self.tally.record(op, "?", Usage(calls=1, errors=1))
        if asked_old and "Attributes" in resp:
            del resp["Attributes"]  # the client did not ask for them
            return _response(up, orjson.dumps(resp))
        return _response(up)

    def item_writes(self, table: str, since: float, until: float) -> collections.Counter[str]:
        """Single-item writes (done or failed their condition) per partition key value of ``table`` in
        ``[since, until]`` (the proxy's clock)."""
        prefix = key_label(table, None, "")
        return collections.Counter(key[len(prefix):] for at, key in list(self._item_writes)
                                   if since <= at <= until and key.startswith(prefix))

    def _ask_old(self, op: str, req: dict[str, Any]) -> bool:
        """Add ``ReturnValues=ALL_OLD`` to a write on a table with GSIs that asks for no return values."""
        keys = self.schemas.get(_table_of(req))
        if op not in _SINGLE_WRITES or keys is None or not keys.indexes or req.get("ReturnValues", "NONE") != "NONE":
            return False
        req["ReturnValues"] = "ALL_OLD"
        return True

    def _over_limit(self, op: str, req: dict[str, Any], at: float) -> str | None:
        """The first key this request would charge that has taken its limit this second (None: forward it)."""
        kind: Kind = "write" if op in _WRITES else "read"
        limit = self.limits.of(kind)
        if op in _WRITES:
            keys = [k for w in self._writes(op, req, None) for k in (w.base_key(), *w.index_keys())]
        else:
            keys = [k for k, _ in self._reads(op, req, {})]
        return next((k for k in keys if self.hot.used(kind, k, at) >= limit), None)

    # ----- accounting --------------------------------------------------------------------------------

    def _account(self, op: str, req: dict[str, Any], status: int, resp: dict[str, Any], at: float) -> None:
        table = _table_of(req)
        usage = Usage(calls=1, errors=int(status >= 300))
        units = consumed(resp)
        failed_condition = status >= 300 and "ConditionalCheckFailed" in str(resp.get("__type"))
        if op in _WRITES:
            # A conditional write that fails still consumes one write unit in DynamoDB.
            usage.write_units = units if status < 300 else float(failed_condition)
            if status < 300:
                usage.index_write_units = self._index_writes(op, req)
                self._charge_writes(op, req, resp, at)
            elif failed_condition:
                for w in self._writes(op, req, None):
                    self.hot.charge("write", w.base_key(), 1.0, at)
            if op in _SINGLE_WRITES and (status < 300 or failed_condition):
                self._item_writes += [(at, w.base_key()) for w in self._writes(op, req, None)]
        elif op in _READS:
            usage.read_units = units
            if status < 300:
                for key, share in self._reads(op, req, resp):
                    self.hot.charge("read", key, share, at)
        self.tally.record(op, table, usage)

    def _charge_writes(self, op: str, req: dict[str, Any], resp: dict[str, Any], at: float) -> None:
        writes = list(self._writes(op, req, resp))
        per_table = consumed_by_table(resp, _table_of(req))
        counts = collections.Counter(w.table for w in writes)
        for w in writes:
            self.hot.charge("write", w.base_key(), per_table.get(w.table, 1.0 * counts[w.table]) / counts[w.table], at)
            for key in w.index_keys():
                self.hot.charge("write", key, 1.0, at)
            self._learn(w.table, w.keys, w.key, w.new)

    def _writes(self, op: str, req: dict[str, Any], resp: dict[str, Any] | None) -> Iterator[ItemWrite]:
        """The items a write touches (``resp`` None: before it is forwarded, from what is known so far)."""
        if op == "BatchWriteItem":
            unprocessed = (resp or {}).get("UnprocessedItems") or {}
            for table, requests in (req.get("RequestItems") or {}).items():
                keys = self.schemas.get(table)
                for r in requests:
                    if keys is not None and r not in unprocessed.get(table, []):
                        yield self._batch_write(table, keys, r)
            return
        keys = self.schemas.get(_table_of(req))
        if keys is not None:
            yield self._single_write(op, keys, req, resp)

    def _batch_write(self, table: str, keys: TableKeys, r: dict[str, Any]) -> ItemWrite:
        gsi = keys.gsi_attrs
        if "PutRequest" in r:
            item = r["PutRequest"]["Item"]
            return ItemWrite(table, keys, item, self._known(table, keys, item), known_of(item, gsi, True), None, True)
        key = r["DeleteRequest"]["Key"]
        return ItemWrite(table, keys, key, self._known(table, keys, key), dict.fromkeys(gsi, None), None)

    def _single_write(self, op: str, keys: TableKeys, req: dict[str, Any], resp: dict[str, Any] | None) -> ItemWrite:
        table, gsi = _table_of(req), keys.gsi_attrs
        key = req["Item"] if op == "PutItem" else req["Key"]
        names, values = req.get("ExpressionAttributeNames") or {}, req.get("ExpressionAttributeValues") or {}
        old = self._known(table, keys, key)
        old.update({a: v for a, v in condition_terms(str(req.get("ConditionExpression", "")), names, values).items()
                    if a in gsi})
        returned, answered = req.get("ReturnValues", "NONE"), resp is not None
        attrs = (resp or {}).get("Attributes") or {}
        if answered and returned == "ALL_OLD":
            old = known_of(attrs, gsi, True)
        if op == "PutItem":
            return ItemWrite(table, keys, key, old, known_of(key, gsi, True), None, True)
        if op == "DeleteItem":
            return ItemWrite(table, keys, key, old, dict.fromkeys(gsi, None), None)
        effects = {a: v for a, v in update_effects(str(req.get("UpdateExpression", "")), names, values).items()
                   if a in gsi}
        new = {**old, **effects} if not (answered and returned == "ALL_NEW") else known_of(attrs, gsi, True)
        if answered and returned == "UPDATED_OLD":
            old.update({a: scalar(attrs[a]) if a in attrs else None for a in effects})
        if answered and returned == "UPDATED_NEW":
            new.update({a: scalar(attrs[a]) if a in attrs else None for a in effects})
        for a in gsi - set(effects):  # untouched: the same before and after
            if a in new and a not in old:
                old[a] = new[a]
            elif a in old and a not in new:
                new[a] = old[a]
        return ItemWrite(table, keys, key, old, new, frozenset(effects))

    def _reads(self, op: str, req: dict[str, Any], resp: dict[str, Any]) -> Iterator[tuple[str, float]]:
        """(key, units) each read charges (before it is forwarded: units 0); learns index keys from answers."""
        if op == "BatchGetItem":
            per_table = consumed_by_table(resp, "")
            for table, spec in (req.get("RequestItems") or {}).items():
                keys = self.schemas.get(table)
                if keys is None:
                    continue
                wanted = spec.get("Keys") or []
                for key in wanted:
                    yield key_label(table, None, scalar(key[keys.hash])), per_table.get(table, 0.0) / len(wanted)
                for item in (resp.get("Responses") or {}).get(table, []):
                    self._learn(table, keys, item, known_of(item, keys.gsi_attrs, "ProjectionExpression" not in spec))
            return
        table = _table_of(req)
        keys = self.schemas.get(table)
        if op not in ("GetItem", "Query") or keys is None:
            return
        if op == "GetItem":
            yield key_label(table, None, scalar(req["Key"][keys.hash])), consumed(resp)
            found = [resp["Item"]] if "Item" in resp else []
        else:
            index = req.get("IndexName")
            h = keys.indexes[index][0] if index else keys.hash
            names, values = req.get("ExpressionAttributeNames") or {}, req.get("ExpressionAttributeValues") or {}
            terms = condition_terms(str(req.get("KeyConditionExpression", "")), names, values)
            yield key_label(table, index, terms.get(h) or UNKNOWN_VALUE), consumed(resp)
            found = resp.get("Items") or []
        whole = "ProjectionExpression" not in req and "AttributesToGet" not in req and not req.get("IndexName")
        for item in found:
            self._learn(table, keys, item, known_of(item, keys.gsi_attrs, whole))

    def prime(self, table: str, items: Iterable[dict[str, Any]]) -> None:
        """Teach the shadow map whole items written behind the proxy's back (a harness's seeding)."""
        keys = self.schemas.get(table)
        if keys is None:
            return
        for item in items:
            self._learn(table, keys, item, known_of(item, keys.gsi_attrs, True))

    def _known(self, table: str, keys: TableKeys, key: dict[str, Any]) -> Known:
        ident = keys.item_id(key)
        with self._shadow_lock:
            return dict(self.shadow.get((table, ident), {})) if ident is not None else {}

    def _learn(self, table: str, keys: TableKeys, item: dict[str, Any], known: Known) -> None:
        ident = keys.item_id(item)
        if ident is None or not keys.indexes:
            return
        with self._shadow_lock:
            self.shadow.setdefault((table, ident), {}).update(known)

    # ----- the GSI write units of the tally (per operation and table) ----------------------------------

    def _index_sets(self, table: str) -> dict[str, frozenset[str]]:
        keys = self.schemas.get(table)
        return {index: keys.index_attrs(index) for index in keys.indexes} if keys is not None else {}

    def _index_writes(self, op: str, req: dict[str, Any]) -> float:
        if op == "BatchWriteItem":
            total = 0.0
            for table, writes in (req.get("RequestItems") or {}).items():
                for w in writes:
                    item = (w.get("PutRequest") or {}).get("Item")
                    entries = self._entries(table, set(item)) if item is not None else None
                    total += len(self._index_sets(table)) if entries is None else entries
            return total
        table = str(req.get("TableName"))
        if op == "PutItem":
            return self._entries(table, set(req.get("Item") or {}))
        if op == "DeleteItem":
            return float(len(self._index_sets(table)))
        return self._update_index_writes(table, req)

    def _entries(self, table: str, attrs: set[str]) -> float:
        return float(sum(1 for keys in self._index_sets(table).values() if keys <= attrs))

    def _update_index_writes(self, table: str, req: dict[str, Any]) -> float:
        set_attrs, removed = touched(str(req.get("UpdateExpression", "")), req.get("ExpressionAttributeNames") or {})
        total = 0.0
        for keys in self._index_sets(table).values():
            if keys & removed:
                total += 1
            elif keys & set_attrs:
                total += 2
        return total


# ----- request analysis --------------------------------------------------------------------------------

def _table_of(req: dict[str, Any]) -> str:
    return str(req.get("TableName") or next(iter(req.get("RequestItems") or {"": 0})))


def key_label(table: str, index: str | None, value: str) -> str:
    """``table:value`` for a base-table partition key value, ``table/index:value`` for a GSI's."""
    return f"{table}:{value}" if index is None else f"{table}/{index}:{value}"


def scalar(value: dict[str, Any]) -> str:
    """An attribute value as text: the string or number itself, anything else as its JSON."""
    for t in ("S", "N", "B"):
        if t in value:
            return str(value[t])
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def known_of(item: dict[str, Any], attrs: Iterable[str], complete: bool) -> Known:
    """What ``item`` tells of ``attrs``; ``complete``: an attribute it lacks is absent (not unknown)."""
    return {a: scalar(item[a]) for a in attrs if a in item} | (
        {a: None for a in attrs if a not in item} if complete else {})


def _in_index(known: Known, attrs: frozenset[str], unknown: bool) -> bool:
    """Whether an item with ``known`` has an entry in an index keyed by ``attrs`` (``unknown``: the
    answer for an attribute of unknown presence)."""
    return all(known[a] is not None if a in known else unknown for a in attrs)


def consumed(resp: dict[str, Any]) -> float:
    """The answer's ConsumedCapacity units, summed over tables."""
    c = resp.get("ConsumedCapacity")
    if isinstance(c, list):
        return sum(float(x.get("CapacityUnits", 0)) for x in c)
    return float((c or {}).get("CapacityUnits", 0))


def consumed_by_table(resp: dict[str, Any], table: str) -> dict[str, float]:
    """The answer's ConsumedCapacity units per table (a single-table answer may not name it)."""
    c = resp.get("ConsumedCapacity")
    if isinstance(c, list):
        return {str(x.get("TableName")): float(x.get("CapacityUnits", 0)) for x in c}
    return {str((c or {}).get("TableName") or table): float((c or {}).get("CapacityUnits", 0))} if c else {}


def _split_top(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` (a regex) where it is outside parentheses."""
    parts, depth, start = [], 0, 0
    for m in re.finditer(rf"\(|\)|{separator}", text, re.IGNORECASE):
        if m.group() == "(":
            depth += 1
        elif m.group() == ")":
            depth -= 1
        elif depth == 0:
            parts.append(text[start:m.start()])
            start = m.end()
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def condition_terms(expression: str, names: dict[str, str], values: dict[str, Any]) -> Known:
    """What a condition (or key condition) states of attributes in its top-level AND terms:
    ``a = :v`` (the value) and ``attribute_not_exists(a)`` (absent); true once the write succeeded."""
    out: Known = {}
    for term in _split_top(expression, r"\bAND\b"):
        if (m := _EQUALS.match(term)) is not None and m.group(2) in values:
            out[names.get(m.group(1), m.group(1))] = scalar(values[m.group(2)])
        elif (m := _NOT_EXISTS.match(term)) is not None:
            out[names.get(m.group(1), m.group(1))] = None
    return out


def update_effects(expression: str, names: dict[str, str], values: dict[str, Any]) -> Known:
    """What an UpdateExpression leaves in each attribute it touches: ``SET a = :v``, its value;
    ``REMOVE a``, absent; anything else (``SET a = expr``, ``ADD``, ``DELETE``), present, value unknown."""
    out: Known = {}
    parts = _CLAUSE.split(expression)
    for verb, clause in zip(parts[1::2], parts[2::2], strict=True):
        for action in _split_top(clause, ","):
            if verb.upper() == "REMOVE":
                out[names.get(action, action)] = None
                continue
            target, _, rest = action.replace("=", " ", 1).partition(" ")
            rest = rest.strip()
            plain = verb.upper() == "SET" and rest in values
            out[names.get(target, target)] = scalar(values[rest]) if plain else UNKNOWN_VALUE
    return out


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


def key_schemas(client: Any, tables: Iterable[str]) -> Schemas:
    """Key attributes of ``tables`` and of their GSIs (boto3 DynamoDB client)."""
    out: Schemas = {}
    for table in tables:
        desc = client.describe_table(TableName=table)["Table"]
        out[table] = TableKeys(*_hash_range(desc["KeySchema"]),
                               indexes={g["IndexName"]: _hash_range(g["KeySchema"])
                                        for g in desc.get("GlobalSecondaryIndexes", [])})
    return out


def _hash_range(schema: list[dict[str, str]]) -> tuple[str, str | None]:
    roles = {k["KeyType"]: k["AttributeName"] for k in schema}
    return roles["HASH"], roles.get("RANGE")


def start_metering(upstream_url: str, schemas: Schemas, throttle: bool = False,
                   limits: KeyLimits | None = None) -> tuple[ProxyThread, MeteringProxy]:
    """A running metering proxy on its own thread; point ``AWS_ENDPOINT_URL_DYNAMODB`` at ``thread.url``."""
    proxy = MeteringProxy(upstream_url, schemas, throttle=throttle, limits=limits)
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
