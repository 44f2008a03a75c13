"""The messages sink against a real dynalite, with the fault proxy in front where a test needs faults."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.faults.proxy import FaultProxy, client_via
from fleetd import config, schema
from fleetd import sink as sink_mod
from fleetd.clock import SystemClock
from fleetd.config import Config
from fleetd.devstack import DevStack
from fleetd.sink import ITEM_MAX_BYTES, Cursor, Sink
from fleetd.stats import Stats
from tests.helpers import arun, clients, init_tables

SESSION = "task-1/0/nonce"


@pytest.fixture(scope="module")
def cfg(stack: DevStack) -> Config:
    """One set of tables for the module (creating them takes seconds); tests use their own connection ids."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    c = config.replace(config.load(env={}), connections_table=f"{prefix}-connections",
                       sessions_table=f"{prefix}-sessions", messages_table=f"{prefix}-messages",
                       hints_queue=f"{prefix}-hints")
    arun(init_tables(c))
    return c


def fresh(name: str) -> str:
    """A connection id no other test uses."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _sink(cfg: Config, stats: Stats | None = None, on_pressure: Callable[[bool], None] | None = None) -> Sink:
    if on_pressure is None:
        return Sink(cfg, SESSION, stats or Stats(), SystemClock())
    return Sink(cfg, SESSION, stats or Stats(), SystemClock(), on_pressure)


@asynccontextmanager
async def running(sink: Sink, ddb: Any) -> AsyncIterator[asyncio.Event]:
    """``sink.run`` in the background for the duration of the block."""
    stopping = asyncio.Event()
    task = asyncio.create_task(sink.run(ddb, stopping))
    try:
        yield stopping
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5.0)


@asynccontextmanager
async def proxied(cfg: Config, seed: int = 1) -> AsyncIterator[tuple[FaultProxy, Any]]:
    """A fault proxy in front of dynalite and a DynamoDB client through it, without SDK retries.

    The sink retries by itself, checking the fence before every attempt; an SDK retry
    would re-send a fenced cursor's messages behind its back.
    """
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL_DYNAMODB"], seed=seed)
    url = await proxy.start()
    try:
        async with client_via(cfg.aws, "dynamodb", url, total_attempts=1) as ddb:
            yield proxy, ddb
    finally:
        await proxy.stop()


async def until(pred: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def items_of(ddb: Any, cfg: Config, connection_id: str) -> dict[int, dict[str, Any]]:
    """The stored messages of one connection, by seq (consistent reads, all pages)."""
    out: dict[int, dict[str, Any]] = {}
    kwargs: dict[str, Any] = {"TableName": cfg.aws.messages_table, "ConsistentRead": True,
                              "KeyConditionExpression": "connection_id = :c",
                              "ExpressionAttributeValues": {":c": {"S": connection_id}}}
    while True:
        resp = await ddb.query(**kwargs)
        out.update({int(i["seq"]["N"]): i for i in resp["Items"]})
        if "LastEvaluatedKey" not in resp:
            return out
        kwargs["ExclusiveStartKey"] = resp["LastEvaluatedKey"]


def submit_round_robin(sink: Sink, cursors: list[Cursor], total: int, payload: Callable[[str, int], bytes | str],
                       now_ms: int = 1_700_000_000_000) -> None:
    """``total`` messages over ``cursors``, seqs 1.. per cursor, interleaved as live streams are."""
    for i in range(total):
        cur, seq = cursors[i % len(cursors)], i // len(cursors) + 1
        sink.submit(cur, seq, payload(cur.connection_id, seq), now_ms + i)


def json_payload(cid: str, seq: int) -> bytes:
    return b'{"seq": %d, "conn": "%s", "data": "hello"}' % (seq, cid.encode())


# ----- contiguity, without I/O ----------------------------------------------------------------------------

def test_last_seq_advances_only_over_contiguous_durable_writes() -> None:
    sink = _sink(config.load(env={}))
    cur = sink.cursor("c", 1, 10)
    for seq in (11, 12, 13, 14, 20, 30):  # 20 and 30: upstream gaps, still written
        sink.submit(cur, seq, b"x", 0)
    cur.durable(13)
    cur.durable(12)
    assert cur.last_seq == 10  # 11 still in flight
    cur.durable(11)
    assert cur.last_seq == 13
    cur.durable(30)
    assert cur.last_seq == 13
    cur.durable(14)
    assert cur.last_seq == 14  # 20 is in flight: 30 must wait
    cur.durable(20)
    assert (cur.last_seq, cur.pending) == (30, 0)
    assert cur.checkpointed_seq == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_last_seq_is_the_durable_prefix_for_any_completion_order(steps: list[int], rnd: Any) -> None:
    sink = _sink(config.load(env={}))
    cur = sink.cursor("c", 1, 0)
    seqs, seq = [], 0
    for step in steps:
        seq += step
        seqs.append(seq)
        sink.submit(cur, seq, b"", 0)
    order = seqs[:]
    rnd.shuffle(order)
    done: set[int] = set()
    for s in order:
        cur.durable(s)
        done.add(s)
        prefix = 0
        for x in seqs:
            if x not in done:
                break
            prefix = x
        assert cur.last_seq == prefix
    assert cur.pending == 0


# ----- writing to DynamoDB ------------------------------------------------------------------------------

def test_all_messages_are_written_with_their_attributes(cfg: Config) -> None:
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        cursors = [sink.cursor(fresh(f"conn{i}"), 7, 0) for i in range(10)]
        async with clients(cfg) as c, running(sink, c.dynamodb):
            started = time.perf_counter()
            submit_round_robin(sink, cursors, 1000, json_payload)
            await until(lambda: sink.buffered == 0, 20.0)
            elapsed = time.perf_counter() - started
            print(f"\ndynamodb sink (dynalite, default settings): {1000 / elapsed:,.0f} msgs/s")
            for cur in cursors:
                assert cur.last_seq == 100 and cur.pending == 0
                items = await items_of(c.dynamodb, cfg, cur.connection_id)
                assert sorted(items) == list(range(1, 101))
                first = items[1]
                assert first["payload"] == {"S": json_payload(cur.connection_id, 1).decode()}
                assert first["lease_epoch"] == {"N": "7"}
                assert first["session_id"] == {"S": SESSION}
                assert int(first["received_at_ms"]["N"]) >= 1_700_000_000_000
        assert sink.written == 1000
        assert stats.counter("dynamodb_requests_total", op="BatchWriteItem", outcome="won") >= 40
        assert stats.histograms[("sink_batch_seconds", ())].count >= 40
        assert stats.histograms[("sink_latency_seconds", ())].count >= 1
        assert stats.gauges[("sink_buffer_messages", ())] == 0

    arun(body())


def test_payload_types(cfg: Config) -> None:
    """Text and UTF-8 bytes are stored as S, anything else as B."""
    async def body() -> None:
        sink = _sink(cfg)
        cur = sink.cursor(fresh("types"), 1, 0)
        payloads: list[bytes | str] = ["grüße ✓ 🚀", "é".encode(), b"\xff\xfe\x00binary", "{}"]
        for seq, p in enumerate(payloads, 1):
            sink.submit(cur, seq, p, 1)
        async with clients(cfg) as c:
            assert await sink.drain(c.dynamodb, 10.0)
            items = await items_of(c.dynamodb, cfg, cur.connection_id)
        assert [items[s]["payload"] for s in (1, 2, 3, 4)] == [
            {"S": "grüße ✓ 🚀"}, {"S": "é"}, {"B": b"\xff\xfe\x00binary"}, {"S": "{}"}]
        assert cur.last_seq == 4

    arun(body())


def test_unprocessed_items_are_retried_and_last_seq_never_passes_a_gap(cfg: Config) -> None:
    """Every batch half-fails, so batches complete out of order; last_seq stays a durable prefix."""
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        cursors = [sink.cursor(fresh(f"conn{i}"), 1, 0) for i in range(10)]
        async with proxied(cfg) as (proxy, ddb):
            proxy.add("BatchWriteItem", "unprocessed")
            violations: list[str] = []

            async def check_prefix() -> None:
                """Whatever last_seq says at any moment must already be in the table, gap-free."""
                while sink.buffered:
                    snapshot = [(cur.connection_id, cur.last_seq) for cur in cursors]
                    for cid, last in snapshot:
                        stored = await items_of(ddb, cfg, cid)
                        if any(s not in stored for s in range(1, last + 1)):
                            violations.append(f"{cid}: last_seq {last} but not all of 1..{last} stored")
                    await asyncio.sleep(0.02)

            async with running(sink, ddb):
                submit_round_robin(sink, cursors, 1000, json_payload)
                await asyncio.wait_for(check_prefix(), 30.0)
            assert not violations, violations[:3]
            assert proxy.calls["BatchWriteItem"] > 80  # every batch needed several calls
            for cur in cursors:
                assert cur.last_seq == 100
                assert sorted(await items_of(ddb, cfg, cur.connection_id)) == list(range(1, 101))
        assert stats.counter("sink_errors_total", kind="unprocessed") > 0

    arun(body())


def test_throttling_and_server_faults_lose_nothing(cfg: Config) -> None:
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        cursors = [sink.cursor(fresh(f"conn{i}"), 1, 0) for i in range(10)]
        async with proxied(cfg, seed=3) as (proxy, ddb):
            throttle = proxy.add("BatchWriteItem", "throttle", probability=0.3)
            proxy.add("BatchWriteItem", "error500", probability=0.1)
            proxy.add("BatchWriteItem", "drop_response", probability=0.1, mode="reset")  # written, answer lost
            async with running(sink, ddb):
                submit_round_robin(sink, cursors, 1000, json_payload)
                await until(lambda: sink.buffered == 0, 30.0)
            assert throttle.fired > 0
            proxy.clear()
            for cur in cursors:
                assert cur.last_seq == 100
                assert sorted(await items_of(ddb, cfg, cur.connection_id)) == list(range(1, 101))
        assert sink.written == 1000
        assert stats.counter("sink_errors_total", kind="throttled") == throttle.fired
        assert stats.counter("sink_errors_total", kind="server") > 0
        assert stats.counter("sink_errors_total", kind="connection") > 0

    arun(body())


def test_deactivated_cursor_is_never_written(cfg: Config) -> None:
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        fenced, kept, early = (sink.cursor(fresh(name), 1, 0) for name in ("fenced", "kept", "early"))
        async with proxied(cfg) as (proxy, ddb):
            proxy.add("BatchWriteItem", "throttle")  # nothing gets through until the fence is in place
            submit_round_robin(sink, [early, fenced, kept], 300, json_payload)
            sink.deactivate(early)  # before any flush
            assert sink.buffered == 200
            async with running(sink, ddb):
                await until(lambda: proxy.calls["BatchWriteItem"] >= 3, 10.0)
                sink.deactivate(fenced)  # while its messages are being retried
                sink.submit(fenced, 101, b"late", 0)  # after the fence: ignored
                assert sink.buffered == 100
                # A request already on the wire cannot be recalled (the fence's safety margin covers
                # that): let those be answered, throttled, before DynamoDB recovers.
                await asyncio.sleep(0.3)
                proxy.clear()
                await until(lambda: sink.buffered == 0, 10.0)
            assert await items_of(ddb, cfg, fenced.connection_id) == {}
            assert await items_of(ddb, cfg, early.connection_id) == {}
            assert sorted(await items_of(ddb, cfg, kept.connection_id)) == list(range(1, 101))
        assert (fenced.last_seq, fenced.active, kept.last_seq) == (0, False, 100)
        assert sink.dropped == 200
        assert stats.counter("sink_errors_total", kind="throttled") > 0
        assert stats.counter("dynamodb_requests_total", op="BatchWriteItem", outcome="retryable") > 0

    arun(body())


def test_oversized_message_is_counted_skipped_and_passed(cfg: Config) -> None:
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        cur = sink.cursor(fresh("big"), 1, 0)
        sink.submit(cur, 1, b"small", 1)
        sink.submit(cur, 2, b"x" * ITEM_MAX_BYTES, 1)  # too large for any item
        sink.submit(cur, 3, "é" * 205_000, 1)  # 410,000 bytes of UTF-8 in 205,000 characters
        sink.submit(cur, 4, "y" * 399_000, 1)  # fits
        sink.submit(cur, 5, "é" * 199_000, 1)  # 398,000 bytes: fits
        async with clients(cfg) as c:
            assert await sink.drain(c.dynamodb, 10.0)
            stored = await items_of(c.dynamodb, cfg, cur.connection_id)
        assert sorted(stored) == [1, 4, 5]
        assert cur.last_seq == 5
        assert stats.counter("upstream_frames_rejected_total", reason="too_large_for_sink") == 2
        assert sink.rejected == 2

    arun(body())


def test_invalid_item_is_isolated_and_stalls_only_its_cursor(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """DynamoDB refuses a whole batch for one bad item: the others are still written, the bad one never passes."""
    monkeypatch.setattr(sink_mod, "STALL_BACKOFF_MAX_S", 0.1, raising=False)

    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        bad, good = sink.cursor("", 1, 0), sink.cursor(fresh("good"), 1, 0)  # an empty key is invalid
        submit_round_robin(sink, [good, bad], 20, json_payload)
        async with clients(cfg) as c, running(sink, c.dynamodb):
            await until(lambda: good.last_seq == 10 and stats.counter("sink_errors_total", kind="invalid") > 10, 10.0)
            assert sorted(await items_of(c.dynamodb, cfg, good.connection_id)) == list(range(1, 11))
            assert (bad.last_seq, bad.pending, sink.buffered) == (0, 10, 10)
            assert not await sink.wait_durable(c.dynamodb, [bad], 0.2)
        assert stats.counter("upstream_frames_rejected_total", reason="invalid_for_sink") == 0
        assert sink.rejected == 0

    arun(body())


# ----- refused as invalid: the checkpoint stalls, never skips (SPEC §3) -----------------------------------

POISON = 10**38 + 1  # 39 significant digits: DynamoDB refuses the number; the sink's size check does not see it


async def create_wrong_table(ddb: Any, name: str, seq_type: str | None = None) -> None:
    """A messages table with a key schema fleetd cannot write to: hash ``id``, or ``seq`` typed ``seq_type``."""
    if seq_type is None:
        keys = [{"AttributeName": "id", "KeyType": "HASH"}]
        attrs = [{"AttributeName": "id", "AttributeType": "S"}]
    else:
        keys = [{"AttributeName": "connection_id", "KeyType": "HASH"}, {"AttributeName": "seq", "KeyType": "RANGE"}]
        attrs = [{"AttributeName": "connection_id", "AttributeType": "S"},
                 {"AttributeName": "seq", "AttributeType": seq_type}]
    await ddb.create_table(TableName=name, BillingMode="PAY_PER_REQUEST", KeySchema=keys, AttributeDefinitions=attrs)


async def recreate_right_table(ddb: Any, cfg: Config) -> None:
    """Delete the messages table and create it again as ``fleetd init`` would."""
    name = cfg.aws.messages_table
    await ddb.delete_table(TableName=name)
    await until_async(lambda: schema.describe(ddb, name), lambda desc: desc is None, 10.0)
    await ddb.create_table(**schema.create_table_request(schema.TABLES[2], cfg.aws))
    await until_async(lambda: schema.describe(ddb, name),
                      lambda desc: desc is not None and desc["TableStatus"] == "ACTIVE", 10.0)


async def until_async(probe: Callable[[], Any], pred: Callable[[Any], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred(await probe()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def stalled(stats: Stats) -> tuple[float, float]:
    return stats.gauges.get(("sink_stalled_streams", ()), 0.0), stats.gauges.get(("sink_stalled_messages", ()), 0.0)


def test_wrong_key_schema_stalls_every_checkpoint_until_the_table_is_fixed(
        cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is marked durable, last_seq stays, reads are paused; once the table is right, all is written."""
    monkeypatch.setattr(sink_mod, "STALL_BACKOFF_MAX_S", 0.2, raising=False)
    bad = config.replace(cfg, messages_table=f"{cfg.aws.messages_table}-{uuid.uuid4().hex[:6]}",
                         sink_high_watermark=100, sink_low_watermark=50)

    async def body() -> None:
        stats = Stats()
        pressure: list[bool] = []
        sink = _sink(bad, stats, on_pressure=pressure.append)
        poisoned = sink.cursor(fresh("poisoned"), 1, 0)
        cursors = [sink.cursor(fresh(f"conn{i}"), 1, 0) for i in range(4)]
        sink.submit(poisoned, POISON, b"never storable", 1)  # first in line: the retries must not stick to it
        async with clients(cfg) as c:
            await create_wrong_table(c.dynamodb, bad.aws.messages_table)
            async with running(sink, c.dynamodb):
                submit_round_robin(sink, cursors, 200, json_payload)
                sink.submit(poisoned, 2 * 10**39, b"storable", 1)
                # Every message was tried on its own and refused (202 single calls + the batches).
                await until(lambda: stats.counter("sink_errors_total", kind="invalid") >= 210, 20.0)
                await asyncio.sleep(0.5)  # a few slow retries
                assert [cur.last_seq for cur in (*cursors, poisoned)] == [0] * 5
                assert (sink.buffered, sink.written, sink.rejected) == (202, 0, 0)
                assert pressure == [True]  # reads paused, and they stay paused: the buffer cannot drain
                assert stalled(stats) == (5, 202)
                assert stats.counter("upstream_frames_rejected_total", reason="invalid_for_sink") == 0
                refused = stats.counter("sink_errors_total", kind="invalid")
                await asyncio.sleep(0.6)
                assert stats.counter("sink_errors_total", kind="invalid") > refused, "stalled writes are not retried"
                assert stats.counter("sink_errors_total", kind="invalid") < refused + 20, "retries are not slow"

                await recreate_right_table(c.dynamodb, bad)
                await until(lambda: sink.buffered == 1, 20.0)
                assert [cur.last_seq for cur in cursors] == [50] * 4
                for cur in cursors:
                    assert sorted(await items_of(c.dynamodb, bad, cur.connection_id)) == list(range(1, 51))
                assert sorted(await items_of(c.dynamodb, bad, poisoned.connection_id)) == [2 * 10**39]
                assert (poisoned.last_seq, poisoned.pending) == (0, 2)  # held before its refused seq
                assert pressure == [True, False]
                assert stalled(stats) == (1, 1)
                sink.deactivate(poisoned)  # lease released or lost: its stall goes with it
                assert stalled(stats) == (0, 0) and sink.buffered == 0

    arun(body())


