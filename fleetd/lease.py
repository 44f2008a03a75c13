"""The lease store: every DynamoDB operation of the lease protocol (SPEC §3).

Ownership of a connection changes only through conditional UpdateItem on the
connections table; GSI reads (``by_state_expiry``, ``by_expiry``, ``by_owner``) only
nominate candidates, never decide.  Callers get an :class:`Outcome`, not botocore
exceptions:

* ``WON``       — the write happened (or, after an ambiguous failure, provably had);
* ``LOST``      — a condition failed: someone else owns it, or the session is expired;
* ``RETRYABLE`` — throttling, 5xx, timeouts: try again later, nothing is known to have changed;
* ``FATAL``     — credentials, missing tables, malformed requests: retrying will not help.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fleetd.aio import Backoff
from fleetd.aws import Outcome, classify, error_code
from fleetd.clock import Clock
from fleetd.config import AwsConfig, LeaseConfig
from fleetd.schema import EXPIRY_INDEX, HELD_BY_SESSION, OWNER_INDEX, SESSION_KIND, STATE_EXPIRY_INDEX

STARTED = "STARTED"
STOPPED = "STOPPED"
BATCH_GET_MAX = 100
SESSION_TTL_BACKSTOP_S = 7 * 24 * 3600  # DynamoDB TTL removes long-dead sessions' leftovers


def _n(value: int) -> dict[str, str]:
    return {"N": str(value)}


def _s(value: str) -> dict[str, str]:
    return {"S": value}


def _num(item: dict[str, Any], name: str, default: int = 0) -> int:
    raw = item.get(name, {}).get("N")
    return default if raw is None else int(raw)


def _str(item: dict[str, Any], name: str) -> str:
    return str(item.get(name, {}).get("S", ""))


class BadItem(ValueError):
    """A connection item whose attributes cannot be interpreted."""


@dataclass(frozen=True, slots=True)
class ConnItem:
    """The parts of a connection item a shard needs."""

    connection_id: str
    ws_url: str
    desired_state: str
    lease_owner: str
    lease_epoch: int
    lease_expires_at_ms: int
    last_seq: int  # -1 when the item has never recorded one (no resume point known)

    @classmethod
    def parse(cls, item: dict[str, Any]) -> ConnItem:
        try:
            return cls(
                connection_id=_str(item, "connection_id"),
                ws_url=_str(item, "ws_url"),
                desired_state=_str(item, "desired_state"),
                lease_owner=_str(item, "lease_owner"),
                lease_epoch=_num(item, "lease_epoch"),
                lease_expires_at_ms=_num(item, "lease_expires_at_ms"),
                last_seq=_num(item, "last_seq", -1),
            )
        except (ValueError, AttributeError, TypeError) as e:
            raise BadItem(f"connection item {item.get('connection_id')!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    outcome: Outcome
    item: ConnItem | None = None
    detail: str = ""
    bad_item: bool = False  # the item's own attributes made the claim invalid (e.g. a non-numeric lease_epoch)
    # Monotonic time just before the claim was first sent: an item lease it won expires at most
    # ``lease_ttl_s`` after it (every SDK retry re-sends the same expiry), so deadlines count from here.
    sent_at: float = 0.0


class Fate(enum.Enum):
    """A session as a consistent read (and, if due, a tombstone write) finds it."""

    ALIVE = "alive"    # renewing, or expired too recently to be declared dead
    DEAD = "dead"      # it carries a tombstone (``dead_at_ms``): final, renewals can never succeed again
    GONE = "gone"      # no session item: forgotten after its grace, or never created
    UNKNOWN = "unknown"  # the reads or the tombstone write failed: decide nothing


class OffersOpen(enum.Enum):
    """What a consistent read of an offering session allows for its offers."""

    WITH_SEQ = "with_seq"  # its own offering mark, with the offer's token: take, resuming after the offer's seq
    DEAD = "dead"  # dead, without that mark: take (it streams nothing), but resume from the item's own last_seq
    NO = "no"  # alive without the mark, or gone: as far as anyone knows it still streams: take nothing
    UNKNOWN = "unknown"  # unreadable: decide nothing (a peer may)


@dataclass(frozen=True, slots=True)
class SessionDeath:
    fate: Fate
    dead_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a shard records about itself in its session item."""

    session_id: str
    task_id: str
    shard: int
    capacity: int
    host: str = socket.gethostname()
    pid: int = 0


@dataclass(frozen=True, slots=True)
class SessionLoad:
    """A live session's load, as its last heartbeat recorded it."""

    session_id: str
    held: int
    capacity: int
    draining: bool
    started_at_ms: int = 0  # 0: unknown (treated as long settled)


