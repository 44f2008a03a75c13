"""SimDynamo (bench/sim/dynamo.py) against moto, and the rules moto does not model (GSI lag, limits, pages).

The differential test drives fleetd's own ``LeaseStore`` (and the ``ctl start`` / ``ctl stop`` requests)
through a client that sends every request to both SimDynamo and moto's in-process DynamoDB and checks
that they agree: same outcome (success or error code), same returned item, same query pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moto.dynamodb.models import dynamodb_backends
from moto.dynamodb.responses import DynamoHandler

from bench.sim.dynamo import SimDynamo
from fleetd import config, schema
from fleetd.clock import ManualClock
from fleetd.lease import LeaseStore, SessionInfo

ACCOUNT, REGION = "123456789012", "us-east-1"
CFG = config.load(env={})
CONNS, SESSIONS, MESSAGES = CFG.aws.connections_table, CFG.aws.sessions_table, CFG.aws.messages_table
CIDS = [f"c{i}" for i in range(5)]
OWNERS = ["s1", "s2", "s3"]
COVERAGE: Counter[str] = Counter()


def _snake(op: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", op).lower()


def _code(e: BaseException | None) -> str:
    return "" if e is None else str(getattr(e, "response", {}).get("Error", {}).get("Code", type(e).__name__))


class Moto:
    """moto's DynamoDB in process: its response handler, without HTTP."""

    def __init__(self) -> None:
        dynamodb_backends[ACCOUNT][REGION].reset()
        self.handler = DynamoHandler()
        self.handler.current_account = ACCOUNT
        self.handler.region = REGION

    def handle(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        self.handler.body = copy.deepcopy(params)
        try:
            result = getattr(self.handler, _snake(op))()
        except Exception as e:
            error_type = getattr(e, "error_type", None)
            if error_type is None:
                raise
            body = json.loads(e.get_body()) if hasattr(e, "get_body") else {}
            resp: dict[str, Any] = {"Error": {"Code": error_type.split("#")[-1], "Message": str(e)}}
            if "Item" in body:
                resp["Item"] = body["Item"]
            raise ClientError(resp, op) from None
        return dict(result.result)


class MotoCrashed(Exception):
    """moto raised an internal error instead of answering (a moto bug): the two can no longer be compared."""


def _run(backend: Any, op: str, params: dict[str, Any]) -> tuple[dict[str, Any] | None, ClientError | None]:
    try:
        return backend.handle(op, copy.deepcopy(params)), None
    except ClientError as e:
        return None, e
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        if isinstance(backend, Moto):
            raise MotoCrashed(f"{op}: {type(e).__name__}: {e}") from e
        raise


def _clean(resp: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in resp.items() if k not in ("ResponseMetadata", "ConsumedCapacity")}
    if out.get("Attributes") == {}:
        del out["Attributes"]
    return out


def _sorted_items(items: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(i, sort_keys=True) for i in items)


def _same_page(params: dict[str, Any], sim: dict[str, Any], moto: dict[str, Any]) -> None:
    """Query pages agree; SimDynamo, like the real service, also sends a LastEvaluatedKey when it stopped
    at Limit with nothing left (moto only when more items remain)."""
    assert sim["Items"] == moto["Items"], (params, sim, moto)
    assert sim["Count"] == moto["Count"]
    if "LastEvaluatedKey" in moto:
        assert sim.get("LastEvaluatedKey") == moto["LastEvaluatedKey"]
    elif "LastEvaluatedKey" in sim:
        assert sim["ScannedCount"] == params.get("Limit"), (params, sim)


def _same(op: str, params: dict[str, Any], sim: dict[str, Any], moto: dict[str, Any]) -> None:
    sim, moto = _clean(sim), _clean(moto)
    if op == "Query":
        _same_page(params, sim, moto)
    elif op == "Scan":
        if "LastEvaluatedKey" not in sim and "LastEvaluatedKey" not in moto:
            assert _sorted_items(sim["Items"]) == _sorted_items(moto["Items"])
    elif op == "BatchGetItem":
        assert sim["Responses"].keys() == moto["Responses"].keys()
        for table, items in sim["Responses"].items():
            assert _sorted_items(items) == _sorted_items(moto["Responses"][table]), (params, sim, moto)
    elif op == "UpdateItem" and params.get("ReturnValues", "").startswith("UPDATED"):
        # moto leaves out attributes the update set to their old value (DynamoDB returns every one), and
        # adds the key of an item the update created (DynamoDB returns only the updated attributes).
        got = sim.get("Attributes", {})
        assert all(got.get(k) == v for k, v in moto.get("Attributes", {}).items() if k != "connection_id"), (
            params, sim, moto)
    elif op in ("UpdateItem", "PutItem", "DeleteItem", "GetItem"):
        assert sim == moto, (op, params, sim, moto)


def _runtime_error_first(sim_err: ClientError | None, moto_err: ClientError | None) -> bool:
    """moto applies the update before checking the condition, so an update that cannot apply (missing operand,
    wrong type) fails validation there even when the condition is false; DynamoDB (and dynalite) check the
    condition first and answer ConditionalCheckFailed."""
    return _code(sim_err) == "ConditionalCheckFailedException" and _code(moto_err) == "ValidationException" and (
        "does not exist in the item" in str(moto_err) or "incorrect data type" in str(moto_err))


class DiffClient:
    """An aiobotocore-like DynamoDB client: each request goes to SimDynamo and to moto, which must agree;
    the caller gets SimDynamo's answer."""

    def __init__(self, sim: SimDynamo, moto: Moto) -> None:
        self.sim, self.moto = sim, moto

    def call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        sim, sim_err = _run(self.sim, op, params)
        moto, moto_err = _run(self.moto, op, params)
        if _runtime_error_first(sim_err, moto_err):
            COVERAGE["UpdateItem condition before update errors"] += 1
            raise sim_err  # type: ignore[misc]
        assert _code(sim_err) == _code(moto_err), (op, params, sim_err, moto_err)
        COVERAGE[f"{op} {_code(sim_err) or 'ok'}"] += 1
        if sim_err is not None:
            assert moto_err is not None
            assert sim_err.response.get("Item") == moto_err.response.get("Item"), (op, params)
            raise sim_err
        assert sim is not None and moto is not None
        _same(op, params, sim, moto)
        return sim

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = "".join(part.title() for part in name.split("_"))

        async def method(**kwargs: Any) -> dict[str, Any]:
            return self.call(op, kwargs)
        return method


def _setup(client: DiffClient) -> None:
    for table in schema.TABLES:
        client.call("CreateTable", schema.create_table_request(table, CFG.aws))
    # Items exist from the start, as `bench/procs.py seed_items` writes them.
    client.call("BatchWriteItem", {"RequestItems": {CONNS: [{"PutRequest": {"Item": {
        "connection_id": {"S": cid}, "desired_state": {"S": "STARTED"}, "ws_url": {"S": "ws://u/" + cid},
        "lease_expires_at_ms": {"N": "0"}, "lease_epoch": {"N": "0"}, "last_seq": {"N": "0"},
        "created_at_ms": {"N": "1"}, "updated_at_ms": {"N": "1"}}}} for cid in CIDS[:3]]}})


def _ctl_start(client: DiffClient, cid: str, url: str, now: int) -> None:
    """The request of `fleetd ctl start` (ctl.py)."""
    client.call("UpdateItem", dict(
        TableName=CONNS, Key={"connection_id": {"S": cid}},
        UpdateExpression="SET desired_state = :started, ws_url = :url, updated_at_ms = :now, "
                         "created_at_ms = if_not_exists(created_at_ms, :now), "
                         "lease_expires_at_ms = if_not_exists(lease_expires_at_ms, :zero), "
                         "lease_epoch = if_not_exists(lease_epoch, :zero), "
                         "last_seq = if_not_exists(last_seq, :zero)",
        ExpressionAttributeValues={":started": {"S": "STARTED"}, ":url": {"S": url}, ":now": {"N": str(now)},
                                   ":zero": {"N": "0"}},
        ReturnValues="ALL_OLD"))


def _ctl_stop(client: DiffClient, cid: str, now: int) -> None:
    """The request of `fleetd ctl stop` (ctl.py)."""
    client.call("UpdateItem", dict(
        TableName=CONNS, Key={"connection_id": {"S": cid}},
        UpdateExpression="SET desired_state = :stopped, updated_at_ms = :now",
        ConditionExpression="attribute_exists(connection_id)",
        ExpressionAttributeValues={":stopped": {"S": "STOPPED"}, ":now": {"N": str(now)}},
        ReturnValues="ALL_OLD"))


# ----- random expressions over the connection items ----------------------------------------------------

_ATOMS = [
    "lease_epoch = :n", "lease_epoch <> :n", "lease_epoch < :n", "lease_epoch <= :n", "lease_epoch > :n",
    "lease_epoch >= :n", "last_seq BETWEEN :lo AND :hi", "lease_owner = :s", "lease_owner <> :s",
    "lease_owner IN (:s, :s2)", "begins_with(ws_url, :p)", "contains(ws_url, :p)", "size(ws_url) > :n",
    "attribute_type(lease_epoch, :tn)", "attribute_type(lease_owner, :tn)", "attribute_exists(lease_owner)",
    "attribute_not_exists(lease_owner)", "attribute_exists(#n)", "desired_state = :st", "lease_epoch = last_seq",
    "lease_owner < :s", "nothing = :n", "nothing <> :n", "lease_owner = :n", "lease_epoch IN (:n, :lo)",
]
_UPDATES = [
    "SET last_seq = last_seq + :n", "SET last_seq = last_seq - :n", "SET last_seq = if_not_exists(last_seq, :n)",
    "ADD lease_epoch :n", "ADD hits :n", "REMOVE lease_owner", "SET lease_owner = :s REMOVE last_seq",
    "SET tags = list_append(if_not_exists(tags, :l), :l)", "SET missing_total = missing_total + :n",
    "ADD ws_url :n", "SET #n = :s", "ADD owners :ss", "DELETE owners :ss", "SET lease_epoch = :n, last_seq = :lo",
]
_VALUE_POOL: dict[str, Callable[[int], dict[str, Any]]] = {
    ":n": lambda r: {"N": str(r % 4)}, ":lo": lambda r: {"N": str(r % 2)}, ":hi": lambda r: {"N": str(2 + r % 3)},
    ":s": lambda r: {"S": OWNERS[r % 3]}, ":s2": lambda r: {"S": OWNERS[(r + 1) % 3]},
    ":p": lambda r: {"S": ["ws", "u/c1", "x"][r % 3]}, ":tn": lambda r: {"S": ["N", "S", "L"][r % 3]},
    ":st": lambda r: {"S": ["STARTED", "STOPPED"][r % 2]}, ":l": lambda r: {"L": [{"N": str(r % 3)}]},
    ":ss": lambda r: {"SS": OWNERS[: 1 + r % 3]},
}


@st.composite
def conditions(draw: st.DrawFn) -> str:
    atoms = draw(st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=3))
    expr = atoms[0]
    for atom in atoms[1:]:
        joiner = draw(st.sampled_from([" AND ", " OR ", " AND NOT "]))
        expr = f"({expr}){joiner}{atom}" if draw(st.booleans()) else f"{expr}{joiner}({atom})"
    return f"NOT ({expr})" if draw(st.booleans()) else expr