def test_a_message_dynamodb_refuses_stalls_only_its_stream(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_mod, "STALL_BACKOFF_MAX_S", 0.1, raising=False)

    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        poisoned, other = sink.cursor(fresh("poisoned"), 1, 0), sink.cursor(fresh("other"), 1, 0)
        after = [2 * 10**39, 3 * 10**39]
        async with clients(cfg) as c, running(sink, c.dynamodb):
            for seq in (1, 2, 3, POISON, *after):
                sink.submit(poisoned, seq, json_payload(poisoned.connection_id, seq), 1)
            submit_round_robin(sink, [other], 50, json_payload)
            await until(lambda: other.last_seq == 50 and sink.buffered <= 1, 10.0)
            assert sorted(await items_of(c.dynamodb, cfg, poisoned.connection_id)) == [1, 2, 3, *after]
            assert (poisoned.last_seq, poisoned.pending) == (3, 3)  # the refused seq and the two behind it
            assert stalled(stats) == (1, 1)
            refused = stats.counter("sink_errors_total", kind="invalid")
            await asyncio.sleep(0.5)
            assert stats.counter("sink_errors_total", kind="invalid") > refused  # retried, slowly
            assert poisoned.last_seq == 3
            sink.submit(other, 51, b"still flowing", 1)
            await until(lambda: other.last_seq == 51, 5.0)
            assert not await sink.wait_durable(c.dynamodb, [poisoned], 0.3)
        assert (sink.rejected, stats.counter("upstream_frames_rejected_total", reason="invalid_for_sink")) == (0, 0)

    arun(body())