RequestHook = Callable[[str, Outcome], None]


def _no_hook(op: str, outcome: Outcome) -> None:
    pass


class LeaseStore:
    """Lease operations over one aiobotocore DynamoDB client.

    Pure constructor; every method is one logical operation and reports each
    DynamoDB request to ``on_request(op, outcome)`` for metrics.
    """

    def __init__(self, ddb: Any, aws: AwsConfig, lease: LeaseConfig, clock: Clock,
                 on_request: RequestHook = _no_hook, renew_ddb: Any = None) -> None:
        self.ddb = ddb
        # Session renewals go through a client without SDK retries when one is given: the heartbeat
        # retries them itself, sooner than an SDK backoff would and with a fresh expiry each time.
        self.renew_ddb = renew_ddb if renew_ddb is not None else ddb
        self.conns = aws.connections_table
        self.sessions = aws.sessions_table
        self.lease = lease
        self.clock = clock
        self.on_request = on_request
        self.ttl_ms = int(lease.lease_ttl_s * 1000)
        self.skew_ms = int(lease.safety_margin_s * 1000)
        # A dead session's record outlives its last possible claim: a claim sent just before the
        # session's deadline can land up to one SDK retry window later, and an item it wins then
        # is found only through `by_owner` of a session still listed in `by_expiry`.
        self.dead_grace_ms = int(lease.dead_session_grace_s * 1000)

    async def _call(self, op: str, client: Any = None, **kwargs: Any) -> dict[str, Any]:
        """One DynamoDB request (through ``client``, default the store's), reported to the hook; exceptions
        propagate."""
        method = getattr(client if client is not None else self.ddb, _SNAKE[op])
        try:
            resp: dict[str, Any] = await method(**kwargs)
        except Exception as e:
            self.on_request(op, classify(e))
            raise
        self.on_request(op, Outcome.WON)
        return resp

    async def _write(self, op: str, client: Any = None, **kwargs: Any) -> tuple[Outcome, dict[str, Any]]:
        try:
            return Outcome.WON, await self._call(op, client, **kwargs)
        except Exception as e:
            return classify(e), {"error": e}

    # ----- connection items -------------------------------------------------------------------------

    def _claim_expiry(self) -> int:
        if self.lease.lease_mode == "session":
            return HELD_BY_SESSION
        return self.clock.now_ms() + self.ttl_ms

    async def claim(self, connection_id: str, me: str, dead_owner: str | None = None) -> ClaimResult:
        """Take a free/expired item, or one owned by ``dead_owner`` (a session with a tombstone)."""
        now = self.clock.now_ms()
        cond = "attribute_not_exists(lease_expires_at_ms) OR lease_expires_at_ms < :t"
        values = {":t": _n(now - self.skew_ms)}
        if dead_owner:
            cond += " OR lease_owner = :dead"
            values[":dead"] = _s(dead_owner)
        return await self._take_item(connection_id, me, "", f"({cond})", values)

    async def take(self, connection_id: str, me: str, offered_by: str, epoch: int, last_seq: int) -> ClaimResult:
        """Take a stream a stopping session offered (it closed and flushed it; see ``mark_offering``): one
        write, conditioned on that owner and epoch, recording the offer's ``last_seq`` (none for -1)."""
        values = {":from": _s(offered_by), ":epoch": _n(epoch)}
        return await self._take_item(connection_id, me, _set_seq(values, last_seq),
                                     "lease_owner = :from AND lease_epoch = :epoch", values)

    async def _take_item(self, connection_id: str, me: str, also_set: str, cond: str,
                         values: dict[str, Any]) -> ClaimResult:
        """The one conditional write that makes ``me`` a STARTED item's owner (claim or take), and what
        its answer proves; ``also_set`` is more of the SET clause (``x = :x, ``), ``cond`` the rest of the
        condition and ``values`` its values."""
        sent_at = self.clock.monotonic()
        values = {**values, ":started": _s(STARTED), ":me": _s(me), ":exp": _n(self._claim_expiry()),
                  ":one": _n(1), ":now": _n(self.clock.now_ms())}
        outcome, resp = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression=f"SET lease_owner = :me, lease_expires_at_ms = :exp, {also_set}updated_at_ms = :now "
                             "ADD lease_epoch :one",
            ConditionExpression=f"desired_state = :started AND {cond}",
            ExpressionAttributeValues=values,
            ReturnValues="ALL_NEW",
        )
        if outcome is Outcome.WON:
            return self._claimed(resp["Attributes"], sent_at)
        if outcome is Outcome.LOST and not _was_retried(resp):
            return ClaimResult(Outcome.LOST, sent_at=sent_at)
        if outcome is Outcome.FATAL and error_code(resp["error"]) == "ValidationException":
            # The claim is valid for every well-formed item: this item's attributes do not fit it
            # (ADD on a non-numeric lease_epoch …).  Nothing was written; no claim of it can succeed.
            return ClaimResult(Outcome.FATAL, None, str(resp["error"]), bad_item=True, sent_at=sent_at)
        # The SDK retried (or gave up): our first attempt may have succeeded with its answer lost.
        return await self._check_claim(connection_id, me, outcome, resp, sent_at)

    def _claimed(self, attrs: dict[str, Any], sent_at: float) -> ClaimResult:
        try:
            return ClaimResult(Outcome.WON, ConnItem.parse(attrs), sent_at=sent_at)
        except BadItem as e:
            return ClaimResult(Outcome.WON, None, str(e), sent_at=sent_at)

    async def _check_claim(self, connection_id: str, me: str, outcome: Outcome,
                           resp: dict[str, Any], sent_at: float) -> ClaimResult:
        item = await self.get(connection_id)
        if item is not None and item.lease_owner == me and item.lease_expires_at_ms >= self.clock.now_ms():
            return ClaimResult(Outcome.WON, item, "ambiguous claim confirmed by consistent read", sent_at=sent_at)
        return ClaimResult(outcome, None, str(resp.get("error", "")), sent_at=sent_at)

    async def get(self, connection_id: str) -> ConnItem | None:
        """Consistent read of one connection item (None if absent or unreadable)."""
        try:
            resp = await self._call("GetItem", TableName=self.conns, ConsistentRead=True,
                                    Key={"connection_id": _s(connection_id)})
        except Exception:
            return None
        return ConnItem.parse(resp["Item"]) if "Item" in resp else None

    async def release(self, connection_id: str, me: str, epoch: int, last_seq: int) -> Outcome:
        """Give the item back (free now), recording the final ``last_seq`` (none when it is -1: a
        stream that never wrote anything has no resume point, and 0 would skip an upstream's seq 0)."""
        values = {":zero": _n(0), ":me": _s(me), ":epoch": _n(epoch), ":now": _n(self.clock.now_ms())}
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression=f"SET lease_expires_at_ms = :zero, {_set_seq(values, last_seq)}updated_at_ms = :now "
                             "REMOVE lease_owner",
            ConditionExpression="lease_owner = :me AND lease_epoch = :epoch",
            ExpressionAttributeValues=values,
        )
        return outcome

    async def renew_item(self, connection_id: str, me: str, epoch: int) -> Outcome:
        """Item mode: push one item's expiry out by the TTL, never back (as for sessions: a renewal
        applied after a later one must not set back the expiry peers claim by)."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression="SET lease_expires_at_ms = :exp",
            ConditionExpression="lease_owner = :me AND lease_epoch = :epoch AND lease_expires_at_ms <= :exp",
            ExpressionAttributeValues={":exp": _n(self.clock.now_ms() + self.ttl_ms), ":me": _s(me),
                                       ":epoch": _n(epoch)},
        )
        return outcome

    async def checkpoint(self, connection_id: str, me: str, epoch: int, last_seq: int) -> Outcome:
        """Record ``last_seq`` (≥ 0) while still holding the lease."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression="SET last_seq = :seq",
            ConditionExpression="lease_owner = :me AND lease_epoch = :epoch",
            ExpressionAttributeValues={":seq": _n(last_seq), ":me": _s(me), ":epoch": _n(epoch)},
        )
        return outcome

    async def free_items(self, limit: int) -> list[str]:
        """Ids of STARTED items that are free or whose item lease expired (GSI: candidates only)."""
        values = {":started": _s(STARTED), ":t": _n(self.clock.now_ms() - self.skew_ms)}
        return [k["connection_id"]["S"] async for k in self._query(
            limit, TableName=self.conns, IndexName=STATE_EXPIRY_INDEX,
            KeyConditionExpression="desired_state = :started AND lease_expires_at_ms < :t",
            ExpressionAttributeValues=values)]

    async def stopped_held(self, limit: int = 1_000_000) -> list[str]:
        """Ids of STOPPED items someone still holds (GSI: candidates only; confirm on the base table).

        Stopped items nobody holds have ``lease_expires_at_ms`` 0 or in the past, so this
        reads only the few that need action: one query per shard, not a read per item.
        """
        values = {":stopped": _s(STOPPED), ":now": _n(self.clock.now_ms())}
        return [k["connection_id"]["S"] async for k in self._query(
            limit, TableName=self.conns, IndexName=STATE_EXPIRY_INDEX,
            KeyConditionExpression="desired_state = :stopped AND lease_expires_at_ms > :now",
            ExpressionAttributeValues=values)]

    async def items_of(self, owner: str, limit: int = 1_000_000) -> list[str]:
        """Ids of the items whose ``lease_owner`` is ``owner`` (GSI: candidates only)."""
        return [k["connection_id"]["S"] async for k in self._query(
            limit, TableName=self.conns, IndexName=OWNER_INDEX,
            KeyConditionExpression="lease_owner = :o", ExpressionAttributeValues={":o": _s(owner)})]

    async def owned(self, segment: int, segments: int, limit: int) -> list[tuple[str, str]]:
        """(connection id, owner) of up to ``limit`` owned items in one segment of ``by_owner``: a scan of
        the (keys only) index, the orphan sweep's read; its cost is the segment's size, not the table's."""
        out: list[tuple[str, str]] = []
        start: dict[str, Any] | None = None
        while len(out) < limit:
            kwargs: dict[str, Any] = {"TableName": self.conns, "IndexName": OWNER_INDEX, "Segment": segment,
                                      "TotalSegments": segments, "Limit": min(1000, limit - len(out))}
            if start:
                kwargs["ExclusiveStartKey"] = start
            resp = await self._call("Scan", **kwargs)
            out += [(k["connection_id"]["S"], k["lease_owner"]["S"]) for k in resp.get("Items", [])
                    if "lease_owner" in k]
            start = resp.get("LastEvaluatedKey")
            if not start:
                break
        return out

    async def _query(self, limit: int, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """Yield up to ``limit`` keys over every page of a query."""
        start: dict[str, Any] | None = None
        count = 0
        while count < limit:
            page_kwargs = dict(kwargs, Limit=min(1000, limit - count))
            if start:
                page_kwargs["ExclusiveStartKey"] = start
            resp = await self._call("Query", **page_kwargs)
            for item in resp.get("Items", []):
                count += 1
                yield item
            start = resp.get("LastEvaluatedKey")
            if not start:
                return

    async def desired_states(self, ids: Iterable[str], max_wait_s: float = 10.0) -> dict[str, ConnItem | None]:
        """Current state of each id via BatchGetItem (100 keys a call); None for a missing item, no entry for
        an item that cannot be parsed."""
        id_list = list(dict.fromkeys(ids))
        chunks = [id_list[i:i + BATCH_GET_MAX] for i in range(0, len(id_list), BATCH_GET_MAX)]
        found: dict[str, ConnItem | None] = dict.fromkeys(id_list)
        unreadable: set[str] = set()
        for part in await asyncio.gather(*(self._batch_get(c, max_wait_s, unreadable) for c in chunks)):
            found.update(part)
        # An item that exists but cannot be parsed says nothing about its state: leave it out.  Reported
        # as None ("deleted"), its owner would drop it and re-adopt it forever.
        for cid in unreadable:
            found.pop(cid, None)
        return found

    async def _batch_get(self, ids: list[str], max_wait_s: float, unreadable: set[str]) -> dict[str, ConnItem]:
        keys: list[dict[str, Any]] = [{"connection_id": _s(i)} for i in ids]
        out: dict[str, ConnItem] = {}
        # 0.05 s doubling to 2 s, each wait drawn from [0.5, 1.5]× that: in Backoff's terms 1.5× those
        # delays with jitter 2/3 (the same one draw, the same distribution).
        backoff, deadline = Backoff(0.075, 3.0, jitter=2 / 3), self.clock.monotonic() + max_wait_s
        while keys:
            resp = await self._call("BatchGetItem", RequestItems={self.conns: {
                "Keys": keys,
                "ProjectionExpression": "connection_id, desired_state, lease_owner, lease_epoch, "
                                        "lease_expires_at_ms, last_seq, ws_url"}})
            for raw in resp.get("Responses", {}).get(self.conns, []):
                try:
                    item = ConnItem.parse(raw)
                except BadItem:
                    unreadable.add(_str(raw, "connection_id"))
                    continue
                out[item.connection_id] = item
            keys = resp.get("UnprocessedKeys", {}).get(self.conns, {}).get("Keys", [])
            if keys:
                if self.clock.monotonic() > deadline:
                    raise TimeoutError(f"{len(keys)} keys still unprocessed after {max_wait_s} s")
                await asyncio.sleep(backoff.next())
        return out

    # ----- sessions ----------------------------------------------------------------------------------

    async def create_session(self, info: SessionInfo) -> Outcome:
        now = self.clock.now_ms()
        expires = now + self.ttl_ms
        outcome, _ = await self._write(
            "PutItem",
            TableName=self.sessions,
            Item={"session_id": _s(info.session_id), "kind": _s(SESSION_KIND), "expires_at_ms": _n(expires),
                  "task_id": _s(info.task_id), "shard": _n(info.shard), "host": _s(info.host),
                  "pid": _n(info.pid), "started_at_ms": _n(now), "capacity": _n(info.capacity),
                  "held": _n(0), "draining": {"BOOL": False},
                  "ttl": _n(expires // 1000 + SESSION_TTL_BACKSTOP_S)},
            ConditionExpression="attribute_not_exists(session_id)",
        )
        return outcome

    async def renew_session(self, session_id: str, held: int,
                            draining: bool = False) -> tuple[Outcome, int, int]:
        """Extend a live session; an expired one can never come back (condition on now), and its expiry
        only ever moves forward.

        The expiry peers read is the one they declare death by, so it must never move back: a renewal
        applied late (an SDK attempt landing after later renewals) would otherwise set it back below
        the deadline the owner counts from its latest renewal, and peers would take over streams the
        owner still streams.  ``expires_at_ms <= :exp`` keeps every re-application of one renewal
        idempotent and makes an older one a no-op.  Such an older one's answer, if it arrives, is
        RETRYABLE, not LOST: the session is alive and a later renewal of its own extended it.

        The third value is the session's ``handed_count`` (see ``notify_handed``): a peer handed
        us streams since the last renewal if it grew.  A count the renewal only reads survives
        a lost answer (the retry reads it again); a mark the renewal removed did not.
        """
        now = self.clock.now_ms()
        expires = now + self.ttl_ms
        outcome, resp = await self._write(
            "UpdateItem",
            self.renew_ddb,
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="SET expires_at_ms = :exp, held = :held, draining = :dr, #ttl = :ttl",
            # A tombstone is final: a renewal (or its SDK retry, landing late) never revives a dead session.
            ConditionExpression="attribute_not_exists(dead_at_ms) AND expires_at_ms >= :now "
                                "AND expires_at_ms <= :exp",
            ExpressionAttributeNames={"#ttl": "ttl"},
            ExpressionAttributeValues={":exp": _n(expires), ":now": _n(now), ":held": _n(held),
                                       ":dr": {"BOOL": draining},
                                       ":ttl": _n(expires // 1000 + SESSION_TTL_BACKSTOP_S)},
            ReturnValues="ALL_NEW",
        )
        handed = _num(resp.get("Attributes", {}), "handed_count") if outcome is Outcome.WON else 0
        if outcome is Outcome.LOST and not await self._session_over(session_id, expires):
            outcome = Outcome.RETRYABLE
        return outcome, expires, handed

    async def _session_over(self, session_id: str, expires: int) -> bool:
        """Why a renewal failed its condition, by a consistent read: the session is over (a tombstone, no
        item, or expired) — or else a later renewal of ours had already moved its expiry beyond
        ``expires``.  Unreadable: not known to be over (the fence deadline guards safety meanwhile)."""
        try:
            record = await self._session_record(session_id)
        except Exception:
            return False
        if record is None or "dead_at_ms" in record:
            return True
        stored = _num(record, "expires_at_ms")
        return stored <= expires or self.expired(stored)

    async def notify_handed(self, session_id: str) -> Outcome:
        """Tell a live session it was handed streams (its ``handed_count`` grows): its next renewal
        sees it even if its own view of the fleet's load says it is not below its share, so it
        is not watching for them."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="ADD handed_count :one",
            ConditionExpression="attribute_not_exists(dead_at_ms) AND expires_at_ms >= :now",
            ExpressionAttributeValues={":now": _n(self.clock.now_ms()), ":one": _n(1)},
        )
        return outcome

    async def expire_session(self, session_id: str) -> Outcome:
        """Declare a session dead now, by its owner (graceful end, a shard abandoning a fenced session)
        or its supervisor (a crashed shard): a tombstone ``dead_at_ms``, and ``expires_at_ms`` 0 so that
        ``by_expiry`` lists it at once.  Only whoever knows the session streams nothing may write it.
        LOST: no such session, or it was already dead (its first tombstone stands)."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="SET dead_at_ms = :now, expires_at_ms = :zero",
            ConditionExpression="attribute_exists(session_id) AND attribute_not_exists(dead_at_ms)",
            ExpressionAttributeValues={":zero": _n(0), ":now": _n(self.clock.now_ms())},
        )
        return outcome

    async def bury_process(self, session_id: str, pid: int) -> Outcome:
        """A crashed shard process's sessions, declared dead by its supervisor: ``session_id`` (the one it
        last reported) and any other live session of the same ``task/shard/`` carrying the same ``pid``
        (one it opened after its last report, e.g. a replacement).  A successor's sessions have another
        pid and are left alone.  The outcome is ``session_id``'s."""
        outcome = await self.expire_session(session_id)
        prefix = session_id.rsplit("/", 1)[0] + "/"
        for other in await self._sessions_with_prefix(prefix):
            if other == session_id:
                continue
            record = await self._call("GetItem", TableName=self.sessions, ConsistentRead=True,
                                      Key={"session_id": _s(other)}, ProjectionExpression="pid, dead_at_ms")
            item = record.get("Item", {})
            if item and "dead_at_ms" not in item and _num(item, "pid", -1) == pid:
                await self.expire_session(other)
        return outcome

    async def _sessions_with_prefix(self, prefix: str) -> list[str]:
        return [k["session_id"]["S"] async for k in self._query(
            1000, TableName=self.sessions, IndexName=EXPIRY_INDEX, KeyConditionExpression="kind = :k",
            FilterExpression="begins_with(session_id, :p)",
            ExpressionAttributeValues={":k": _s(SESSION_KIND), ":p": _s(prefix)})]

    async def declare_dead(self, session_id: str) -> Outcome:
        """A peer's tombstone: only for a session expired beyond the skew on our clock (its owner fenced
        ``safety_margin_s`` before that on its own), and never twice.  WON: it is dead from now on."""
        now = self.clock.now_ms()
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="SET dead_at_ms = :now",
            ConditionExpression="attribute_not_exists(dead_at_ms) AND expires_at_ms < :t",
            ExpressionAttributeValues={":now": _n(now), ":t": _n(now - self.skew_ms)},
        )
        return outcome

    async def fate(self, session_id: str) -> SessionDeath:
        """Whether a session is dead, by a consistent read; an expired session without a tombstone is
        given one first.  Only DEAD licenses taking its items over: GSI reads only nominate."""
        try:
            record = await self._session_record(session_id)
            if record is None:
                return SessionDeath(Fate.GONE)
            if "dead_at_ms" not in record:
                if not self.expired(_num(record, "expires_at_ms")):
                    return SessionDeath(Fate.ALIVE)
                if await self.declare_dead(session_id) is Outcome.RETRYABLE:
                    return SessionDeath(Fate.UNKNOWN)
                record = await self._session_record(session_id)  # ours, or the tombstone that beat it
                if record is None:
                    return SessionDeath(Fate.GONE)
                if "dead_at_ms" not in record:
                    return SessionDeath(Fate.ALIVE)  # it renewed just before our write
        except Exception:
            return SessionDeath(Fate.UNKNOWN)
        return SessionDeath(Fate.DEAD, _num(record, "dead_at_ms"))

    async def _session_record(self, session_id: str) -> dict[str, Any] | None:
        resp = await self._call("GetItem", TableName=self.sessions, ConsistentRead=True,
                                Key={"session_id": _s(session_id)},
                                ProjectionExpression="session_id, expires_at_ms, dead_at_ms")
        item: dict[str, Any] | None = resp.get("Item")
        return item

    async def expired_sessions(self, limit: int = 1000) -> list[str]:
        """Candidate dead sessions from ``by_expiry`` (eventually consistent: confirm before use)."""
        dead, _ = await self.dead_and_dying(0, limit)
        return dead

    async def dead_and_dying(self, horizon_ms: int, limit: int = 1000) -> tuple[list[str], int | None]:
        """Candidate dead sessions, and when the first session that stops renewing within
        ``horizon_ms`` will be dead for everyone (None: none does).  One query of ``by_expiry``
        either way: a live session renews every heartbeat, so it never shows in the horizon."""
        now = self.clock.now_ms()
        values = {":k": _s(SESSION_KIND), ":t": _n(now + horizon_ms)}
        dead: list[str] = []
        dying: list[int] = []
        async for k in self._query(limit, TableName=self.sessions, IndexName=EXPIRY_INDEX,
                                   KeyConditionExpression="kind = :k AND expires_at_ms < :t",
                                   ExpressionAttributeValues=values):
            expires = _num(k, "expires_at_ms")
            if self.expired(expires):
                dead.append(k["session_id"]["S"])
            else:
                dying.append(expires + self.skew_ms + 50)  # just past `expired`, on our clock
        return dead, min(dying, default=None)

    async def live_sessions(self, limit: int = 1000, min_remaining_ms: int | None = None) -> list[str]:
        """Ids of the sessions ``by_expiry`` lists as live (eventually consistent: as fresh as their last
        heartbeat).  ``min_remaining_ms``: only those whose lease runs at least that much longer (a session
        that missed its last renewals, dying, is left out); default: the skew.  Keys only: a few units."""
        remaining = self.skew_ms if min_remaining_ms is None else max(self.skew_ms, min_remaining_ms)
        values = {":k": _s(SESSION_KIND), ":t": _n(self.clock.now_ms() + remaining)}
        return [k["session_id"]["S"] async for k in self._query(
            limit, TableName=self.sessions, IndexName=EXPIRY_INDEX,
            KeyConditionExpression="kind = :k AND expires_at_ms > :t", ExpressionAttributeValues=values)]

    async def live_loads(self, sample: int) -> list[SessionLoad]:
        """The load of up to ``sample`` live sessions, picked at random from ``by_expiry`` (a sample keeps
        the cost flat as the fleet grows)."""
        ids = await self.live_sessions()
        return await self.loads_of(random.sample(ids, min(sample, len(ids), BATCH_GET_MAX)))

    async def loads_of(self, session_ids: list[str]) -> list[SessionLoad]:
        """These sessions' loads, as their last heartbeat recorded them (at most BATCH_GET_MAX ids)."""
        keys = [{"session_id": _s(sid)} for sid in session_ids]
        loads: list[SessionLoad] = []
        for _ in range(3):  # best effort: a rebalance round can do without a throttled session or two
            if not keys:
                break
            resp = await self._call("BatchGetItem", RequestItems={self.sessions: {
                "Keys": keys, "ProjectionExpression": "session_id, held, #cap, draining, started_at_ms",
                "ExpressionAttributeNames": {"#cap": "capacity"}}})  # a reserved word
            for raw in resp.get("Responses", {}).get(self.sessions, []):
                with contextlib.suppress(KeyError, ValueError, TypeError):  # a malformed session: skip it
                    loads.append(SessionLoad(raw["session_id"]["S"], _num(raw, "held"), _num(raw, "capacity"),
                                             bool(raw.get("draining", {}).get("BOOL", False)),
                                             _num(raw, "started_at_ms")))
            keys = resp.get("UnprocessedKeys", {}).get(self.sessions, {}).get("Keys", [])
            if keys:
                await asyncio.sleep(0.05 + 0.05 * random.random())
        return loads

    async def push(self, connection_id: str, me: str, epoch: int, last_seq: int, to: str) -> Outcome:
        """Session mode: hand a held item straight to the live session ``to`` (rebalancing), recording
        the final ``last_seq``.  ``to`` adopts it with a claim conditioned on being its owner."""
        values = {":to": _s(to), ":now": _n(self.clock.now_ms()), ":one": _n(1), ":me": _s(me),
                  ":epoch": _n(epoch), ":started": _s(STARTED)}
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression=f"SET lease_owner = :to, {_set_seq(values, last_seq)}updated_at_ms = :now "
                             "ADD lease_epoch :one",
            ConditionExpression="lease_owner = :me AND lease_epoch = :epoch AND desired_state = :started",
            ExpressionAttributeValues=values,
        )
        return outcome

    async def session_is_dead(self, session_id: str) -> bool:
        """Consistent read: missing, or carrying a tombstone (final).  An expired session without one is
        not dead yet: a late renewal may still extend it until someone writes the tombstone."""
        return (await self.fate(session_id)).fate in (Fate.DEAD, Fate.GONE)

    def expired(self, expiry_ms: int, grace_ms: int = 0) -> bool:
        """A session with this expiry is dead for everyone (past the skew), and ``grace_ms`` more."""
        return expiry_ms < self.clock.now_ms() - self.skew_ms - grace_ms

    async def delete_dead_session(self, session_id: str) -> Outcome:
        """Forget a dead session that owns nothing, once ``dead_grace_ms`` past its tombstone (LOST
        before, and for a session without one): a claim it sent before dying has landed by then."""
        outcome, _ = await self._write(
            "DeleteItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            ConditionExpression="dead_at_ms < :t",
            ExpressionAttributeValues={":t": _n(self.clock.now_ms() - self.skew_ms - self.dead_grace_ms)},
        )
        return outcome

    def past_grace(self, dead_at_ms: int) -> bool:
        """A session that died at ``dead_at_ms`` can no longer have a claim land (see delete_dead_session)."""
        return dead_at_ms < self.clock.now_ms() - self.skew_ms - self.dead_grace_ms

    async def free_stopped(self, connection_id: str, owner: str) -> Outcome:
        """Free a STOPPED item that ``owner`` owns but does not stream: a dead session's (nobody may
        claim it, so no one else would clear its owner, and the dead session could never be
        forgotten), or one handed to us that was stopped before we adopted it."""
        return await self.disown(connection_id, owner, stopped_only=True)

    async def disown(self, connection_id: str, owner: str, stopped_only: bool = False,
                     epoch: int | None = None) -> Outcome:
        """Make an item ``owner`` owns, and does not stream, free (its ``last_seq`` is kept); with
        ``epoch``, only that tenure of it (a claim won too late to be used)."""
        cond = "lease_owner = :owner" + (" AND desired_state = :stopped" if stopped_only else "")
        values = {":zero": _n(0), ":now": _n(self.clock.now_ms()), ":owner": _s(owner)}
        if stopped_only:
            values[":stopped"] = _s(STOPPED)
        if epoch is not None:
            cond += " AND lease_epoch = :epoch"
            values[":epoch"] = _n(epoch)
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.conns,
            Key={"connection_id": _s(connection_id)},
            UpdateExpression="SET lease_expires_at_ms = :zero, updated_at_ms = :now REMOVE lease_owner",
            ConditionExpression=cond,
            ExpressionAttributeValues=values,
        )
        return outcome

    async def mark_offering(self, session_id: str, token: str) -> Outcome:
        """Say, on our own live session, that every stream it held is closed and flushed: from now its
        offers carrying ``token`` may be taken.  Peers check the mark before taking an offer, so a hint
        alone (a stale or forged one) can never take a stream its owner still streams, nor set a resume
        point the owner did not send."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="SET offering_at_ms = :now, offering_token = :tok",
            ConditionExpression="attribute_not_exists(dead_at_ms) AND expires_at_ms >= :now",
            ExpressionAttributeValues={":now": _n(self.clock.now_ms()), ":tok": _s(token)},
        )
        return outcome

    async def offers_open(self, session_id: str, token: str) -> OffersOpen:
        """Whether offers of a session carrying ``token`` may be taken, by a consistent read (see OffersOpen)."""
        try:
            resp = await self._call("GetItem", TableName=self.sessions, ConsistentRead=True,
                                    Key={"session_id": _s(session_id)},
                                    ProjectionExpression="offering_token, dead_at_ms")
        except Exception:
            return OffersOpen.UNKNOWN
        item = resp.get("Item") or {}
        if token and _str(item, "offering_token") == token:
            return OffersOpen.WITH_SEQ
        return OffersOpen.DEAD if "dead_at_ms" in item else OffersOpen.NO

    async def mark_draining(self, session_id: str) -> Outcome:
        """Tell rebalancing peers not to hand us streams: we are shutting down."""
        outcome, _ = await self._write(
            "UpdateItem",
            TableName=self.sessions,
            Key={"session_id": _s(session_id)},
            UpdateExpression="SET draining = :t",
            ConditionExpression="attribute_not_exists(dead_at_ms) AND expires_at_ms >= :now",
            ExpressionAttributeValues={":t": {"BOOL": True}, ":now": _n(self.clock.now_ms())},
        )
        return outcome

    async def list_sessions(self) -> list[dict[str, Any]]:
        """Every session item (for ``ctl sessions``; a scan, so not for the hot path)."""
        items: list[dict[str, Any]] = []
        start: dict[str, Any] | None = None
        while True:
            kwargs: dict[str, Any] = {"TableName": self.sessions}
            if start:
                kwargs["ExclusiveStartKey"] = start
            resp = await self._call("Scan", **kwargs)
            items += resp.get("Items", [])
            start = resp.get("LastEvaluatedKey")
            if not start:
                return items


def _set_seq(values: dict[str, Any], last_seq: int) -> str:
    """The ``last_seq = :seq, `` part of a SET clause, or nothing for -1 (no resume point known)."""
    if last_seq < 0:
        return ""
    values[":seq"] = _n(last_seq)
    return "last_seq = :seq, "


def _was_retried(resp: dict[str, Any]) -> bool:
    err = resp.get("error")
    meta = getattr(err, "response", {}).get("ResponseMetadata", {}) if err is not None else {}
    return int(meta.get("RetryAttempts", 0)) > 0


_SNAKE = {
    "UpdateItem": "update_item", "GetItem": "get_item", "PutItem": "put_item", "DeleteItem": "delete_item",
    "Query": "query", "Scan": "scan", "BatchGetItem": "batch_get_item", "BatchWriteItem": "batch_write_item",
}
