"""One upstream stream (``fleetd.upstream.Connection``): sequencing and its anomaly policy (SPEC §5),
and where its sockets may go (the SSRF guard).

A real :class:`Connection` streams from the in-process fake upstream into a real
:class:`Sink` on dynalite, so "written" below means durable in the messages table.
The SSRF tests use real servers on loopback addresses (127.0.0.1-3) and no AWS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.upstream import FakeUpstream
from fleetd import config, logs
from fleetd.clock import SystemClock
from fleetd.config import LOOPBACK_NETWORKS, Config
from fleetd.sink import Cursor, Sink
from fleetd.stats import Stats
from fleetd.upstream import Connection
from tests.helpers import arun, clients

SESSION = "task-1/0/upstream-test"
JUMP = 1_000_000


@dataclass
class Rig:
    up: FakeUpstream
    conn: Connection
    stats: Stats
    sink: Sink
    cursor: Cursor
    ddb: Any
    cfg: Config

    @property
    def last(self) -> int:
        return -1 if self.conn.last_received is None else self.conn.last_received

    async def written(self) -> dict[int, bytes]:
        """Durable messages of the stream, by seq, once everything submitted so far is durable."""
        assert await self.sink.wait_durable(self.ddb, [self.cursor], 10.0)
        out: dict[int, bytes] = {}
        kwargs: dict[str, Any] = {"TableName": self.cfg.aws.messages_table, "ConsistentRead": True,
                                  "KeyConditionExpression": "connection_id = :c",
                                  "ExpressionAttributeValues": {":c": {"S": self.conn.connection_id}}}
        while True:
            resp = await self.ddb.query(**kwargs)
            for item in resp["Items"]:
                payload = item["payload"]
                out[int(item["seq"]["N"])] = payload["B"] if "B" in payload else payload["S"].encode()
            if "LastEvaluatedKey" not in resp:
                return out
            kwargs["ExclusiveStartKey"] = resp["LastEvaluatedKey"]

    def anomalies(self, kind: str) -> float:
        return self.stats.counter("upstream_seq_anomalies_total", kind=kind)


@asynccontextmanager
async def streaming(cfg: Config, cid: str, first_seq: int = 1, **upstream: Any) -> AsyncIterator[Rig]:
    """A fresh stream (no ``last_seq``) from a 100 frames/s fake upstream, written through the sink."""
    cfg = config.replace(cfg, backoff_min_s=0.05, backoff_max_s=0.2, **upstream)
    stats, clock = Stats(), SystemClock()
    async with FakeUpstream(rate=100.0, size=60, tick_ms=10, first_seq=first_seq) as up, clients(cfg) as c:
        sink = Sink(cfg, SESSION, stats, clock)
        stopping = asyncio.Event()
        flusher = asyncio.create_task(sink.run(c.dynamodb, stopping))
        cursor = sink.cursor(cid, 1, -1)
        conn = Connection(cid, up.url(cid), cursor, None, sink, cfg.upstream, stats, clock)
        conn.start()
        try:
            yield Rig(up, conn, stats, sink, cursor, c.dynamodb, cfg)
        finally:
            await conn.close()
            stopping.set()
            await asyncio.wait_for(flusher, 5.0)


async def until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what or pred}"
        await asyncio.sleep(0.01)


def contiguous(seqs: list[int]) -> bool:
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_fresh_stream_numbered_from_0_sends_no_from_seq_and_keeps_seq_0(cfg: Config) -> None:
    async def main() -> None:
        async with streaming(cfg, "zero", first_seq=0) as rig:
            await until(lambda: rig.last >= 10, what="10 frames")
            written = await rig.written()
            stream = rig.up.stats()["zero"]
        assert sorted(written)[0] == 0 and contiguous(sorted(written))
        assert stream["connections"] == 1 and stream["from_seqs"] == [], "the first connect asked for a resume"

    arun(main())


def test_a_one_off_jump_is_held_back_and_the_real_frames_are_written(cfg: Config) -> None:
    async def main() -> None:
        async with streaming(cfg, "once") as rig:
            await until(lambda: rig.last >= 20, what="20 frames")
            bogus = JUMP + rig.up.produced("once")
            assert rig.up.inject("once", "noseq", b'{"seq":%d,"data":"bogus"}' % bogus) == 1
            target = rig.up.produced("once") + 30
            await until(lambda: target <= rig.last < JUMP or rig.last >= JUMP + target, what="30 more frames")
            written = sorted(await rig.written())
            stream = rig.up.stats()["once"]
        assert bogus not in written, "the implausible jump was accepted"
        assert written[0] == 1 and contiguous(written) and written[-1] >= target
        assert rig.anomalies("jump") == 1 and rig.anomalies("jump_accepted") == 0
        assert rig.stats.counter("seq_gaps_total") == 0
        assert stream["connections"] == 2 and len(stream["from_seqs"]) == 1, "it resumed once"

    arun(main())


def test_a_jump_the_upstream_repeats_on_a_fresh_resume_is_accepted_as_a_gap(cfg: Config) -> None:
    async def main() -> None:
        async with streaming(cfg, "skip") as rig:
            await until(lambda: rig.last >= 20, what="20 frames")
            rig.up.skip("skip", JUMP)
            await until(lambda: rig.last >= JUMP + 30, what="30 frames past the jump")
            written = sorted(await rig.written())
            stream = rig.up.stats()["skip"]
        before = [s for s in written if s < JUMP]
        after = [s for s in written if s >= JUMP]
        assert before[0] == 1 and contiguous(before) and contiguous(after)
        assert after[0] == before[-1] + 1 + JUMP
        assert rig.anomalies("jump") == 1, "the jump was accepted before the upstream confirmed it"
        assert rig.anomalies("jump_accepted") == 1
        assert rig.stats.counter("seq_gaps_total") == 1
        assert stream["from_seqs"] == [before[-1] + 1], "the confirming resume starts after the last frame written"

    arun(main())


@pytest.mark.parametrize("where", ["mid_stream", "on_reconnect"])
def test_a_numbering_restart_parks_the_stream_and_overwrites_nothing(cfg: Config, where: str) -> None:
    """``mid_stream``: far below (max_seq_jump 20); ``on_reconnect``: back to 1 on a resume (default config)."""
    extra = {"max_seq_jump": 20} if where == "mid_stream" else {}

    async def main() -> None:
        async with streaming(cfg, "reset", **extra) as rig:
            await until(lambda: rig.last >= 50, what="50 frames")
            rig.up.restart_numbering("reset")
            if where == "on_reconnect":
                await asyncio.sleep(0.1)  # the old numbering's last frames arrive first
                rig.up.drop_all()
            await until(lambda: rig.conn.parked, 5.0, "the stream to be parked")
            last = rig.last
            await asyncio.sleep(0.5)
            assert rig.last == last, "a parked stream went on"
            written = await rig.written()
            stream = rig.up.stats()["reset"]
        assert sorted(written) == list(range(1, last + 1))
        assert all(written[s] == rig.up.frame("reset", s) for s in (1, 2, last)), "an old message was overwritten"
        assert rig.anomalies("reset") == 1 and rig.anomalies("reset_parked") == 1
        assert stream["attached"] == 0 and not rig.conn.connected

    arun(main())


def test_duplicates_of_a_replay_overlap_are_dropped(cfg: Config) -> None:
    async def main() -> None:
        async with streaming(cfg, "dup") as rig:
            await until(lambda: rig.last >= 20, what="20 frames")
            for seq in (rig.last, rig.last - 5, 1):
                rig.up.inject("dup", "noseq", b'{"seq":%d,"data":"again"}' % seq)
            await until(lambda: rig.stats.counter("upstream_duplicates_total") == 3, what="3 duplicates")
            target = rig.last + 10
            await until(lambda: rig.last >= target, what="10 more frames")
            written = await rig.written()
        assert sorted(written)[0] == 1 and contiguous(sorted(written))
        assert all(b"again" not in p for p in written.values())
        assert rig.anomalies("reset") == 0 and rig.up.stats()["dup"]["connections"] == 1

    arun(main())


# ----- where sockets may go (SSRF guard) --------------------------------------------------------------------


@dataclass
class Listening:
    """A plain TCP server on one loopback address that counts the connections it accepts."""

    host: str
    port: int = 0
    accepted: list[str] = field(default_factory=list)


@asynccontextmanager
async def listening(host: str, reply: bytes = b"") -> AsyncIterator[Listening]:
    """Accept connections on ``host``; send ``reply`` after the request's headers (if any), then hang up."""
    box = Listening(host)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        box.accepted.append(str(writer.get_extra_info("peername")))
        with suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            if reply:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(reply)
                await writer.drain()
            else:
                await reader.read()  # hold the socket until the client gives up
        writer.close()

    server = await asyncio.start_server(handle, host, 0)
    box.port = server.sockets[0].getsockname()[1]
    try:
        yield box
    finally:
        server.close()
        with suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)