def test_same_key_twice_is_deferred_not_sent_in_one_batch(cfg: Config) -> None:
    async def body() -> None:
        stats = Stats()
        sink = _sink(cfg, stats)
        cid = fresh("dup")
        old, new = sink.cursor(cid, 1, 0), sink.cursor(cid, 2, 0)
        for seq in range(1, 11):
            sink.submit(old, seq, b"old", 1)
            sink.submit(new, seq, b"new", 1)
        async with clients(cfg) as c:
            assert await sink.drain(c.dynamodb, 10.0)
            stored = await items_of(c.dynamodb, cfg, cid)
        assert sorted(stored) == list(range(1, 11))
        assert (old.last_seq, new.last_seq) == (10, 10)
        assert stats.counter("sink_errors_total", kind="invalid") == 0

    arun(body())


def test_backpressure_fires_once_at_each_watermark(cfg: Config) -> None:
    async def body() -> None:
        calls: list[tuple[bool, int]] = []
        small = config.replace(cfg, sink_high_watermark=100, sink_low_watermark=50)
        sink = _sink(small, on_pressure=lambda paused: calls.append((paused, sink.buffered)))
        cursors = [sink.cursor(fresh(f"conn{i}"), 1, 0) for i in range(4)]
        submit_round_robin(sink, cursors, 150, json_payload)
        assert calls == [(True, 101)]
        async with clients(cfg) as c:
            assert await sink.drain(c.dynamodb, 10.0)
            assert [p for p, _ in calls] == [True, False] and calls[1][1] < 50
            for cur in cursors:
                sink.submit(cur, cur.last_seq + 1, b"more", 1)
            assert len(calls) == 2  # below the high watermark again: no new pause
            async with running(sink, c.dynamodb):
                await until(lambda: sink.buffered == 0, 10.0)
        assert len(calls) == 2

    arun(body())


