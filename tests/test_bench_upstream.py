"""Tests of the fake upstream (bench/upstream.py), driven with real picows clients."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from picows import WSCloseCode, WSFrame, WSInvalidStatusError, WSListener, WSMsgType, WSTransport, ws_connect

from bench.upstream import FakeUpstream, RawFrame, encode_raw_frame, handle_control, make_payload, ws_frame_header
from tests.helpers import arun

ROOT = Path(__file__).resolve().parents[1]


class Recorder(WSListener):
    """Client listener that keeps every data frame and echoes CLOSE like fleetd must."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[WSMsgType, bytes]] = []
        self.seqs: list[int] = []
        self.disconnected = asyncio.Event()

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind == WSMsgType.CLOSE:
            if not transport.is_close_frame_sent:
                transport.send_close(frame.get_close_code())
            transport.disconnect()
            return
        if kind not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return
        data = frame.get_payload_as_bytes()
        self.frames.append((kind, data))
        if kind == WSMsgType.TEXT:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return
            if isinstance(obj, dict) and "seq" in obj:
                self.seqs.append(obj["seq"])

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.disconnected.set()


async def connect(url: str, **kwargs: Any) -> tuple[WSTransport, Recorder]:
    transport, listener = await ws_connect(Recorder, url, **kwargs)
    assert isinstance(listener, Recorder)
    return transport, listener


async def wait_until(pred: Callable[[], bool], limit_s: float = 3.0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def close(transport: WSTransport) -> None:
    transport.disconnect()
    await transport.wait_disconnected()


def contiguous(seqs: list[int], first: int) -> bool:
    return seqs == list(range(first, first + len(seqs)))


# ------------------------------------------------------------------ frame format


def test_frame_header_lengths() -> None:
    assert ws_frame_header(125) == bytes((0x81, 125))
    assert ws_frame_header(126) == bytes((0x81, 126, 0, 126))
    assert ws_frame_header(65536) == bytes((0x81, 127)) + (65536).to_bytes(8, "big")


def test_payload_is_json_of_requested_size() -> None:
    payload = make_payload(42, 1_700_000_000_000, 200)
    assert len(payload) == 200
    obj = orjson.loads(payload)
    assert obj["seq"] == 42 and obj["ts_ms"] == 1_700_000_000_000 and set(obj["data"]) == {"x"}
    assert orjson.loads(make_payload(1, 1, 5))["seq"] == 1  # too small a size still gives valid JSON


# ------------------------------------------------------------------ streaming and replay


def test_live_stream_is_contiguous_from_1() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, rec = await connect(up.url("a"))
            await wait_until(lambda: len(rec.seqs) >= 20)
            assert contiguous(rec.seqs, 1)
            kind, data = rec.frames[0]
            assert kind == WSMsgType.TEXT and len(data) == up.size
            assert abs(orjson.loads(data)["ts_ms"] - time.time() * 1000) < 5000
            stats = up.stats()["a"]
            assert stats["connections"] == 1 and stats["attached"] == 1 and stats["max_concurrent"] == 1
            await close(transport)
            await wait_until(lambda: up.stats()["a"]["attached"] == 0)

    arun(main())


def test_resume_from_seq_replays_identical_frames() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, first = await connect(up.url("r"))
            await wait_until(lambda: len(first.seqs) >= 15)
            await close(transport)
            transport, second = await connect(up.url("r") + "?from_seq=5")
            await wait_until(lambda: len(second.seqs) >= 20)
            assert contiguous(second.seqs, 5)
            # Deterministic frames: the replay is byte for byte what the first client got.
            assert second.frames[:10] == first.frames[4:14]
            assert second.frames[0][1] == up.frame("r", 5)
            stats = up.stats()["r"]
            assert stats["connections"] == 2 and stats["from_seqs"] == [5]
            await close(transport)

    arun(main())


def test_from_seq_older_than_buffer_starts_at_oldest_kept() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50, keep=100) as up:
            up.ensure("old", age_s=10)  # 500 frames produced already, only the last 100 kept
            transport, rec = await connect(up.url("old") + "?from_seq=1")
            await wait_until(lambda: len(rec.seqs) >= 100)
            assert 400 <= rec.seqs[0] <= up.produced("old") - 99
            assert contiguous(rec.seqs, rec.seqs[0])
            await close(transport)

    arun(main())


