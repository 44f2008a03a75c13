"""The metering proxy's per-key accounting (:mod:`bench.meter`), driven with real requests through it
to the local dynalite.  The proxy's clock is injected, so "one second" is whatever the test says."""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from bench.faults.proxy import ProxyThread
from bench.meter import HotKeys, KeyLimits, MeteringProxy, Peak, key_schemas
from fleetd.devstack import DevStack

INDEX = "by_group"


class Clock:
    """The proxy's clock: stands still until the test moves it."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Metered:
    table: str
    proxy: MeteringProxy
    client: Any  # boto3 DynamoDB client through the proxy, no retries
    clock: Clock

    def gsi(self, group: str) -> str:
        return f"{self.table}/{INDEX}:{group}"

    def base(self, item: str) -> str:
        return f"{self.table}:{item}"

    def put(self, item: str, group: str, exp: int = 0) -> None:
        self.client.put_item(TableName=self.table, Item=_item(item, group, exp))

    def move(self, item: str, exp: int, **extra: Any) -> dict[str, Any]:
        """SET the index's range key: the item moves within its group's index entries."""
        return dict(self.client.update_item(TableName=self.table, Key={"id": {"S": item}},
                                            UpdateExpression="SET #e = :e", ExpressionAttributeNames={"#e": "exp"},
                                            ExpressionAttributeValues={":e": {"N": str(exp)}}, **extra))


def _item(item: str, group: str, exp: int) -> dict[str, Any]:
    return {"id": {"S": item}, "grp": {"S": group}, "exp": {"N": str(exp)}}


@pytest.fixture
def make(stack: DevStack) -> Iterator[Callable[..., Metered]]:
    """A fresh table (hash ``id``; GSI ``by_group``: hash ``grp``, range ``exp``, KEYS_ONLY) and a metering
    proxy in front of dynalite for it, on its own thread."""
    direct = boto3.client("dynamodb")
    threads: list[ProxyThread] = []

    def build(throttle: bool = False, limits: KeyLimits | None = None) -> Metered:
        table = f"m{uuid.uuid4().hex[:10]}"
        direct.create_table(
            TableName=table, BillingMode="PAY_PER_REQUEST",
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"},
                                  {"AttributeName": "grp", "AttributeType": "S"},
                                  {"AttributeName": "exp", "AttributeType": "N"}],
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            GlobalSecondaryIndexes=[{"IndexName": INDEX, "Projection": {"ProjectionType": "KEYS_ONLY"},
                                     "KeySchema": [{"AttributeName": "grp", "KeyType": "HASH"},
                                                   {"AttributeName": "exp", "KeyType": "RANGE"}]}])
        direct.get_waiter("table_exists").wait(TableName=table)
        clock = Clock(100.0)
        upstream = os.environ["AWS_ENDPOINT_URL_DYNAMODB"]
        proxy = MeteringProxy(upstream, key_schemas(direct, [table]), throttle=throttle, limits=limits, clock=clock)
        thread = ProxyThread(upstream, proxy=proxy)
        thread.start()
        threads.append(thread)
        client = boto3.client("dynamodb", endpoint_url=thread.url,
                              config=BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"}))
        return Metered(table, proxy, client, clock)

    yield build
    for t in threads:
        t.stop()


def _parallel(fn: Callable[[int], Any], n: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(fn, range(n)))


def test_one_hot_gsi_value_is_the_hottest_key_with_its_units_per_second(make: Callable[..., Metered]) -> None:
    m = make()
    items = [f"i{i:02d}" for i in range(20)]
    for item in items:
        m.put(item, "hot")  # second 100: 20 puts, one index entry each
    assert m.proxy.hot.peak("write", 100, 100.9) == Peak(20.0, m.gsi("hot"), 100)
    m.clock.t = 200.0
    _parallel(lambda i: m.move(items[i % 20], 1000 + i), 1000)
    m.clock.t = 201.5
    _parallel(lambda i: m.move(items[i % 20], 5000 + i), 1000)
    # Each move deletes the old entry and puts the new one, both under "hot": 2 units, 1,000 a second.
    peak = m.proxy.hot.peak("write", 200, 202)
    assert peak is not None and peak.key == m.gsi("hot") and peak.units_per_s == 2000.0
    assert m.proxy.hot.units("write", 201.5)[m.base(items[0])] == 50.0  # 1,000 writes over 20 items
    assert m.proxy.hot.peak("write", 203) is None  # nothing after


def test_writes_spread_over_n_values_charge_each_one_nth(make: Callable[..., Metered]) -> None:
    m = make()
    groups = ["g0", "g1", "g2", "g3"]
    for i in range(40):
        m.put(f"i{i:02d}", groups[i % 4])
    m.clock.t = 300.0
    _parallel(lambda i: m.move(f"i{i % 40:02d}", 10_000 + i), 400)
    gsi = {k: v for k, v in m.proxy.hot.units("write", 300.0).items() if f"/{INDEX}:" in k}
    assert gsi == {m.gsi(g): 200.0 for g in groups}  # 800 index units, a quarter each
    peak = m.proxy.hot.peak("write", 300, 300.9)
    assert peak is not None and peak.units_per_s == 200.0


def test_a_write_that_moves_an_item_between_values_charges_old_and_new(make: Callable[..., Metered]) -> None:
    m = make()
    m.put("a", "red")
    m.clock.t = 400.0
    answer = m.client.update_item(TableName=m.table, Key={"id": {"S": "a"}}, UpdateExpression="SET grp = :g",
                                  ExpressionAttributeValues={":g": {"S": "blue"}})
    assert "Attributes" not in answer  # the proxy's ALL_OLD is not passed on
    units = m.proxy.hot.units("write", 400.0)
    assert units == {m.base("a"): 1.0, m.gsi("red"): 1.0, m.gsi("blue"): 1.0}
    # A client that asks for ALL_NEW itself: the old value comes from the shadow map.
    m.clock.t = 401.0
    answer = m.client.update_item(TableName=m.table, Key={"id": {"S": "a"}}, UpdateExpression="SET grp = :g",
                                  ExpressionAttributeValues={":g": {"S": "green"}}, ReturnValues="ALL_NEW")
    assert answer["Attributes"]["grp"] == {"S": "green"}
    assert m.proxy.hot.units("write", 401.0) == {m.base("a"): 1.0, m.gsi("blue"): 1.0, m.gsi("green"): 1.0}
    # REMOVE takes it out of the index: only the old entry is charged.
    m.clock.t = 402.0
    m.client.update_item(TableName=m.table, Key={"id": {"S": "a"}}, UpdateExpression="REMOVE grp")
    assert m.proxy.hot.units("write", 402.0) == {m.base("a"): 1.0, m.gsi("green"): 1.0}


def test_a_failed_conditional_write_is_charged_one_unit_to_its_key(make: Callable[..., Metered]) -> None:
    m = make()
    m.put("a", "red")
    m.clock.t = 500.0
    with pytest.raises(ClientError) as err:
        m.client.put_item(TableName=m.table, Item=_item("a", "blue", 1),
                          ConditionExpression="attribute_not_exists(id)")
    assert err.value.response["Error"]["Code"] == "ConditionalCheckFailedException"
    assert m.proxy.hot.units("write", 500.0) == {m.base("a"): 1.0}  # nothing moved in the index
    puts = m.proxy.tally.snapshot()[("PutItem", m.table)]
    assert (puts.calls, puts.errors, puts.write_units) == (2, 1, 2.0)  # the put that won, and the one refused
    # Writes per item (what a hand-over cost a stream): both puts of "a", the refused one included.
    assert m.proxy.item_writes(m.table, 0.0, 1000.0) == {"a": 2}
    assert m.proxy.item_writes(m.table, 500.0, 500.5) == {"a": 1}


def test_queries_and_gets_charge_read_units_to_the_key_they_name(make: Callable[..., Metered]) -> None:
    m = make()
    m.put("a", "red")
    m.clock.t = 600.0
    for _ in range(3):
        m.client.get_item(TableName=m.table, Key={"id": {"S": "a"}}, ConsistentRead=True)
    m.client.query(TableName=m.table, IndexName=INDEX, KeyConditionExpression="grp = :g",
                   ExpressionAttributeValues={":g": {"S": "red"}})
    units = m.proxy.hot.units("read", 600.0)
    assert units[m.base("a")] == 3.0 and units[m.gsi("red")] > 0
    assert m.proxy.hot.peak("read", 600, 600.5) == Peak(3.0, m.base("a"), 600)


def test_throttling_refuses_the_write_past_a_keys_limit_without_forwarding_it(make: Callable[..., Metered]) -> None:
    m = make(throttle=True, limits=KeyLimits(write_units_per_s=10, read_units_per_s=4))
    m.put("a", "red")
    m.clock.t = 700.0

    def note(n: int) -> None:
        m.client.update_item(TableName=m.table, Key={"id": {"S": "a"}}, UpdateExpression="SET note = :n",
                             ExpressionAttributeValues={":n": {"N": str(n)}})

    for n in range(10):
        note(n)
    with pytest.raises(ClientError) as err:
        note(10)
    assert err.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    stored = boto3.client("dynamodb").get_item(TableName=m.table, Key={"id": {"S": "a"}}, ConsistentRead=True)
    assert stored["Item"]["note"] == {"N": "9"}  # the refused write never reached dynalite
    assert m.proxy.hot.refused(700, 701) == {m.base("a"): 1}
    m.clock.t = 701.0
    note(11)  # a new second, a new budget


def test_throttling_counts_a_gsi_value_across_items(make: Callable[..., Metered]) -> None:
    m = make(throttle=True, limits=KeyLimits(write_units_per_s=10, read_units_per_s=4))
    for i in range(8):
        m.put(f"i{i}", "hot")
    m.clock.t = 800.0
    for i in range(5):
        m.move(f"i{i}", 100 + i)  # 2 units each on by_group:hot, 1 on each item
    with pytest.raises(ClientError) as err:
        m.move("i5", 200)
    assert err.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
    assert m.proxy.hot.refused(800, 801) == {m.gsi("hot"): 1}
    for _ in range(4):
        m.client.get_item(TableName=m.table, Key={"id": {"S": "i7"}}, ConsistentRead=True)
    with pytest.raises(ClientError) as err:
        m.client.get_item(TableName=m.table, Key={"id": {"S": "i7"}}, ConsistentRead=True)
    assert err.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"


def test_throttling_is_off_by_default(make: Callable[..., Metered]) -> None:
    m = make(limits=KeyLimits(write_units_per_s=2))
    m.put("a", "red")
    for n in range(5):
        m.move("a", n)
    assert m.proxy.hot.used("write", m.base("a"), m.clock.t) == 6.0
    assert not m.proxy.hot.refused(0)


def test_hot_keys_fold_old_seconds_to_their_hottest_key() -> None:
    hot = HotKeys()
    for second in range(10):
        hot.charge("write", "a", 5.0, second + 0.1)
        hot.charge("write", "b", 1.0 + second, second + 0.2)
    hot.charge("write", "late", 100.0, 1.0)  # arrived in second 1, long folded: goes to the oldest open one
    assert hot.peak("write", 0, 4.5) == Peak(5.0, "a", 0)
    assert hot.peak("write", 5, 6.5) == Peak(7.0, "b", 6)
    assert hot.peak("write", 7) == Peak(100.0, "late", 7)
    assert hot.peak("read", 0) is None