def test_drain_is_bounded_when_dynamodb_does_not_answer(cfg: Config) -> None:
    async def body() -> None:
        sink = _sink(cfg)
        cur = sink.cursor(fresh("held"), 1, 0)
        for seq in range(1, 101):
            sink.submit(cur, seq, b"m", 1)
        async with proxied(cfg) as (proxy, ddb):
            hole = proxy.add("BatchWriteItem", "blackhole")
            started = time.monotonic()
            assert not await sink.drain(ddb, 1.0)
            assert time.monotonic() - started < 2.0
            assert hole.fired > 0
            assert (sink.buffered, cur.last_seq) == (100, 0)  # nothing lost, nothing claimed durable
            proxy.clear()
            assert await sink.drain(ddb, 10.0)  # the abandoned batches were put back
            assert sorted(await items_of(ddb, cfg, cur.connection_id)) == list(range(1, 101))
        assert cur.last_seq == 100

    arun(body())


def test_run_returns_promptly_on_stopping_and_drain_finishes(cfg: Config) -> None:
    async def body() -> None:
        sink = _sink(cfg)
        cur = sink.cursor(fresh("slow"), 1, 0)
        for seq in range(1, 201):
            sink.submit(cur, seq, b"m", 1)
        async with proxied(cfg) as (proxy, ddb):
            proxy.add("BatchWriteItem", "latency", seconds=1.0)
            stopping = asyncio.Event()
            task = asyncio.create_task(sink.run(ddb, stopping))
            await until(lambda: proxy.calls["BatchWriteItem"] >= 1, 5.0)
            stopping.set()
            started = time.monotonic()
            await asyncio.wait_for(task, 5.0)
            assert time.monotonic() - started < 0.5
            assert sink.buffered > 0
            proxy.clear()
            assert await sink.drain(ddb, 10.0)
            assert sorted(await items_of(ddb, cfg, cur.connection_id)) == list(range(1, 201))
        assert cur.last_seq == 200

    arun(body())


