"""START hints against moto's SQS: both body formats, packing, and the streaming sender."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import orjson
import pytest

from fleetd.aws import Clients
from fleetd.config import Config
from fleetd.hints import (
    IDS_PER_MESSAGE,
    Hint,
    Hints,
    HintStream,
    Offer,
    _parse,
    dead_session_body,
    offer_body,
    start_body,
)
from fleetd.stats import Stats
from tests.helpers import arun, clients


def test_parse_accepts_the_four_formats_and_rejects_the_rest() -> None:
    assert _parse(start_body(["a"]), "r") == Hint(("a",), "r")
    assert orjson.loads(start_body(["a"])) == {"type": "START", "connection_id": "a"}  # SPEC §2 for one id
    assert _parse(start_body(["a", "b"]), "r") == Hint(("a", "b"), "r")
    assert _parse(dead_session_body("t/0/s"), "r") == Hint((), "r", dead_session="t/0/s")
    offers = (Offer("a", 3, 41), Offer("b", 1, -1))
    assert _parse(offer_body("t/0/s", "k", offers), "r") == Hint(("a", "b"), "r", offered_by="t/0/s",
                                                                offer_token="k", offers=offers)
    # A malformed entry is dropped alone: the rest of the message stays takeable.
    mixed = '{"type": "OFFER", "session_id": "s", "token": "k", "offers": [["a", 0, 0], ["b", 2, 5]]}'
    assert _parse(mixed, "r") == Hint(("b",), "r", offered_by="s", offer_token="k", offers=(Offer("b", 2, 5),))
    for bad in ('{"type": "START", "connection_ids": []}', '{"type": "START", "connection_ids": ["a", 3]}',
                '{"type": "START", "connection_ids": "a"}', '{"type": "START", "connection_id": ""}',
                '{"type": "STOP", "connection_id": "a"}', '["START"]', "not json", "",
                '{"type": "DEAD_SESSION"}', '{"type": "DEAD_SESSION", "session_id": ""}',
                '{"type": "DEAD_SESSION", "session_id": 7}', '{"type": "OFFER", "session_id": "s", "offers": []}',
                '{"type": "OFFER", "offers": [["a", 1, 0]]}',
                '{"type": "OFFER", "session_id": "s", "offers": [["a", 0, 0]]}',
                '{"type": "OFFER", "session_id": "s", "offers": [["a", 1, -2]]}',
                '{"type": "OFFER", "session_id": "s", "offers": [["a", true, 0]]}',
                '{"type": "OFFER", "session_id": "s", "offers": [["a", 1]]}',
                '{"type": "OFFER", "session_id": "s", "token": 7, "offers": [["a", 1, 0]]}'):
        assert _parse(bad, "r") is None, bad


async def _drain(hints: Hints) -> list[tuple[str, ...]]:
    got: list[tuple[str, ...]] = []
    while batch := await hints.receive(100):
        got += [h.connection_ids for h in batch]
        await hints.ack([h.receipt for h in batch])
    return got


def _hints(c: Clients, cfg: Config, stats: Stats | None = None) -> Hints:
    return Hints(c.sqs, cfg.aws.hints_queue, 0, stats or Stats())


def test_send_start_packs_ids_into_messages(cfg: Config) -> None:
    ids = [f"c{i:03d}" for i in range(25)]

    async def main() -> tuple[int, list[tuple[str, ...]], Stats]:
        stats = Stats()
        async with clients(cfg) as c:
            hints = _hints(c, cfg, stats)
            sent = await hints.send_start(ids)
            return sent, await _drain(hints), stats

    sent, messages, stats = arun(main())
    assert sent == 25
    assert len(messages) == -(-25 // IDS_PER_MESSAGE)
    assert sorted(cid for m in messages for cid in m) == ids
    assert stats.counter("hints_total", kind="sent") == 25
    assert stats.counter("hints_total", kind="received") == 25


def test_dead_session_messages_reach_as_many_receivers_as_copies(cfg: Config) -> None:
    async def main() -> tuple[list[tuple[tuple[str, ...], str]], Stats]:
        stats = Stats()
        async with clients(cfg) as c:
            hints = _hints(c, cfg, stats)
            await hints.send_dead_session("t/0/dead", copies=3)
            got: list[tuple[tuple[str, ...], str]] = []
            while batch := await hints.receive(1):
                got += [(h.connection_ids, h.dead_session) for h in batch]
                await hints.ack([h.receipt for h in batch])
            return got, stats

    got, stats = arun(main())
    assert got == [((), "t/0/dead")] * 3
    assert stats.counter("hints_total", kind="dead_session") == 3
    assert stats.counter("hints_total", kind="received") == 0


def test_malformed_message_is_counted_and_deleted(cfg: Config) -> None:
    async def main() -> tuple[list[tuple[str, ...]], Stats]:
        stats = Stats()
        async with clients(cfg) as c:
            hints = _hints(c, cfg, stats)
            await hints.resolve()
            await c.sqs.send_message(QueueUrl=hints.url, MessageBody='{"type": "START", "connection_ids": [1]}')
            await hints.send_start(["ok"])
            return await _drain(hints), stats

    messages, stats = arun(main())
    assert messages == [("ok",)]
    assert stats.counter("hints_total", kind="malformed") == 1


def test_stream_sends_each_batch_before_close(cfg: Config) -> None:
    """The first peer can claim while the rest is still being released."""
    async def main() -> tuple[list[tuple[str, ...]], list[tuple[str, ...]], int]:
        async with clients(cfg) as c:
            hints = _hints(c, cfg)
            stream = HintStream(hints, batch=10, linger_s=30.0)
            for i in range(10):
                stream.add(f"a{i}")  # a full batch: sent at once, no linger
            await asyncio.sleep(1.0)
            early = await _drain(hints)
            for i in range(3):
                stream.add(f"b{i}")  # short of a batch: sent at close
            unsent = await stream.close(5.0)
            return early, await _drain(hints), unsent

    early, late, unsent = arun(main())
    assert sorted(cid for m in early for cid in m) == [f"a{i}" for i in range(10)]
    assert late == [("b0", "b1", "b2")]
    assert unsent == 0


def test_stream_linger_sends_a_short_batch(cfg: Config) -> None:
    async def main() -> list[tuple[str, ...]]:
        async with clients(cfg) as c:
            hints = _hints(c, cfg)
            stream = HintStream(hints, batch=100, linger_s=0.05)
            stream.add("x")
            await asyncio.sleep(1.0)
            got = await _drain(hints)
            assert await stream.close(1.0) == 0
            return got

    assert arun(main()) == [("x",)]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (an unreachable SQS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


def test_stream_close_is_bounded_when_sqs_hangs(cfg: Config, silent_port: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", f"http://127.0.0.1:{silent_port}")

    async def main() -> tuple[int, float]:
        async with clients(cfg) as c:
            hints = _hints(c, cfg)
            hints.url = f"http://127.0.0.1:{silent_port}/123456789012/q"  # no lookup: it would hang too
            stream = HintStream(hints, batch=10)
            for i in range(25):
                stream.add(f"c{i}")
            t0 = asyncio.get_running_loop().time()
            unsent = await stream.close(0.5)
            return unsent, asyncio.get_running_loop().time() - t0

    unsent, took = arun(main())
    assert unsent == 25
    assert took < 5.0
