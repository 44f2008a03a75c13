"""``fleetd init`` and ``init --check`` through the CLI, against the local stack."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest

from fleetd import config, exits, schema
from fleetd.config import Config
from fleetd.devstack import DevStack
from tests.helpers import arun, clients, run_cli


@pytest.fixture
def fresh(stack: DevStack, monkeypatch: pytest.MonkeyPatch) -> Config:
    """Unique names for which nothing exists yet, exported as FLEETD_* for the in-process CLI."""
    prefix = f"s{uuid.uuid4().hex[:10]}"
    cfg = config.replace(config.load(env={}), connections_table=f"{prefix}-connections",
                         sessions_table=f"{prefix}-sessions", messages_table=f"{prefix}-messages",
                         hints_queue=f"{prefix}-hints")
    for name in list(os.environ):
        if name.startswith("FLEETD_"):
            monkeypatch.delenv(name)
    for name, value in config.as_env(cfg).items():
        if name.endswith(("_TABLE", "_QUEUE")):
            monkeypatch.setenv(name, value)
    return cfg


def fleetd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


def table_names(cfg: Config) -> list[str]:
    return [t.name(cfg.aws) for t in schema.TABLES]


def snapshot(cfg: Config) -> dict[str, Any]:
    """DescribeTable of every table and the queue's attributes."""
    async def main() -> dict[str, Any]:
        async with clients(cfg) as c:
            out: dict[str, Any] = {}
            for name in table_names(cfg):
                out[name] = (await c.dynamodb.describe_table(TableName=name))["Table"]
            url = (await c.sqs.get_queue_url(QueueName=cfg.aws.hints_queue))["QueueUrl"]
            out[url] = (await c.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"]))["Attributes"]
            return out

    return arun(main())


def test_init_twice_creates_then_finds_and_changes_nothing(fresh: Config,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, first, err = fleetd(capsys, "init")
    assert (code, err) == (exits.OK, "")
    for name in table_names(fresh):
        assert f"created table {name}" in first.splitlines()
    assert f"created queue {fresh.aws.hints_queue}" in first.splitlines()
    before = snapshot(fresh)

    code, second, err = fleetd(capsys, "init")
    assert (code, err) == (exits.OK, "")
    for name in table_names(fresh):
        assert f"found table {name}" in second.splitlines()
    assert f"found queue {fresh.aws.hints_queue}" in second.splitlines()
    assert "created" not in second
    assert snapshot(fresh) == before


def test_created_tables_match_the_schema(fresh: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleetd(capsys, "init")[0] == exits.OK
    tables = snapshot(fresh)
    conns = tables[fresh.aws.connections_table]
    assert conns["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    indexes = {g["IndexName"]: g for g in conns["GlobalSecondaryIndexes"]}
    assert set(indexes) == {schema.STATE_EXPIRY_INDEX, schema.OWNER_INDEX}
    assert all(g["Projection"]["ProjectionType"] == "KEYS_ONLY" for g in indexes.values())
    assert indexes[schema.STATE_EXPIRY_INDEX]["KeySchema"] == [
        {"AttributeName": "desired_state", "KeyType": "HASH"},
        {"AttributeName": "lease_expires_at_ms", "KeyType": "RANGE"}]
    messages = tables[fresh.aws.messages_table]
    assert messages["KeySchema"] == [{"AttributeName": "connection_id", "KeyType": "HASH"},
                                     {"AttributeName": "seq", "KeyType": "RANGE"}]


def test_check_is_ok_on_a_fresh_deployment(fresh: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleetd(capsys, "init")[0] == exits.OK
    code, out, err = fleetd(capsys, "init", "--check")
    assert (code, out.strip(), err) == (exits.OK, "schema OK", "")


def test_check_reports_everything_missing_before_init(fresh: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = fleetd(capsys, "init", "--check")
    assert code == exits.FAILURE
    for name in (*table_names(fresh), fresh.aws.hints_queue):
        assert any(name in line and "missing" in line for line in out.splitlines()), out


def test_check_names_a_missing_by_owner_index(fresh: Config, capsys: pytest.CaptureFixture[str]) -> None:
    request = schema.create_table_request(schema.TABLES[0], fresh.aws)
    assert request["TableName"] == fresh.aws.connections_table
    request["GlobalSecondaryIndexes"] = [g for g in request["GlobalSecondaryIndexes"]
                                         if g["IndexName"] != schema.OWNER_INDEX]
    # DynamoDB rejects attribute definitions that no key uses.
    request["AttributeDefinitions"] = [a for a in request["AttributeDefinitions"]
                                       if a["AttributeName"] != "lease_owner"]

    async def create() -> None:
        async with clients(fresh) as c:
            await c.dynamodb.create_table(**request)

    arun(create())
    code, out, _ = fleetd(capsys, "init")  # creates the rest; leaves the drifted table alone
    assert code == exits.OK
    assert f"found table {fresh.aws.connections_table}" in out.splitlines()

    code, out, _ = fleetd(capsys, "init", "--check")
    assert code == exits.FAILURE
    problems = out.strip().splitlines()
    assert len(problems) == 1, out
    assert schema.OWNER_INDEX in problems[0] and fresh.aws.connections_table in problems[0]


def test_missing_update_time_to_live_is_a_warning(fresh: Config, capsys: pytest.CaptureFixture[str]) -> None:
    """dynalite does not implement UpdateTimeToLive: init says so and still succeeds."""
    code, out, err = fleetd(capsys, "init")
    assert (code, err) == (exits.OK, "")
    ttl_lines = [line.strip() for line in out.splitlines() if "TTL" in line]
    assert len(ttl_lines) == 1  # only the sessions table has a TTL attribute
    assert ttl_lines[0].startswith("warning: TTL on ttl not enabled")
    assert fleetd(capsys, "init", "--check")[0] == exits.OK


def test_compare_reports_key_schema_drift() -> None:
    table = schema.TABLES[2]  # messages: (connection_id, seq)
    aws = config.AwsConfig()
    desc = {"KeySchema": [{"AttributeName": "connection_id", "KeyType": "HASH"}],
            "AttributeDefinitions": [{"AttributeName": "connection_id", "AttributeType": "S"}]}
    problems = schema.compare(table, aws, desc)
    assert len(problems) == 1 and "key schema" in problems[0] and aws.messages_table in problems[0]
    assert schema.compare(table, aws, None) == [f"table {aws.messages_table} is missing (run `fleetd init`)"]


def test_messages_table_check_names_the_wrong_key(fresh: Config) -> None:
    """The shard's boot check: a messages table it cannot write to is an error naming the difference."""
    name = fresh.aws.messages_table

    async def create(hash_key: str, seq_type: str | None) -> None:
        keys = [{"AttributeName": hash_key, "KeyType": "HASH"}]
        attrs = [{"AttributeName": hash_key, "AttributeType": "S"}]
        if seq_type:
            keys.append({"AttributeName": "seq", "KeyType": "RANGE"})
            attrs.append({"AttributeName": "seq", "AttributeType": seq_type})
        async with clients(fresh) as c:
            await c.dynamodb.create_table(TableName=name, BillingMode="PAY_PER_REQUEST", KeySchema=keys,
                                          AttributeDefinitions=attrs)

    async def check() -> str | None:
        async with clients(fresh) as c:
            try:
                await schema.verify_messages_table(c.dynamodb, fresh.aws)
            except schema.SchemaError as e:
                return str(e)
            return None

    async def drop() -> None:
        async with clients(fresh) as c:
            await c.dynamodb.delete_table(TableName=name)
            for _ in range(200):
                if await schema.describe(c.dynamodb, name) is None:
                    return
                await asyncio.sleep(0.05)
        raise AssertionError(f"table {name} still exists")

    assert "missing" in str(arun(check()))
    arun(create("id", None))
    wrong = arun(check())
    assert wrong is not None and name in wrong
    assert "hash key is id (S), expected connection_id (S)" in wrong and "expected seq (N)" in wrong
    arun(drop())
    arun(create("connection_id", "S"))
    wrong = arun(check())
    assert wrong is not None and "range key is seq (S), expected seq (N)" in wrong and "hash key" not in wrong
    arun(drop())
    arun(create("connection_id", "N"))  # the right one: connection_id S, seq N
    assert arun(check()) is None


def test_create_table_request_is_on_demand_and_keys_only() -> None:
    aws = config.AwsConfig()
    for table in schema.TABLES:
        req = schema.create_table_request(table, aws)
        assert req["BillingMode"] == "PAY_PER_REQUEST"
        assert all(g["Projection"] == {"ProjectionType": "KEYS_ONLY"} for g in req.get("GlobalSecondaryIndexes", []))
        used = {k["AttributeName"] for k in req["KeySchema"]}
        used |= {k["AttributeName"] for g in req.get("GlobalSecondaryIndexes", []) for k in g["KeySchema"]}
        assert {a["AttributeName"] for a in req["AttributeDefinitions"]} == used


def test_local_dynamodb_keeps_every_gsi_entry(cfg: config.Config) -> None:
    """dynalite as installed by `npm ci` (tools/patch-dynalite.js): thousands of items sharing one index key
    all stay in the index.  Unpatched, entries whose table-key hashes share six hex digits overwrite each
    other, and a free connection can vanish from reconcile's query (c01263 did, among c00000–c01499)."""
    import boto3

    client = boto3.client("dynamodb")
    ids = [f"c{i:05d}" for i in range(1500)]
    for i in range(0, len(ids), 25):
        client.batch_write_item(RequestItems={cfg.aws.connections_table: [
            {"PutRequest": {"Item": {"connection_id": {"S": cid}, "desired_state": {"S": "STARTED"},
                                     "lease_expires_at_ms": {"N": "0"}}}} for cid in ids[i:i + 25]]})
    seen: set[str] = set()
    kwargs: dict[str, Any] = {
        "TableName": cfg.aws.connections_table, "IndexName": schema.STATE_EXPIRY_INDEX,
        "KeyConditionExpression": "desired_state = :s AND lease_expires_at_ms < :t",
        "ExpressionAttributeValues": {":s": {"S": "STARTED"}, ":t": {"N": "1"}}}
    while True:
        resp = client.query(**kwargs)
        seen |= {item["connection_id"]["S"] for item in resp["Items"]}
        if "LastEvaluatedKey" not in resp:
            break
        kwargs["ExclusiveStartKey"] = resp["LastEvaluatedKey"]
    assert seen == set(ids), f"missing from the index: {sorted(set(ids) - seen)[:5]}"