def _generic_update(client: DiffClient, cid: str, update: str, cond: str | None, r: int, rv: str,
                    on_fail: str) -> None:
    text = update + " " + (cond or "")
    values = {ph: _VALUE_POOL[ph](r) for ph in dict.fromkeys(re.findall(r":\w+", text))}
    params: dict[str, Any] = dict(TableName=CONNS, Key={"connection_id": {"S": cid}}, UpdateExpression=update,
                                  ReturnValues=rv, ReturnValuesOnConditionCheckFailure=on_fail)
    if cond:
        params["ConditionExpression"] = cond
    if values:
        params["ExpressionAttributeValues"] = values
    if "#n" in text:
        params["ExpressionAttributeNames"] = {"#n": "last_error"}
    client.call("UpdateItem", params)


# ----- the differential test ------------------------------------------------------------------------

cid_st, owner_st, epoch_st = st.sampled_from(CIDS), st.sampled_from(OWNERS), st.integers(0, 3)
limit_st = st.integers(1, 4)
step_st = st.one_of(
    st.tuples(st.just("start"), cid_st, st.sampled_from(["ws://a", "wss://b/c"])),
    st.tuples(st.just("stop"), cid_st),
    st.tuples(st.just("claim"), cid_st, owner_st, st.none() | owner_st),
    st.tuples(st.just("release"), cid_st, owner_st, epoch_st, st.integers(0, 50)),
    st.tuples(st.just("renew_item"), cid_st, owner_st, epoch_st),
    st.tuples(st.just("checkpoint"), cid_st, owner_st, epoch_st, st.integers(0, 50)),
    st.tuples(st.just("push"), cid_st, owner_st, epoch_st, owner_st),
    st.tuples(st.just("disown"), cid_st, owner_st, st.booleans()),
    st.tuples(st.just("session"), owner_st),
    st.tuples(st.just("renew_session"), owner_st, st.integers(0, 5), st.booleans()),
    st.tuples(st.just("notify"), owner_st),
    st.tuples(st.just("expire"), owner_st),
    st.tuples(st.just("delete_dead"), owner_st),
    st.tuples(st.just("drain"), owner_st),
    st.tuples(st.just("free_items"), limit_st),
    st.tuples(st.just("stopped_held"), limit_st),
    st.tuples(st.just("items_of"), owner_st, limit_st),
    st.tuples(st.just("dead_and_dying"), st.integers(0, 20_000), limit_st),
    st.tuples(st.just("desired"), st.lists(cid_st, min_size=1, max_size=5)),
    st.tuples(st.just("live_loads"), st.integers(1, 3)),
    st.tuples(st.just("list_sessions")),
    st.tuples(st.just("get"), cid_st),
    st.tuples(st.just("tick"), st.integers(0, 20)),
    st.tuples(st.just("generic"), cid_st, st.sampled_from(_UPDATES), st.none() | conditions(), st.integers(0, 11),
              st.sampled_from(["NONE", "ALL_NEW", "ALL_OLD", "UPDATED_NEW", "UPDATED_OLD"]),
              st.sampled_from(["NONE", "ALL_OLD"])),
)