@asynccontextmanager
async def dialing(url: str, cid: str, **settings: Any) -> AsyncIterator[tuple[Connection, Stats]]:
    """A :class:`Connection` to ``url`` on the product defaults plus ``settings``; nothing is flushed to AWS."""
    cfg = config.replace(Config(), allowed_schemes=("ws", "wss"), backoff_min_s=0.05, backoff_max_s=0.1,
                         handshake_timeout_s=1.0, **settings)
    stats, clock = Stats(), SystemClock()
    sink = Sink(cfg, SESSION, stats, clock)
    conn = Connection(cid, url, sink.cursor(cid, 1, -1), None, sink, cfg.upstream, stats, clock)
    conn.start()
    try:
        yield conn, stats
    finally:
        await conn.close()


def refused(stats: Stats, reason: str) -> float:
    return stats.counter("upstream_connect_refused_total", reason=reason)


def test_a_redirect_to_another_loopback_address_is_refused_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Loopback is allowed here: only the redirect itself is refused, and the target never sees a socket."""
    async def main() -> None:
        async with listening("127.0.0.3") as target:
            location = f"ws://127.0.0.3:{target.port}/elsewhere?token=SECRET"
            reply = f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode()
            async with listening("127.0.0.2", reply) as redirector, \
                    dialing(f"ws://127.0.0.2:{redirector.port}/s", "redirected",
                            allowed_networks=LOOPBACK_NETWORKS) as (conn, stats):
                await until(lambda: refused(stats, "redirect") >= 2, what="two refused redirects")
                assert len(redirector.accepted) >= 2 and not conn.connected
            assert target.accepted == [], "the redirect was followed"
        assert stats.messages == 0
        assert stats.counter("upstream_connect_errors_total", kind="WSInvalidStatusError") >= 2

    caplog.set_level(logging.WARNING, logger="fleetd.upstream")
    arun(main())
    (record,) = [r for r in caplog.records if r.getMessage() == "upstream connect refused"]  # rate-limited
    assert vars(record)["reason"] == "redirect"
    assert vars(record)["location"].endswith("/elsewhere?\u2026")
    assert "SECRET" not in logs.JsonFormatter().format(record)


@pytest.mark.parametrize(("host", "reason"), [
    ("127.0.0.1", "loopback"),
    ("localhost", "loopback"),  # the check is on the resolved address, not the name
    ("[::ffff:127.0.0.1]", "loopback"),  # IPv4-mapped IPv6 reaches 127.0.0.1
])
def test_a_loopback_upstream_is_refused_unless_allowed(host: str, reason: str) -> None:
    async def main() -> None:
        async with listening("127.0.0.1") as server:
            url = f"ws://{host}:{server.port}/s"
            async with dialing(url, f"lo-{host}") as (conn, stats):
                await until(lambda: refused(stats, reason) >= 2, what=f"refused as {reason}")
                assert not conn.connected
            assert server.accepted == [], "a socket reached the loopback server"
            # The same URL with loopback allowed does reach it: the refusal above is the guard's.
            async with dialing(url, f"lo-ok-{host}", allowed_networks=LOOPBACK_NETWORKS) as (conn, stats):
                await until(lambda: len(server.accepted) >= 1, what="a socket with loopback allowed")
                assert refused(stats, reason) == 0

    arun(main())


def test_the_instance_metadata_address_is_refused_before_any_connect() -> None:
    async def main() -> None:
        async with dialing("ws://169.254.169.254/latest/meta-data/", "imds",
                           allowed_networks=LOOPBACK_NETWORKS) as (conn, stats):
            await until(lambda: refused(stats, "link_local") >= 2, what="refused as link-local")
            assert not conn.connected
            assert stats.counter("upstream_connect_errors_total", kind="UpstreamRefused") >= 2

    arun(main())


@pytest.mark.parametrize(("host", "settings"), [
    ("127.0.0.1", {"allowed_networks": LOOPBACK_NETWORKS}),
    ("localhost", {"allowed_hosts": ("localhost",)}),  # a listed host is exempt from the address check
])
def test_an_allowed_upstream_still_streams(host: str, settings: dict[str, Any]) -> None:
    async def main() -> None:
        async with FakeUpstream(rate=100.0, size=60, tick_ms=10) as up:
            url = up.url("ok").replace("127.0.0.1", host, 1)
            async with dialing(url, f"ok-{host}", **settings) as (conn, stats):
                await until(lambda: stats.messages >= 10, what="10 messages")
                assert conn.connected
                assert not any(name == "upstream_connect_refused_total" for name, _ in stats.counters)

    arun(main())


def test_a_refusal_log_line_redacts_the_query_token(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with listening("127.0.0.1") as server, \
                dialing(f"ws://127.0.0.1:{server.port}/feed?token=SECRET&x=1", "redact") as (_, stats):
            await until(lambda: refused(stats, "loopback") >= 1, what="a refusal")

    caplog.set_level(logging.WARNING, logger="fleetd.upstream")
    arun(main())
    (record,) = [r for r in caplog.records if r.getMessage() == "upstream connect refused"]
    json_line, text_line = logs.JsonFormatter().format(record), logs.TextFormatter().format(record)
    for line in (json_line, text_line):
        assert "SECRET" not in line and "/feed?\u2026" in line, line
        assert "127.0.0.1 is a loopback address" in line, line


def test_log_formatters_redact_urls_anywhere_in_a_record() -> None:
    record = logging.makeLogRecord({"msg": "gave up on %s", "args": ("wss://u:pw@feed.example/s?token=SECRET",),
                                    "levelname": "WARNING", "name": "t", "error": "see ws://h/x?sig=SECRET2"})
    for line in (logs.JsonFormatter().format(record), logs.TextFormatter().format(record)):
        assert "SECRET" not in line and "pw" not in line, line
        assert "wss://\u2026@feed.example/s?\u2026" in line and "ws://h/x?\u2026" in line, line