def test_without_from_seq_a_client_gets_the_live_tail() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            up.ensure("tail", age_s=2)
            before = up.produced("tail")
            transport, rec = await connect(up.url("tail"))
            await wait_until(lambda: len(rec.seqs) >= 3)
            assert before < rec.seqs[0] <= before + 5
            assert contiguous(rec.seqs, rec.seqs[0])
            await close(transport)

    arun(main())


def test_idle_stream_keeps_producing() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            assert up.produced("idle") == 0  # unknown stream
            up.ensure("idle")
            await asyncio.sleep(0.3)
            assert 10 <= up.produced("idle") <= 20
            assert up.stats()["idle"]["connections"] == 0

    arun(main())


def test_two_clients_on_one_stream_both_stream_and_are_recorded() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            t1, r1 = await connect(up.url("dup"))
            t2, r2 = await connect(up.url("dup") + "?from_seq=1")
            await wait_until(lambda: len(r1.seqs) >= 5 and len(r2.seqs) >= 5)
            assert up.stats()["dup"]["max_concurrent"] == 2
            await close(t1)
            await close(t2)

    arun(main())


# ------------------------------------------------------------------ handshake failures


def test_bad_paths_get_404_and_bad_from_seq_400() -> None:
    async def main() -> None:
        async with FakeUpstream() as up:
            base = f"ws://127.0.0.1:{up.port}"
            for path in ("/nope", "/stream/", "/stream/a/b"):
                with pytest.raises(WSInvalidStatusError) as err:
                    await connect(base + path)
                assert err.value.response is not None and err.value.response.status == 404
            with pytest.raises(WSInvalidStatusError) as err:
                await connect(up.url("x") + "?from_seq=abc")
            assert err.value.response is not None and err.value.response.status == 400

    arun(main())


def test_refuse_gives_503_until_lifted() -> None:
    async def main() -> None:
        async with FakeUpstream() as up:
            up.refuse(True)
            with pytest.raises(WSInvalidStatusError) as err:
                await connect(up.url("x"))
            assert err.value.response is not None and err.value.response.status == 503
            assert up.refused_total == 1
            up.refuse(False)
            transport, _ = await connect(up.url("x"))
            await close(transport)

    arun(main())


# ------------------------------------------------------------------ chaos


def test_inject_bad_frames_arrive_as_such() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=0) as up:  # rate 0: only injected frames on the wire
            transport, rec = await connect(up.url("inj"))
            await wait_until(lambda: up.stats()["inj"]["attached"] == 1)
            for kind in ("malformed", "binary", "oversized", "noseq"):
                assert up.inject("inj", kind) == 1
            await wait_until(lambda: len(rec.frames) == 4)
            (k1, malformed), (k2, _), (k3, oversized), (k4, noseq) = rec.frames
            assert k1 == WSMsgType.TEXT
            with pytest.raises(orjson.JSONDecodeError):
                orjson.loads(malformed)
            assert k2 == WSMsgType.BINARY
            assert k3 == WSMsgType.TEXT and len(oversized) == up.oversize_bytes
            assert k4 == WSMsgType.TEXT and "seq" not in orjson.loads(noseq)
            assert rec.seqs == []
            with pytest.raises(ValueError):
                up.inject("inj", "bogus")  # type: ignore[arg-type]
            await close(transport)

    arun(main())


def test_inject_comes_after_frames_already_produced() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50, tick_ms=50) as up:
            transport, rec = await connect(up.url("order"))
            await asyncio.sleep(0.2)
            produced = up.produced("order")
            up.inject("order", "noseq")
            await wait_until(lambda: any(b'"noseq"' in data for _, data in rec.frames))
            before_inject = rec.seqs[: next(i for i, (_, d) in enumerate(rec.frames) if b'"noseq"' in d)]
            assert before_inject[-1] >= produced
            await close(transport)

    arun(main())


def test_drop_all_disconnects_without_close_frame() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, rec = await connect(up.url("d"))
            await wait_until(lambda: len(rec.seqs) >= 2)
            assert up.drop_all() == 1
            await asyncio.wait_for(rec.disconnected.wait(), 2)
            handshake = transport.close_handshake
            assert handshake is None or handshake.recv is None  # no CLOSE frame: a 1006 for the client
            await wait_until(lambda: up.stats()["d"]["attached"] == 0)

    arun(main())