async def _step(store: LeaseStore, client: DiffClient, clock: ManualClock, step: tuple[Any, ...]) -> None:
    kind, args = step[0], step[1:]
    now = clock.now_ms()
    if kind == "start":
        _swallow(_ctl_start, client, args[0], args[1], now)
    elif kind == "stop":
        _swallow(_ctl_stop, client, args[0], now)
    elif kind == "tick":
        clock.advance(args[0])
    elif kind == "generic":
        _swallow(_generic_update, client, *args)
    elif kind == "session":
        await store.create_session(SessionInfo(args[0], "task", 0, 10, "host", 1))
    else:
        await _lease_step(store, kind, args)


async def _lease_step(store: LeaseStore, kind: str, args: tuple[Any, ...]) -> None:
    calls: dict[str, Callable[..., Any]] = {
        "claim": store.claim, "release": store.release, "renew_item": store.renew_item,
        "checkpoint": store.checkpoint, "disown": store.disown, "renew_session": store.renew_session,
        "notify": store.notify_handed, "expire": store.expire_session, "delete_dead": store.delete_dead_session,
        "drain": store.mark_draining, "free_items": store.free_items, "stopped_held": store.stopped_held,
        "items_of": store.items_of, "dead_and_dying": store.dead_and_dying, "desired": store.desired_states,
        "live_loads": store.live_loads, "list_sessions": store.list_sessions, "get": store.get,
    }
    if kind == "push":
        await store.push(args[0], args[1], args[2], 7, args[3])
    else:
        await calls[kind](*args)


