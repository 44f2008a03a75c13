"""One upstream stream (``fleetd.upstream.Connection``): sequencing and its anomaly policy (SPEC §5).

A real :class:`Connection` streams from the in-process fake upstream into a real
:class:`Sink` on dynalite, so "written" below means durable in the messages table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from bench.upstream import FakeUpstream
from fleetd import config
from fleetd.clock import SystemClock
from fleetd.config import Config
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