def test_stall_withholds_frames_and_pongs_then_resumes_without_gap() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            plain, rec = await connect(up.url("s1"))
            pinger, ping_rec = await connect(
                up.url("s2"), enable_auto_ping=True, auto_ping_idle_timeout=0.3, auto_ping_reply_timeout=0.3
            )
            await wait_until(lambda: len(rec.seqs) >= 3)
            up.set_stall(True)
            await asyncio.sleep(0.05)  # let frames already in flight land
            count = len(rec.seqs)
            # No data and no pong: the auto-pinging client gives up on the "hung" upstream.
            await asyncio.wait_for(ping_rec.disconnected.wait(), 3)
            assert len(rec.seqs) == count
            assert up.produced("s1") > count + 10  # production went on
            up.set_stall(False)
            await wait_until(lambda: len(rec.seqs) >= up.produced("s1") - 2)
            assert contiguous(rec.seqs, 1)
            await close(plain)
            assert pinger.is_disconnected

    arun(main())


def test_pings_are_answered_when_not_stalled() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=0) as up:
            transport, rec = await connect(
                up.url("p"), enable_auto_ping=True, auto_ping_idle_timeout=0.15, auto_ping_reply_timeout=0.15
            )
            await asyncio.sleep(0.8)
            assert not rec.disconnected.is_set()
            await close(transport)

    arun(main())


def test_stop_stream_closes_with_1000() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, rec = await connect(up.url("st"))
            await wait_until(lambda: len(rec.seqs) >= 1)
            assert up.stop_stream("st") == 1
            await asyncio.wait_for(rec.disconnected.wait(), 1)  # well before the 2 s grace: echo worked
            handshake = transport.close_handshake
            assert handshake is not None and handshake.recv is not None
            assert handshake.recv.code == WSCloseCode.OK

    arun(main())


def test_client_close_is_echoed() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, _ = await connect(up.url("c"))
            transport.send_close(WSCloseCode.GOING_AWAY, b"bye")
            await asyncio.wait_for(transport.wait_disconnected(), 2)
            handshake = transport.close_handshake
            assert handshake is not None and handshake.recv is not None
            assert handshake.recv.code == WSCloseCode.GOING_AWAY

    arun(main())


# ------------------------------------------------------------------ scale


def test_scale_5000_streams_one_ticker() -> None:
    async def main() -> None:
        n_streams, n_clients = 5000, 500
        # One frame per 100 s: connecting 500 clients one by one took over 10 s on a loaded CI
        # machine, long enough for a stream to produce its second frame at the former 0.1/s.
        async with FakeUpstream(rate=0.01) as up:
            # Ages spread over 99.0-99.9 s: every stream produces its first frame within the next second.
            for i in range(n_streams):
                up.ensure(f"s{i}", age_s=99.0 + 0.9 * i / n_streams)
            conns = [await connect(up.url(f"s{i}") + "?from_seq=1") for i in range(n_clients)]
            await wait_until(lambda: all(rec.seqs == [1] for _, rec in conns), limit_s=5)
            assert all(up.produced(f"s{i}") == 1 for i in range(n_streams))
            # With every next frame ~100 s away the ticker should be nearly free; generous bound only.
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(1.0)
            cpu = time.process_time() - cpu0
            assert cpu < 0.5 * (time.monotonic() - wall0), f"idle CPU {cpu:.3f}s"
            stats = up.stats()
            assert sum(s["attached"] for s in stats.values()) == n_clients
            assert sum(s["sent"] for s in stats.values()) == n_clients
            for transport, _ in conns:
                transport.disconnect()

    arun(main())


# ------------------------------------------------------------------ control endpoint and CLI


def test_handle_control_errors() -> None:
    up = FakeUpstream()
    assert handle_control(up, "GET", "/nope")[0] == 404
    assert handle_control(up, "GET", "/drop")[0] == 405
    assert handle_control(up, "POST", "/inject?id=a")[0] == 400  # no kind
    assert handle_control(up, "POST", "/inject?id=a&kind=bogus")[0] == 400
    assert handle_control(up, "POST", "/ensure?id=a&id=b&rate=2")[1] == {"created": 2}
    assert handle_control(up, "GET", "/produced?id=a")[1] == {"id": "a", "produced": 0}
    status, body = handle_control(up, "GET", "/stats")
    assert status == 200 and set(body["streams"]) == {"a", "b"} and body["totals"]["streams"] == 2


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    # Unbuffered pipe: a buffered readline could swallow the next line, which select() would then miss.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, bufsize=0)