def _swallow(fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(ClientError):
        fn(*args)


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step_st, min_size=5, max_size=30), item_mode=st.booleans())
def test_agrees_with_moto(steps: list[tuple[Any, ...]], item_mode: bool) -> None:
    client = DiffClient(SimDynamo(), Moto())
    _setup(client)
    clock = ManualClock()
    lease = dataclasses.replace(CFG.lease, lease_mode="item" if item_mode else "session")
    store = LeaseStore(client, CFG.aws, lease, clock)

    async def run() -> None:
        for step in steps:
            await _step(store, client, clock, step)
    try:
        asyncio.run(run())
    except MotoCrashed:
        # moto crashed (e.g. size() of a missing attribute); its state may now differ from what it should
        # be, so the rest of this example cannot be compared.  Counted: the coverage test bounds it.
        COVERAGE["moto crashed"] += 1


def test_coverage_of_the_differential_test() -> None:
    """Runs after the differential test (file order): its requests reached both outcomes of the key calls."""
    if not COVERAGE:
        pytest.skip("the differential test did not run")
    print("\ndifferential coverage:", dict(sorted(COVERAGE.items())))
    for key in ("UpdateItem ok", "UpdateItem ConditionalCheckFailedException", "UpdateItem ValidationException",
                "Query ok", "BatchGetItem ok", "PutItem ok", "Scan ok", "GetItem ok"):
        assert COVERAGE[key] > 0, key
    assert COVERAGE["moto crashed"] <= 25, "moto crashed on too many examples for the comparison to mean much"


