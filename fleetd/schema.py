"""The DynamoDB tables and SQS queue fleetd needs (SPEC §2), and ``fleetd init``.

``TABLES`` is the single definition of the schema: ``init`` creates it, ``init
--check`` compares a deployment against it, a shard's boot checks the messages
table with :func:`verify_messages_table`, and the CloudFormation test compares
``deploy/fleetd.yaml`` against it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fleetd.aio import Backoff
from fleetd.aws import error_code
from fleetd.config import AwsConfig

HELD_BY_SESSION = 2**53 - 1
"""``lease_expires_at_ms`` of an item owned by a live session (never < now)."""

STATE_EXPIRY_INDEX = "by_state_expiry"
OWNER_INDEX = "by_owner"
EXPIRY_INDEX = "by_expiry"
SESSION_KIND = "session"


class SchemaError(Exception):
    """A table differs from the schema fleetd needs (or is missing): a restart cannot fix it."""


@dataclass(frozen=True, slots=True)
class Index:
    name: str
    hash_key: tuple[str, str]
    range_key: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Table:
    """One table: keys as (attribute, type) pairs, KEYS_ONLY GSIs, optional TTL attribute."""

    role: str  # the AwsConfig field holding its name
    hash_key: tuple[str, str]
    range_key: tuple[str, str] | None = None
    indexes: tuple[Index, ...] = ()
    ttl_attribute: str | None = None

    def name(self, cfg: AwsConfig) -> str:
        return str(getattr(cfg, self.role))


TABLES: tuple[Table, ...] = (
    Table(
        "connections_table",
        ("connection_id", "S"),
        indexes=(
            Index(STATE_EXPIRY_INDEX, ("desired_state", "S"), ("lease_expires_at_ms", "N")),
            Index(OWNER_INDEX, ("lease_owner", "S")),
        ),
    ),
    Table(
        "sessions_table",
        ("session_id", "S"),
        indexes=(Index(EXPIRY_INDEX, ("kind", "S"), ("expires_at_ms", "N")),),
        ttl_attribute="ttl",
    ),
    Table("messages_table", ("connection_id", "S"), ("seq", "N")),
)
MESSAGES = next(t for t in TABLES if t.role == "messages_table")


def _key_schema(hash_key: tuple[str, str], range_key: tuple[str, str] | None) -> list[dict[str, str]]:
    schema = [{"AttributeName": hash_key[0], "KeyType": "HASH"}]
    if range_key:
        schema.append({"AttributeName": range_key[0], "KeyType": "RANGE"})
    return schema


def create_table_request(table: Table, cfg: AwsConfig) -> dict[str, Any]:
    """The CreateTable parameters of ``table`` (on-demand, KEYS_ONLY GSIs)."""
    attrs = {table.hash_key, *([table.range_key] if table.range_key else [])}
    for ix in table.indexes:
        attrs |= {ix.hash_key, *([ix.range_key] if ix.range_key else [])}
    req: dict[str, Any] = {
        "TableName": table.name(cfg),
        "BillingMode": "PAY_PER_REQUEST",
        "KeySchema": _key_schema(table.hash_key, table.range_key),
        "AttributeDefinitions": [{"AttributeName": a, "AttributeType": t} for a, t in sorted(attrs)],
    }
    if table.indexes:
        req["GlobalSecondaryIndexes"] = [
            {
                "IndexName": ix.name,
                "KeySchema": _key_schema(ix.hash_key, ix.range_key),
                "Projection": {"ProjectionType": "KEYS_ONLY"},
            }
            for ix in table.indexes
        ]
    return req


async def describe(ddb: Any, name: str) -> dict[str, Any] | None:
    try:
        resp = await ddb.describe_table(TableName=name)
    except Exception as e:
        if error_code(e) == "ResourceNotFoundException":
            return None
        raise
    return dict(resp["Table"])


async def _wait_active(ddb: Any, name: str, timeout_s: float = 300.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    backoff = Backoff(0.05, 1.0)  # local servers are ACTIVE almost at once; real DynamoDB takes seconds
    while loop.time() < deadline:
        desc = await describe(ddb, name)
        if desc and desc.get("TableStatus") == "ACTIVE" and all(
            g.get("IndexStatus", "ACTIVE") == "ACTIVE" for g in desc.get("GlobalSecondaryIndexes", [])
        ):
            return
        await asyncio.sleep(backoff.next())
    raise TimeoutError(f"table {name} not ACTIVE after {timeout_s:.0f} s")


async def _enable_ttl(ddb: Any, name: str, attribute: str) -> str:
    """Turn TTL on; best effort because dynalite does not implement UpdateTimeToLive."""
    try:
        await ddb.update_time_to_live(
            TableName=name, TimeToLiveSpecification={"Enabled": True, "AttributeName": attribute}
        )
        return f"TTL on {attribute} enabled"
    except Exception as e:
        code = error_code(e)
        if code == "ValidationException" and "already enabled" in str(e):
            return f"TTL on {attribute} already enabled"
        if code in ("UnknownOperationException", "ValidationException"):
            return f"warning: TTL on {attribute} not enabled ({code}); expired sessions are still cleaned by fleetd"
        raise


async def init(ddb: Any, sqs: Any, cfg: AwsConfig) -> list[str]:
    """Create whatever is missing; return one line per table/queue saying what happened."""
    lines: list[str] = []
    for table in TABLES:
        name = table.name(cfg)
        if await describe(ddb, name) is None:
            try:
                await ddb.create_table(**create_table_request(table, cfg))
                lines.append(f"created table {name}")
            except Exception as e:
                if error_code(e) != "ResourceInUseException":  # a concurrent init won the race
                    raise
                lines.append(f"found table {name}")
            await _wait_active(ddb, name)
        else:
            lines.append(f"found table {name}")
            lines += [f"  warning: {p}" for p in compare(table, cfg, await describe(ddb, name))]
        if table.ttl_attribute:
            lines.append(f"  {await _enable_ttl(ddb, name, table.ttl_attribute)}")
    lines.append(await _ensure_queue(sqs, cfg.hints_queue))
    return lines


async def _ensure_queue(sqs: Any, name: str) -> str:
    try:
        await sqs.get_queue_url(QueueName=name)
        return f"found queue {name}"
    except Exception as e:
        if "NonExistentQueue" not in error_code(e) and "QueueDoesNotExist" not in error_code(e):
            raise
    await sqs.create_queue(QueueName=name, Attributes={"ReceiveMessageWaitTimeSeconds": "20"})
    return f"created queue {name}"


Key = tuple[str, str] | None  # (attribute, type) of a hash or range key; None: no such key


def _keys_of(schema: list[dict[str, str]], types: dict[str, str]) -> tuple[Key, Key]:
    by_type = {k["KeyType"]: (k["AttributeName"], types.get(k["AttributeName"], "?")) for k in schema}
    return by_type.get("HASH"), by_type.get("RANGE")


def _key_diff(got: tuple[Key, Key], expected: tuple[Key, Key]) -> str:
    """Names each key that differs, e.g. ``hash key is id (S), expected connection_id (S)``."""
    def show(key: Key) -> str:
        return f"{key[0]} ({key[1]})" if key else "missing"

    return "; ".join(f"{role} key is {show(g)}, expected {show(e)}"
                     for role, g, e in zip(("hash", "range"), got, expected, strict=True) if g != e)


def compare(table: Table, cfg: AwsConfig, desc: dict[str, Any] | None) -> list[str]:
    """Every difference between a DescribeTable result and the expected schema."""
    name = table.name(cfg)
    if desc is None:
        return [f"table {name} is missing (run `fleetd init`)"]
    types = {a["AttributeName"]: a["AttributeType"] for a in desc.get("AttributeDefinitions", [])}
    problems: list[str] = []
    got = _keys_of(desc["KeySchema"], types)
    if got != (table.hash_key, table.range_key):
        problems.append(f"table {name}: key schema differs: {_key_diff(got, (table.hash_key, table.range_key))}")
    present = {g["IndexName"]: g for g in desc.get("GlobalSecondaryIndexes", [])}
    for ix in table.indexes:
        g = present.pop(ix.name, None)
        if g is None:
            problems.append(f"table {name}: index {ix.name} is missing")
            continue
        got_ix = _keys_of(g["KeySchema"], types)
        if got_ix != (ix.hash_key, ix.range_key):
            problems.append(f"table {name}: index {ix.name} keys are {got_ix}, expected {(ix.hash_key, ix.range_key)}")
        projection = g.get("Projection", {}).get("ProjectionType")
        if projection not in ("KEYS_ONLY", "ALL", "INCLUDE"):
            problems.append(f"table {name}: index {ix.name} has projection {projection}")
    return problems


async def verify_messages_table(ddb: Any, cfg: AwsConfig) -> None:
    """Raise :class:`SchemaError` naming each difference if the messages table is missing or keyed otherwise.

    The sink can write nothing to a table not keyed (``connection_id`` S, ``seq`` N);
    checked at boot, before any message is accepted.  AWS errors (throttling, access
    denied, timeouts) propagate unchanged, for the caller to retry or give up on.
    """
    problems = compare(MESSAGES, cfg, await describe(ddb, MESSAGES.name(cfg)))
    if problems:
        raise SchemaError("; ".join(problems))


def extra_indexes(table: Table, desc: dict[str, Any] | None) -> list[str]:
    """Indexes fleetd does not use: worth a note, not a failure."""
    expected = {ix.name for ix in table.indexes}
    return [g["IndexName"] for g in (desc or {}).get("GlobalSecondaryIndexes", []) if g["IndexName"] not in expected]


async def check(ddb: Any, sqs: Any, cfg: AwsConfig) -> list[str]:
    """Differences between the deployment and the expected schema; empty when it matches."""
    problems: list[str] = []
    for table in TABLES:
        desc = await describe(ddb, table.name(cfg))
        problems += compare(table, cfg, desc)
        for extra in extra_indexes(table, desc):
            print(f"note: table {table.name(cfg)} has an index fleetd does not use: {extra}")
    try:
        await sqs.get_queue_url(QueueName=cfg.hints_queue)
    except Exception as e:
        if "NonExistentQueue" not in error_code(e) and "QueueDoesNotExist" not in error_code(e):
            raise
        problems.append(f"queue {cfg.hints_queue} is missing (run `fleetd init`)")
    return problems