def _readline(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from the upstream process"
    return proc.stdout.readline().decode().strip()


def _http(method: str, url: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_cli_control_endpoint_stats_file_and_sigterm(tmp_path: Path) -> None:
    stats_file = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "bench.upstream", "--port", "0", "--control-port", "0", "--rate", "50"]
    proc = _spawn([*cmd, "--stats-file", str(stats_file)])
    try:
        control = _readline(proc).removeprefix("control ")
        listening = _readline(proc)
        assert listening.startswith("listening ws://127.0.0.1:") and control.startswith("http://")
        ws_base = listening.removeprefix("listening ")
        assert _http("POST", control + "/ensure?id=idle")[1] == {"created": 1}

        async def stream() -> None:
            transport, rec = await connect(ws_base + "/stream/live")
            await wait_until(lambda: len(rec.seqs) >= 5)
            assert contiguous(rec.seqs, 1)
            assert _http("POST", control + "/inject?id=live&kind=binary")[1] == {"sent": 1}
            await wait_until(lambda: any(kind == WSMsgType.BINARY for kind, _ in rec.frames))
            assert _http("POST", control + "/drop")[1] == {"dropped": 1}
            await asyncio.wait_for(rec.disconnected.wait(), 2)
            transport.disconnect()

        arun(stream())
        assert _http("POST", control + "/stall?on=1")[1] == {"stalled": True}
        assert _http("POST", control + "/stall?on=0")[1] == {"stalled": False}
        assert _http("POST", control + "/refuse?on=1")[1] == {"refusing": True}
        assert _http("POST", control + "/inject?id=live&kind=bogus")[0] == 400
        status, stats = _http("GET", control + "/stats")
        assert status == 200 and stats["refusing"] is True
        assert stats["streams"]["live"]["connections"] == 1 and stats["streams"]["live"]["produced"] >= 5
        assert _http("GET", control + "/produced?id=idle")[1]["produced"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        final = json.loads(stats_file.read_text())
        assert set(final["streams"]) == {"idle", "live"}
        assert {"produced", "connections", "max_concurrent", "attached"} <= set(final["streams"]["live"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_exits_0_on_sigint() -> None:
    proc = _spawn([sys.executable, "-m", "bench.upstream", "--port", "0"])
    try:
        assert _readline(proc).startswith("listening ws://")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_rate_zero_never_produces() -> None:
    up = FakeUpstream(rate=0)
    up.ensure("z", age_s=1e6)
    assert up.produced("z") == 0
    assert math.isinf(up._streams["z"].due_at(1))


# ------------------------------------------------------------------ raw frames for fuzzing


class RawRecorder(Recorder):
    """Also keeps continuation frames (and each frame's FIN bit)."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[tuple[WSMsgType, bool, bytes]] = []

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type in (WSMsgType.TEXT, WSMsgType.BINARY, WSMsgType.CONTINUATION):
            self.raw.append((frame.msg_type, bool(frame.fin), frame.get_payload_as_bytes()))
        super().on_ws_frame(transport, frame)


async def connect_raw(url: str, **kwargs: Any) -> tuple[WSTransport, RawRecorder]:
    transport, listener = await ws_connect(RawRecorder, url, **kwargs)
    assert isinstance(listener, RawRecorder)
    return transport, listener


def test_send_frames_writes_raw_frames_whole_and_in_order() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=0) as up:
            transport, rec = await connect_raw(up.url("raw"))
            await wait_until(lambda: up.stats()["raw"]["attached"] == 1)
            frames: list[RawFrame] = [
                (0x01, b'{"a":', False),  # TEXT without FIN …
                (0x00, b'"b"', False),  # … a continuation …
                (0x80, b"}", False),  # … and the final fragment
                (0x82, b"\x00\xff", False),  # a binary frame
                (0x81, b"x" * 70_000, False),  # a 64-bit length header
            ]
            assert up.send_frames("raw", frames) == 1
            await wait_until(lambda: len(rec.raw) == 5)
            assert [(kind, fin) for kind, fin, _ in rec.raw] == [
                (WSMsgType.TEXT, False), (WSMsgType.CONTINUATION, False), (WSMsgType.CONTINUATION, True),
                (WSMsgType.BINARY, True), (WSMsgType.TEXT, True)]
            assert b"".join(data for _, _, data in rec.raw[:3]) == b'{"a":"b"}'
            assert rec.raw[4][2] == b"x" * 70_000
            assert up.send_frames("nope", frames) == 0
            await close(transport)

    arun(main())


def test_masked_frame_from_server_is_a_protocol_error_and_sealing_stops_injection() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=0) as up:
            transport, rec = await connect(up.url("m"))
            await wait_until(lambda: up.stats()["m"]["attached"] == 1)
            assert encode_raw_frame(0x81, b"ab", masked=True) == bytes((0x81, 0x82, 0, 0, 0, 0)) + b"ab"
            assert up.send_frames("m", [(0x81, b"{}", True)], seal=True) == 1
            assert up.send_frames("m", [(0x81, b"{}", False)]) == 0  # sealed: nothing more for this client
            assert up.inject("m", "noseq") == 0
            await asyncio.wait_for(rec.disconnected.wait(), 3)  # picows answers with CLOSE 1002
            assert rec.frames == []
            transport.disconnect()

    arun(main())


def test_dribble_holds_back_stream_frames_until_its_message_ends() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=100, tick_ms=10) as up:
            transport, rec = await connect_raw(up.url("dr"), max_frame_size=1 << 20)
            await wait_until(lambda: len(rec.seqs) >= 3)
            assert up.dribble("dr", 50_000, chunk_bytes=10_000) == 1
            # 1 TEXT fragment + 4 continuations (the last with FIN), then the stream's frames again.
            await wait_until(lambda: sum(1 for kind, _, _ in rec.raw if kind == WSMsgType.CONTINUATION) == 4)
            parts = [i for i, (_, _, data) in enumerate(rec.raw) if data.startswith(b"~")]
            assert parts == list(range(parts[0], parts[0] + 5)), "no stream frame between the fragments"
            assert [rec.raw[i][1] for i in parts] == [False, False, False, False, True]
            assert sum(len(rec.raw[i][2]) for i in parts) == 50_000
            await wait_until(lambda: len(rec.seqs) >= up.produced("dr") - 2)
            assert contiguous(rec.seqs, 1), "frames held back during the message are sent after it"
            assert up.dribble("dr", 10) == 0  # sealed
            await close(transport)

    arun(main())


def test_frames_control_endpoint() -> None:
    up = FakeUpstream()
    body = orjson.dumps([
        {"id": "a", "frames": [{"first": 0x81, "payload": base64.b64encode(b"{}").decode(), "pad": 3}]},
        {"id": "a", "dribble": 100, "chunk": 10},
    ])
    assert handle_control(up, "POST", "/frames", body) == (200, {"sent": [0, 0]})  # no stream, no client
    assert handle_control(up, "POST", "/frames", b"not json")[0] == 400
    assert handle_control(up, "POST", "/frames", b'{"id": "a"}')[0] == 400
    assert handle_control(up, "POST", "/frames", b'[{"id": "a", "frames": [{"payload": "AA=="}]}]')[0] == 400
    assert handle_control(up, "POST", "/frames", b'[{"id": "a", "frames": [{"first": 1, "payload": "!"}]}]')[0] == 400
    assert handle_control(up, "POST", "/frames", b'[[1]]')[0] == 400


def test_hold_close_leaves_a_client_close_unanswered() -> None:
    async def main() -> None:
        async with FakeUpstream(rate=50) as up:
            transport, rec = await connect(up.url("hc"))
            await wait_until(lambda: len(rec.seqs) >= 2)
            up.hold_close(True)
            transport.send_close(WSCloseCode.OK)
            await asyncio.sleep(0.3)
            assert not rec.disconnected.is_set() and up.stats()["hc"]["attached"] == 1
            count = len(rec.seqs)
            await wait_until(lambda: len(rec.seqs) > count)  # data keeps flowing
            assert handle_control(up, "POST", "/hold_close?on=0") == (200, {"holding_close": False})
            transport.disconnect()
            await wait_until(lambda: up.stats()["hc"]["attached"] == 0)

    arun(main())