# ----- rules moto does not model --------------------------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 1_000_000
        self.lag = 0  # what every GSI write samples

    def now_ms(self) -> int:
        return self.now

    def lag_ms(self) -> int:
        return self.lag


def _sim(clock: FakeTime | None = None) -> SimDynamo:
    sim = SimDynamo(clock.now_ms, clock.lag_ms) if clock else SimDynamo()
    for table in schema.TABLES:
        sim.handle("CreateTable", schema.create_table_request(table, CFG.aws))
    return sim


def _owned(sim: SimDynamo, owner: str) -> list[str]:
    resp = sim.handle("Query", {"TableName": CONNS, "IndexName": "by_owner",
                                "KeyConditionExpression": "lease_owner = :o",
                                "ExpressionAttributeValues": {":o": {"S": owner}}})
    return [i["connection_id"]["S"] for i in resp["Items"]]


def _set_owner(sim: SimDynamo, cid: str, owner: str) -> None:
    sim.handle("UpdateItem", {"TableName": CONNS, "Key": {"connection_id": {"S": cid}},
                              "UpdateExpression": "SET lease_owner = :o",
                              "ExpressionAttributeValues": {":o": {"S": owner}}})


def test_gsi_image_visible_only_after_its_lag() -> None:
    clock = FakeTime()
    sim = _sim(clock)
    clock.lag = 500
    _set_owner(sim, "c1", "a")
    assert _owned(sim, "a") == []
    assert sim.handle("GetItem", {"TableName": CONNS, "Key": {"connection_id": {"S": "c1"}}})["Item"]["lease_owner"]
    clock.now += 499
    assert _owned(sim, "a") == []
    clock.now += 1
    assert _owned(sim, "a") == ["c1"]


def test_gsi_images_of_one_item_visible_in_write_order() -> None:
    clock = FakeTime()
    sim = _sim(clock)
    clock.lag = 1000
    _set_owner(sim, "c1", "a")
    clock.lag = 10  # the second write samples a shorter lag: it must still wait for the first
    _set_owner(sim, "c1", "b")
    clock.now += 10
    assert _owned(sim, "a") == [] and _owned(sim, "b") == []
    clock.now += 990
    assert _owned(sim, "a") == [] and _owned(sim, "b") == ["c1"]  # the older image never shows after the newer
    index = sim.tables[CONNS].indexes["by_owner"]
    assert not index.pending and len(index.latest) == 1


def test_gsi_delete_is_lagged_and_memory_is_dropped() -> None:
    clock = FakeTime()
    sim = _sim(clock)
    _set_owner(sim, "c1", "a")
    clock.lag = 300
    sim.handle("DeleteItem", {"TableName": CONNS, "Key": {"connection_id": {"S": "c1"}}})
    assert _owned(sim, "a") == ["c1"]
    clock.now += 300
    assert _owned(sim, "a") == []
    index = sim.tables[CONNS].indexes["by_owner"]
    assert not index.latest and not index.where and not index.parts


def _error(fn: Callable[[], Any]) -> ClientError:
    with pytest.raises(ClientError) as info:
        fn()
    return info.value