def test_wait_durable_and_drain_while_run_is_active(cfg: Config) -> None:
    """A release waits for its own cursors while run keeps writing everyone's messages."""
    async def body() -> None:
        sink = _sink(cfg)
        leaving, staying = sink.cursor(fresh("leaving"), 1, 0), sink.cursor(fresh("staying"), 1, 0)
        async with clients(cfg) as c, running(sink, c.dynamodb):
            submit_round_robin(sink, [leaving, staying], 200, json_payload)
            assert await sink.wait_durable(c.dynamodb, [leaving], 10.0)
            assert (leaving.pending, leaving.last_seq) == (0, 100)
            sink.submit(staying, 101, b"last", 1)
            assert await sink.drain(c.dynamodb, 10.0)  # waits for run's flushes, writes nothing itself
            assert (sink.buffered, staying.last_seq) == (0, 101)
        sink.set_session("task-1/0/renewed")
        sink.submit(staying, 102, b"after renewal", 1)
        async with clients(cfg) as c:
            assert await sink.wait_durable(c.dynamodb, [staying], 10.0)  # no run: writes by itself
            stored = await items_of(c.dynamodb, cfg, staying.connection_id)
        assert stored[102]["session_id"] == {"S": "task-1/0/renewed"}
        assert stored[101]["session_id"] == {"S": SESSION}

    arun(body())


# ----- discard --------------------------------------------------------------------------------------------

def test_discard_sink_makes_every_message_durable_at_once() -> None:
    async def body() -> None:
        sink = _sink(config.replace(config.load(env={}), sink="discard"))
        cursors = [sink.cursor(f"conn-{i}", 1, 0) for i in range(1000)]
        payload = b'{"seq": 1, "data": "' + b"x" * 180 + b'"}'
        submit = sink.submit
        started = time.perf_counter()
        for i in range(1_000_000):
            submit(cursors[i % 1000], i // 1000 + 1, payload, 0)
        elapsed = time.perf_counter() - started
        print(f"\ndiscard sink: {1_000_000 / elapsed:,.0f} submits/s")
        assert all(cur.last_seq == 1000 for cur in cursors)
        assert (sink.buffered, sink.written) == (0, 1_000_000)
        stopping = asyncio.Event()
        stopping.set()
        await asyncio.wait_for(sink.run(None, stopping), 1.0)
        assert await sink.drain(None, 1.0)

    arun(body())