def test_limits() -> None:
    sim = _sim()

    def puts(n: int, same: bool = False) -> dict[str, Any]:
        return {"RequestItems": {MESSAGES: [{"PutRequest": {"Item": {
            "connection_id": {"S": "c"}, "seq": {"N": str(0 if same else i)}}}} for i in range(n)]}}
    assert sim.handle("BatchWriteItem", puts(25))["UnprocessedItems"] == {}
    assert _code(_error(lambda: sim.handle("BatchWriteItem", puts(26)))) == "ValidationException"
    assert _code(_error(lambda: sim.handle("BatchWriteItem", puts(2, same=True)))) == "ValidationException"
    keys = [{"connection_id": {"S": f"c{i}"}} for i in range(101)]
    get = {"RequestItems": {CONNS: {"Keys": keys}}}
    assert _code(_error(lambda: sim.handle("BatchGetItem", get))) == "ValidationException"
    get = {"RequestItems": {CONNS: {"Keys": keys[:100]}}}
    assert sim.handle("BatchGetItem", get)["Responses"] == {CONNS: []}
    dup = {"RequestItems": {CONNS: {"Keys": [keys[0], keys[0]]}}}
    assert _code(_error(lambda: sim.handle("BatchGetItem", dup))) == "ValidationException"
    big: dict[str, Any] = {"TableName": MESSAGES, "Item": {"connection_id": {"S": "c"}, "seq": {"N": "1"},
                                           "payload": {"S": "x" * 400 * 1024}}}
    assert _code(_error(lambda: sim.handle("PutItem", big))) == "ValidationException"
    big["Item"]["payload"] = {"S": "x" * 399 * 1024}
    sim.handle("PutItem", big)
    grow = {"TableName": MESSAGES, "Key": {"connection_id": {"S": "c"}, "seq": {"N": "1"}},
            "UpdateExpression": "SET more = :v", "ExpressionAttributeValues": {":v": {"S": "y" * 2048}}}
    assert _code(_error(lambda: sim.handle("UpdateItem", grow))) == "ValidationException"


def test_validation_errors() -> None:
    sim = _sim()
    cases: list[dict[str, Any]] = [
        {"TableName": CONNS, "Key": {"connection_id": {"N": "1"}}, "UpdateExpression": "SET a = :v",
         "ExpressionAttributeValues": {":v": {"S": "x"}}},  # wrong key type
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "ADD a :v",
         "ExpressionAttributeValues": {":v": {"S": "x"}}},  # ADD of a string
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET a = b + :v",
         "ExpressionAttributeValues": {":v": {"N": "1"}}},  # arithmetic on a missing attribute
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET a = :v",
         "ExpressionAttributeValues": {":v": {"S": "x"}, ":unused": {"S": "y"}}},
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET a = :missing"},
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET ttl = :v",
         "ExpressionAttributeValues": {":v": {"N": "1"}}},  # a reserved word without #name
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET connection_id = :v",
         "ExpressionAttributeValues": {":v": {"S": "x"}}},  # a key attribute
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET lease_owner = :v",
         "ExpressionAttributeValues": {":v": {"S": ""}}},  # an empty GSI key
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET a = :v REMOVE a",
         "ExpressionAttributeValues": {":v": {"S": "x"}}},  # overlapping paths
        {"TableName": CONNS, "Key": {"connection_id": {"S": "c"}}, "UpdateExpression": "SET a = :v",
         "ConditionExpression": "a BETWEEN :hi AND :lo",
         "ExpressionAttributeValues": {":v": {"S": "x"}, ":hi": {"N": "5"}, ":lo": {"N": "1"}}},
    ]
    for params in cases:
        assert _code(_error(functools.partial(sim.handle, "UpdateItem", params))) == "ValidationException", params
    query = {"TableName": CONNS, "IndexName": "by_owner", "ConsistentRead": True,
             "KeyConditionExpression": "lease_owner = :o", "ExpressionAttributeValues": {":o": {"S": "a"}}}
    assert _code(_error(lambda: sim.handle("Query", query))) == "ValidationException"
    assert _code(_error(lambda: sim.handle("GetItem", {"TableName": "nope", "Key": {}}))) == \
        "ResourceNotFoundException"
    create = schema.create_table_request(schema.TABLES[0], CFG.aws)
    assert _code(_error(lambda: sim.handle("CreateTable", create))) == "ResourceInUseException"


def test_condition_failure_returns_the_old_item() -> None:
    sim = _sim()
    _set_owner(sim, "c1", "a")
    params = {"TableName": CONNS, "Key": {"connection_id": {"S": "c1"}}, "UpdateExpression": "SET lease_owner = :b",
              "ConditionExpression": "lease_owner = :b", "ExpressionAttributeValues": {":b": {"S": "b"}},
              "ReturnValuesOnConditionCheckFailure": "ALL_OLD"}
    err = _error(lambda: sim.handle("UpdateItem", params))
    assert _code(err) == "ConditionalCheckFailedException"
    response: dict[str, Any] = dict(err.response)
    assert response["Item"] == {"connection_id": {"S": "c1"}, "lease_owner": {"S": "a"}}
    del params["ReturnValuesOnConditionCheckFailure"]
    assert "Item" not in _error(lambda: sim.handle("UpdateItem", params)).response


def test_gsi_pagination_over_many_pages_in_order() -> None:
    sim = _sim()
    for i in range(0, 500, 25):
        sim.handle("BatchWriteItem", {"RequestItems": {CONNS: [{"PutRequest": {"Item": {
            "connection_id": {"S": f"c{j:04d}"}, "desired_state": {"S": "STARTED"},
            "lease_expires_at_ms": {"N": str(j % 7)}}}} for j in range(i, i + 25)]}})
    for forward in (True, False):
        seen: list[tuple[int, str]] = []
        start: dict[str, Any] | None = None
        pages = 0
        while True:
            params: dict[str, Any] = {
                "TableName": CONNS, "IndexName": "by_state_expiry", "Limit": 9, "ScanIndexForward": forward,
                "KeyConditionExpression": "desired_state = :s AND lease_expires_at_ms BETWEEN :lo AND :hi",
                "ExpressionAttributeValues": {":s": {"S": "STARTED"}, ":lo": {"N": "1"}, ":hi": {"N": "5"}}}
            if start:
                params["ExclusiveStartKey"] = start
            resp = sim.handle("Query", params)
            pages += 1
            seen += [(int(i["lease_expires_at_ms"]["N"]), i["connection_id"]["S"]) for i in resp["Items"]]
            start = resp.get("LastEvaluatedKey")
            if not start:
                break
            assert set(start) == {"connection_id", "desired_state", "lease_expires_at_ms"}
        expected = sorted((j % 7, f"c{j:04d}") for j in range(500) if 1 <= j % 7 <= 5)
        assert seen == (expected if forward else expected[::-1])
        assert pages == len(expected) // 9 + 1


def test_describe_table_passes_fleetds_schema_check() -> None:
    sim = _sim()
    for table in schema.TABLES:
        desc = sim.handle("DescribeTable", {"TableName": table.name(CFG.aws)})["Table"]
        assert schema.compare(table, CFG.aws, desc) == []
        assert desc["TableStatus"] == "ACTIVE"
    sim.handle("UpdateTimeToLive", {"TableName": SESSIONS,
                                    "TimeToLiveSpecification": {"Enabled": True, "AttributeName": "ttl"}})
    ttl = sim.handle("DescribeTimeToLive", {"TableName": SESSIONS})["TimeToLiveDescription"]
    assert ttl == {"TimeToLiveStatus": "ENABLED", "AttributeName": "ttl"}


def test_returned_items_are_copies() -> None:
    sim = _sim()
    _set_owner(sim, "c1", "a")
    item = sim.handle("GetItem", {"TableName": CONNS, "Key": {"connection_id": {"S": "c1"}}})["Item"]
    item["lease_owner"]["S"] = "mutated"
    assert _owned(sim, "a") == ["c1"]


# ----- speed -----------------------------------------------------------------------------------------


def _per_op_us(fn: Callable[[], Any], n: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - start) / (n // 5))
    return best * 1e6


def test_speed() -> None:
    sim = _sim()
    for i in range(0, 20_000, 25):
        sim.handle("BatchWriteItem", {"RequestItems": {CONNS: [{"PutRequest": {"Item": {
            "connection_id": {"S": f"c{j:06d}"}, "desired_state": {"S": "STARTED"}, "ws_url": {"S": "ws://x"},
            "lease_expires_at_ms": {"N": "0"}, "lease_epoch": {"N": "0"}, "last_seq": {"N": "0"}}}}
            for j in range(i, i + 25)]}})
    counter = iter(range(10**9))

    def claim() -> None:
        i = next(counter)
        sim.handle("UpdateItem", dict(
            TableName=CONNS, Key={"connection_id": {"S": f"c{i % 20_000:06d}"}},
            UpdateExpression="SET lease_owner = :me, lease_expires_at_ms = :exp, updated_at_ms = :now "
                             "ADD lease_epoch :one",
            ConditionExpression="desired_state = :started AND (attribute_not_exists(lease_expires_at_ms) "
                                "OR lease_expires_at_ms < :t)",
            ExpressionAttributeValues={":started": {"S": "STARTED"}, ":t": {"N": str(10**13 + i)},
                                       ":me": {"S": f"s{i % 50}"}, ":exp": {"N": str(10**13 + i + 15_000)},
                                       ":one": {"N": "1"}, ":now": {"N": str(10**13 + i)}},
            ReturnValues="ALL_NEW"))

    query = {"TableName": CONNS, "IndexName": "by_state_expiry", "Limit": 20,
             "KeyConditionExpression": "desired_state = :s AND lease_expires_at_ms < :t",
             "ExpressionAttributeValues": {":s": {"S": "STARTED"}, ":t": {"N": str(10**14)}}}
    payload = {"S": "p" * 200}

    def sink_batch() -> None:
        i = next(counter)
        sim.handle("BatchWriteItem", {"RequestItems": {MESSAGES: [{"PutRequest": {"Item": {
            "connection_id": {"S": f"c{j % 300}"}, "seq": {"N": str(i)}, "payload": payload,
            "received_at_ms": {"N": "1700000000000"}, "lease_epoch": {"N": "3"},
            "session_id": {"S": "task/0/abc"}}}} for j in range(25)]}})

    start = time.perf_counter()
    for _ in range(10_000):
        claim()
    total_s = time.perf_counter() - start
    update_us, query_us = _per_op_us(claim, 2000), _per_op_us(lambda: sim.handle("Query", query), 2000)
    batch_us = _per_op_us(sink_batch, 500)
    print(f"\nSimDynamo: UpdateItem (claim, ALL_NEW) {update_us:.1f} us, GSI Query of 20 keys {query_us:.1f} us, "
          f"BatchWriteItem of 25 puts {batch_us:.1f} us; 10,000 claims in {total_s:.2f} s")
    assert total_s < 5.0


def test_parallel_scan_of_an_index_covers_each_owned_item_once() -> None:
    """The orphan sweep's read: segments of ``by_owner`` (keys only, sparse), paged."""
    cfg = config.load(env={})
    d = SimDynamo(now_ms=lambda: 0)
    for t in schema.TABLES:
        d.handle("CreateTable", schema.create_table_request(t, cfg.aws))
    owned = set()
    for i in range(60):
        item = {"connection_id": {"S": f"c{i}"}, "desired_state": {"S": "STARTED"}, "lease_expires_at_ms": {"N": "0"}}
        if i % 3 == 0:
            item["lease_owner"] = {"S": f"o{i % 5}"}
            owned.add((f"c{i}", f"o{i % 5}"))
        d.handle("PutItem", {"TableName": cfg.aws.connections_table, "Item": item})
    got: list[tuple[str, str]] = []
    for segment in range(4):
        start: dict[str, Any] | None = None
        while True:
            p: dict[str, Any] = {"TableName": cfg.aws.connections_table, "IndexName": schema.OWNER_INDEX,
                                 "Segment": segment, "TotalSegments": 4, "Limit": 2}
            if start:
                p["ExclusiveStartKey"] = start
            r = d.handle("Scan", p)
            got += [(k["connection_id"]["S"], k["lease_owner"]["S"]) for k in r["Items"]]
            start = r.get("LastEvaluatedKey")
            if not start:
                break
    assert sorted(got) == sorted(owned)
    with pytest.raises(ClientError, match="Segment"):
        d.handle("Scan", {"TableName": cfg.aws.connections_table, "Segment": 4, "TotalSegments": 4})
