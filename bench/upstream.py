"""Fake upstream WebSocket server for tests, the demo and benchmarks.

Serves ``ws://HOST:PORT/stream/<id>``.  Every stream is a deterministic, time-driven sequence of JSON
text frames ``{"seq": n, "ts_ms": t, "data": "xxx…"}``: frame ``n`` is produced at
``created + n / rate`` whether or not a client is attached, so "how much was produced" is a pure function
of the clock and a stream costs O(1) memory.  The ring buffer of the last ``keep`` frames is virtual: a
replay (``?from_seq=N``) regenerates the frames, byte for byte identical to the first delivery.

One shared ticker (not one task per stream) delivers frames.  Attached clients sit in a timing wheel keyed
by the tick at which their next frame is due, so a tick only touches clients that actually have something
to send and 20,000 mostly idle streams cost next to nothing.  Each client's due frames are encoded into a
single buffer and written with one transport write: picows sending one frame per call tops out near
0.2 M frames/s (NOTES.md), raw batched writes go well beyond that.

Numbering: frame ``n`` (1, 2, 3 …, the stream's own index) carries ``seq = n + first_seq - 1``, so
``first_seq=0`` gives an upstream numbered from 0; ``?from_seq=`` is read in that numbering.  Two
sequence anomalies can be staged on a live stream: :meth:`FakeUpstream.skip` (the upstream really skips
seqs: later frames, live and replayed, are numbered higher, and a resume inside the skipped range starts
at the first frame after it) and :meth:`FakeUpstream.restart_numbering` (a restarted upstream: later frames
are numbered from ``first_seq`` again, and it knows nothing of its old numbering, so a ``from_seq`` it has
not reached yet starts the client at its new first frame).

Chaos hooks for tests: :meth:`FakeUpstream.drop_all`, :meth:`~FakeUpstream.set_stall`,
:meth:`~FakeUpstream.refuse`, :meth:`~FakeUpstream.hold_close`, :meth:`~FakeUpstream.inject`,
:meth:`~FakeUpstream.stop_stream`, and for
fuzzing :meth:`~FakeUpstream.send_frames` (arbitrary raw frames: any opcode, FIN/RSV bits, masking,
fragments) and :meth:`~FakeUpstream.dribble` (a fragmented message that never ends).
``python -m bench.upstream --help`` runs it as a process with an optional HTTP control port.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import logging
import math
import os
import signal
import struct
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Final, Literal, TypeGuard, get_args
from urllib.parse import parse_qs, unquote, urlsplit

import orjson
from picows import (
    WSCloseCode,
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
    WSUpgradeRequest,
    WSUpgradeResponse,
    WSUpgradeResponseWithListener,
    ws_create_server,
)

InjectKind = Literal["malformed", "binary", "oversized", "noseq"]
INJECT_KINDS: Final[tuple[str, ...]] = get_args(InjectKind)

STREAM_PREFIX: Final = "/stream/"
# Upper bound of frames written to one client per tick: a 10,000-frame replay is spread over a few ticks
# instead of stalling every other stream for one long tick.
MAX_FRAMES_PER_WRITE: Final = 4096
# A client that does not answer our CLOSE within this time is cut off (stop_stream).
CLOSE_GRACE_S: Final = 2.0

_FIN_TEXT: Final = 0x81  # FIN bit + TEXT opcode; server frames are never masked (RFC 6455 §5.1)
_TEXT_MORE: Final = 0x01  # TEXT opcode without FIN: the first fragment of a message
_CONTINUATION_MORE: Final = 0x00
_CONTINUATION_FIN: Final = 0x80
# Largest request body the control endpoint reads (/frames batches; big payloads use "pad").
CONTROL_MAX_BODY: Final = 16 << 20

RawFrame = tuple[int, bytes, bool]
"""A frame for :meth:`FakeUpstream.send_frames`: (first header byte = FIN|RSV|opcode, payload, masked)."""

log = logging.getLogger("bench.upstream")


def ws_frame_header(payload_len: int, first_byte: int = _FIN_TEXT) -> bytes:
    """Header of an unmasked (server-to-client) WebSocket frame."""
    if payload_len < 126:
        return bytes((first_byte, payload_len))
    if payload_len < 65536:
        return struct.pack("!BBH", first_byte, 126, payload_len)
    return struct.pack("!BBQ", first_byte, 127, payload_len)


def encode_raw_frame(first_byte: int, payload: bytes, masked: bool = False) -> bytes:
    """Any frame a broken server could send, e.g. a masked one (forbidden from servers) or a bare fragment.

    A masked frame uses the all-zero key, so its payload bytes stay as given.
    """
    header = ws_frame_header(len(payload), first_byte & 0xFF)
    if masked:
        header = bytes((header[0], header[1] | 0x80)) + header[2:] + b"\0\0\0\0"
    return header + payload


def make_payload(seq: int, ts_ms: int, size: int) -> bytes:
    """The JSON payload of frame ``seq``, padded with ``x`` to ``size`` bytes (longer if ``size`` is tiny)."""
    head = b'{"seq":%d,"ts_ms":%d,"data":"' % (seq, ts_ms)
    pad = size - len(head) - 2
    return head + b"x" * pad + b'"}' if pad > 0 else head + b'"}'


def _padded_json(obj_prefix: bytes, size: int) -> bytes:
    """``{<obj_prefix>,"data":"xxx…"}`` padded to ``size`` bytes; used for injected frames."""
    head = b"{" + obj_prefix + b',"data":"'
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


class _Stream:
    """One upstream stream: production is a function of time, so only counters are stored."""

    __slots__ = (
        "clients",
        "connections",
        "created_mono",
        "created_ms",
        "first_seq",
        "from_seqs",
        "max_concurrent",
        "period_ms",
        "rate",
        "refused",
        "renumber_at",
        "renumber_to",
        "restarted",
        "sent",
        "sid",
    )

    def __init__(self, sid: str, rate: float, age_s: float, first_seq: int = 1) -> None:
        self.sid = sid
        self.first_seq = first_seq
        # One renumbering at most: frames after index ``renumber_at`` are numbered from ``renumber_to``.
        self.renumber_at: int | None = None
        self.renumber_to = 0
        self.restarted = False  # the renumbering is a restart (numbering from first_seq again), not a skip
        self.rate = rate
        self.created_mono = time.monotonic() - age_s
        self.created_ms = time.time() * 1000.0 - age_s * 1000.0
        self.period_ms = 1000.0 / rate if rate > 0 else math.inf
        self.clients: list[_Client] = []
        self.connections = 0
        self.refused = 0
        self.from_seqs: list[int] = []
        self.max_concurrent = 0
        self.sent = 0

    def produced_at(self, now: float) -> int:
        """Highest seq produced by monotonic time ``now`` (0 = none yet)."""
        if self.rate <= 0:
            return 0
        return max(0, int((now - self.created_mono) * self.rate))

    def due_at(self, seq: int) -> float:
        """Monotonic time at which frame ``seq`` is produced."""
        return self.created_mono + seq / self.rate if self.rate > 0 else math.inf

    def ts_ms(self, seq: int) -> int:
        return int(self.created_ms + seq * self.period_ms)

    def wire_seq(self, n: int) -> int:
        """The ``seq`` frame ``n`` carries."""
        if self.renumber_at is None or n <= self.renumber_at:
            return n + self.first_seq - 1
        return self.renumber_to + n - self.renumber_at - 1

    def index_of(self, from_seq: int, now: float) -> int:
        """Index of the first frame for a client asking ``?from_seq=`` (see the module docstring)."""
        n0 = self.renumber_at
        if n0 is None:
            return max(1, from_seq - self.first_seq + 1)
        if self.restarted:
            n = n0 + 1 + from_seq - self.renumber_to
            return n if n0 < n <= self.produced_at(now) + 1 else n0 + 1
        if from_seq >= self.renumber_to:
            return n0 + 1 + from_seq - self.renumber_to
        if from_seq > self.wire_seq(n0):
            return n0 + 1  # inside the skipped range: the next frame that exists
        return max(1, from_seq - self.first_seq + 1)


class _Client(WSListener):
    """Server-side listener of one connection.  No ``__slots__``: picows keeps a weakref to it."""

    def __init__(self, up: FakeUpstream, stream: _Stream, next_seq: int, from_seq: int | None) -> None:
        super().__init__()
        self.up = up
        self.stream = stream
        self.next_seq = next_seq  # next seq to write to this client
        self.from_seq = from_seq
        self.transport: WSTransport | None = None
        self.paused = False  # write backpressure: the kernel and transport buffers are full
        self.gone = False
        self.slot = -1  # tick index of the wheel bucket this client is queued in, -1 = parked
        self.sealed = False  # send_frames(seal=True) / dribble: no more injected frames for this client
        self.dribble_left = 0  # bytes of an endless fragmented message still to send (blocks real frames)
        self.dribble_chunk = 0

    def injectable(self) -> bool:
        """Writable and not sealed by an earlier fuzz frame (which presumably made the client hang up)."""
        return self.writable() and not self.sealed and self.dribble_left == 0

    def writable(self) -> bool:
        tr = self.transport
        return tr is not None and not self.gone and not tr.is_close_frame_sent and not tr.is_disconnected

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        self.up._attach(self)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind == WSMsgType.PING:
            # Auto-pong is disabled on the server so that a stalled upstream looks hung to auto-ping.
            if not self.up.stalled:
                transport.send_pong(frame.get_payload_as_bytes())
        elif kind == WSMsgType.CLOSE:
            if self.up.holding_close:
                return  # a peer that never answers CLOSE: the client must give up on its own
            # picows never answers a CLOSE itself; echo it unless we started the handshake.
            if not transport.is_close_frame_sent:
                code = frame.get_close_code()
                transport.send_close(WSCloseCode.OK if code == WSCloseCode.NO_INFO else code)
            transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.up._detach(self)

    # Defining these keeps picows from warning on every backpressure event; they also park the client.
    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.up._wake(self)


class FakeUpstream:
    """In-process fake upstream.  ``__init__`` does no loop work; :meth:`start` binds."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        rate: float = 1.0,
        size: int = 200,
        keep: int = 10_000,
        tick_ms: int = 20,
        *,
        oversize_bytes: int = 1 << 20,
        stalled: bool = False,
        refusing: bool = False,
        first_seq: int = 1,
        ping_s: float = 0.0,
    ) -> None:
        if rate < 0 or keep < 1 or tick_ms <= 0 or first_seq < 0:
            raise ValueError("rate must be >= 0, keep >= 1, tick_ms > 0, first_seq >= 0")
        self.first_seq = first_seq
        # > 0: ping every client idle this long and drop it if no pong comes within as long (a client
        # whose process is paused stops answering; real upstreams drop such sockets the same way).
        self.ping_s = ping_s
        self.host = host
        self.port = port
        self.rate = rate
        self.size = size
        self.keep = keep
        self.tick_s = tick_ms / 1000.0
        self.oversize_bytes = oversize_bytes
        self.stalled = stalled
        self.refusing = refusing
        self.refused_total = 0
        self.holding_close = False  # hold_close(): client CLOSE frames go unanswered
        self._streams: dict[str, _Stream] = {}
        self._clients: set[_Client] = set()
        # Timing wheel: tick index -> clients whose next frame is due by then.  Entries go stale when a
        # client is rescheduled earlier or leaves; ``_Client.slot`` tells which entry is current.
        self._wheel: dict[int, list[_Client]] = {}
        self._t0 = 0.0
        self._done_tick = -1
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # picows logs every connect/disconnect at INFO; thousands of them drown everything else.
        logging.getLogger("picows.fake_upstream").setLevel(logging.WARNING)
        self._t0 = time.monotonic()
        self._done_tick = -1
        self._server = await ws_create_server(
            self._route,
            self.host,
            self.port,
            enable_auto_pong=False,  # answered by _Client.on_ws_frame so that stall can withhold pongs
            enable_auto_ping=self.ping_s > 0,
            auto_ping_idle_timeout=self.ping_s or 10.0,
            auto_ping_reply_timeout=self.ping_s or 10.0,
            read_buffer_init_size=2048,  # clients send almost nothing; halves idle memory per connection
            logger_name="fake_upstream",
            backlog=4096,  # benchmarks open thousands of connections at once
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="fake-upstream-ticker")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        for client in list(self._clients):
            if client.transport is not None:
                client.transport.send_close(WSCloseCode.GOING_AWAY, b"fake upstream stopping")
                client.transport.disconnect()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        self._wheel.clear()

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def url(self, stream_id: str) -> str:
        return f"ws://{self.host}:{self.port}{STREAM_PREFIX}{stream_id}"

    # ---------------------------------------------------------------- streams and reports

    def ensure(self, stream_id: str, *, rate: float | None = None, age_s: float = 0.0) -> bool:
        """Create ``stream_id`` unless it exists (then nothing changes).  Returns True if created.

        ``age_s`` backdates the creation, e.g. to get a stream that already overflowed its ring buffer.
        """
        if stream_id in self._streams:
            return False
        self._streams[stream_id] = _Stream(stream_id, self.rate if rate is None else rate, age_s, self.first_seq)
        return True

    def produced(self, stream_id: str) -> int:
        """Frames produced so far (0 for an unknown stream); the highest seq when numbering starts at 1."""
        stream = self._streams.get(stream_id)
        return stream.produced_at(time.monotonic()) if stream is not None else 0

    def frame(self, stream_id: str, n: int) -> bytes:
        """Exact payload of frame ``n`` (what a client received or will receive)."""
        stream = self._streams[stream_id]
        return make_payload(stream.wire_seq(n), stream.ts_ms(n), self.size)

    def skip(self, stream_id: str, delta: int) -> None:
        """From the next frame on, number ``stream_id``'s frames ``delta`` higher: a real gap, replayed as such."""
        stream = self._renumbered(stream_id)
        stream.renumber_to = stream.wire_seq(stream.renumber_at or 0) + 1 + delta

    def restart_numbering(self, stream_id: str) -> None:
        """From the next frame on, number ``stream_id``'s frames from ``first_seq`` again (a restarted upstream)."""
        stream = self._renumbered(stream_id)
        stream.renumber_to = stream.first_seq
        stream.restarted = True

    def _renumbered(self, stream_id: str) -> _Stream:
        stream = self._streams[stream_id]
        if stream.renumber_at is not None:
            raise ValueError(f"stream {stream_id!r} was renumbered already")
        now = time.monotonic()
        for client in stream.clients:  # frames due before the change go out under the old numbering
            if not self.stalled:
                self._write_due(client, now)
        stream.renumber_at = stream.produced_at(now)
        return stream

    def stats(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        return {sid: self._stream_stats(s, now) for sid, s in self._streams.items()}

    @staticmethod
    def _stream_stats(s: _Stream, now: float) -> dict[str, Any]:
        return {
            "produced": s.produced_at(now),
            "connections": s.connections,
            "from_seqs": list(s.from_seqs),
            "max_concurrent": s.max_concurrent,
            "attached": len(s.clients),
            "sent": s.sent,
            "refused": s.refused,
        }

    # ---------------------------------------------------------------- chaos

    def drop_all(self) -> int:
        """Abort every client connection without a CLOSE frame.  Returns how many were dropped."""
        transports = [c.transport for c in self._clients if c.transport is not None]
        for tr in transports:
            tr.disconnect(graceful=False)
        return len(transports)

    def set_stall(self, on: bool = True) -> None:
        """Stalled: production goes on, but no data frames are sent and pings go unanswered."""
        self.stalled = on
        if not on:
            for client in self._clients:
                self._wake(client)

    def refuse(self, on: bool = True) -> None:
        """Refusing: every handshake is answered with HTTP 503."""
        self.refusing = on

    def hold_close(self, on: bool = True) -> None:
        """Holding: a client's CLOSE is neither echoed nor followed by a disconnect (data keeps flowing),
        so a polite client close lasts its full timeout, as with a sluggish real server."""
        self.holding_close = on

    def inject(self, stream_id: str, kind: InjectKind, payload: bytes | None = None) -> int:
        """Send one bad frame to the clients of ``stream_id``; returns how many clients got it.

        Frames already due are flushed first (unless stalled), so the injected frame arrives after every frame
        produced before the call.  Injection ignores stall: the test asked for that frame explicitly.
        ``payload`` overrides the generated body (e.g. an oversized frame that carries a seq).
        """
        if not is_inject_kind(kind):
            raise ValueError(f"unknown inject kind {kind!r}")
        msg_type, body = self._inject_body(kind, payload)
        return self._to_clients(stream_id, lambda client, tr: tr.send(msg_type, body))

    def _to_clients(self, stream_id: str, write: Callable[[_Client, WSTransport], None]) -> int:
        """``write`` to every injectable client of ``stream_id`` after its due frames; returns how many."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        sent = 0
        for client in stream.clients:
            tr = client.transport
            if tr is not None and client.injectable():
                if not self.stalled:
                    self._write_due(client, time.monotonic())
                write(client, tr)
                sent += 1
        return sent

    def send_frames(self, stream_id: str, frames: list[RawFrame], *, seal: bool = False) -> int:
        """Write ``frames`` (raw, in one write) to each client of ``stream_id``; returns how many got them.

        Frames already due are flushed first (unless stalled), and nothing comes between the given frames,
        so a fragmented message can be sent whole.  ``seal``: the last frame should make the client hang up
        (oversized, protocol error), so no later injection goes to that client — frames sent after it would
        be lost in its close, and a fuzzer could not tell what the client must have seen.
        """
        data = b"".join(encode_raw_frame(first, payload, masked) for first, payload, masked in frames)

        def write(client: _Client, tr: WSTransport) -> None:
            tr.underlying_transport.write(data)
            client.sealed = client.sealed or seal

        return self._to_clients(stream_id, write)

    def dribble(self, stream_id: str, total_bytes: int, chunk_bytes: int = 16_384) -> int:
        """Start a TEXT message that goes on in a continuation frame per tick until ``total_bytes``.

        Like a real server stuck in one endless message, the client gets none of its stream's frames
        meanwhile; the message ends with a FIN fragment after ``total_bytes`` if the client is still there.
        The client is sealed.  Returns how many clients got the first fragment.
        """
        if total_bytes < 1 or chunk_bytes < 1:
            return 0
        first = min(chunk_bytes, total_bytes)

        def start(client: _Client, tr: WSTransport) -> None:
            tr.underlying_transport.write(encode_raw_frame(
                _FIN_TEXT if first == total_bytes else _TEXT_MORE, _dribble_bytes(first)))
            client.sealed = True
            client.dribble_left = total_bytes - first
            client.dribble_chunk = chunk_bytes
            self._wake(client)

        return self._to_clients(stream_id, start)

    def _inject_body(self, kind: str, payload: bytes | None) -> tuple[WSMsgType, bytes]:
        ts = b'"ts_ms":%d' % int(time.time() * 1000)
        if kind == "binary":
            return WSMsgType.BINARY, payload if payload is not None else b"\x00\x01\x02binary\xff"
        if payload is not None:
            return WSMsgType.TEXT, payload
        if kind == "malformed":
            return WSMsgType.TEXT, b'{"seq": this is not JSON'
        if kind == "oversized":
            return WSMsgType.TEXT, _padded_json(b'"kind":"oversized",' + ts, self.oversize_bytes)
        return WSMsgType.TEXT, _padded_json(b'"kind":"noseq",' + ts, self.size)

    def stop_stream(self, stream_id: str) -> int:
        """Close the clients of ``stream_id`` with CLOSE 1000; returns how many were closed."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        loop = asyncio.get_running_loop()
        closed = 0
        for client in list(stream.clients):
            tr = client.transport
            if tr is not None and not tr.is_close_frame_sent:
                tr.send_close(WSCloseCode.OK, b"stream stopped")
                # The client's echo makes us disconnect at once; this only cuts off a peer that never echoes.
                loop.call_later(CLOSE_GRACE_S, tr.disconnect)
                closed += 1
        return closed

    # ---------------------------------------------------------------- handshake routing

    def _route(self, request: WSUpgradeRequest) -> WSListener | WSUpgradeResponseWithListener | None:
        parts = urlsplit(request.path.decode("latin-1"))
        if not parts.path.startswith(STREAM_PREFIX):
            return None
        sid = unquote(parts.path[len(STREAM_PREFIX) :])
        if not sid or "/" in sid:
            return None
        if self.refusing:
            return self._refuse_response(sid)
        from_seq = _parse_from_seq(parts.query)
        if from_seq == -1:
            return _error_response(400, b"from_seq must be an integer")
        created = self.ensure(sid)
        stream = self._streams[sid]
        return _Client(self, stream, _start_seq(stream, created, from_seq), from_seq)

    def _refuse_response(self, sid: str) -> WSUpgradeResponseWithListener:
        self.refused_total += 1
        stream = self._streams.get(sid)
        if stream is not None:
            stream.refused += 1
        return _error_response(503, b"fake upstream refusing connections")

    # ---------------------------------------------------------------- attach / detach

    def _attach(self, client: _Client) -> None:
        stream = client.stream
        stream.clients.append(client)
        stream.connections += 1
        if client.from_seq is not None:
            stream.from_seqs.append(client.from_seq)
        stream.max_concurrent = max(stream.max_concurrent, len(stream.clients))
        self._clients.add(client)
        self._wake(client)

    def _detach(self, client: _Client) -> None:
        client.gone = True
        self._clients.discard(client)
        with contextlib.suppress(ValueError):
            client.stream.clients.remove(client)

    # ---------------------------------------------------------------- ticker

    def _schedule(self, client: _Client, tick: int) -> None:
        if client.slot != -1 and client.slot <= tick:
            return  # already queued at least as early
        client.slot = tick
        bucket = self._wheel.get(tick)
        if bucket is None:
            self._wheel[tick] = [client]
        else:
            bucket.append(client)

    def _wake(self, client: _Client) -> None:
        """Queue ``client`` for the next tick (new client, unstall, backpressure relieved)."""
        self._schedule(client, self._done_tick + 1)

    async def _tick_loop(self) -> None:
        while True:
            now = time.monotonic()
            current = int((now - self._t0) / self.tick_s)
            try:
                self._run_ticks(current, now)
            except Exception:  # a bug in one tick must not silently end all delivery
                log.exception("fake upstream tick failed")
            # Sleep to the next tick boundary rather than a fixed interval, so ticks do not drift.
            await asyncio.sleep(max(0.0, self._t0 + (current + 1) * self.tick_s - time.monotonic()))

    def _run_ticks(self, current: int, now: float) -> None:
        # Normally a single bucket; more when the loop lagged (e.g. a big replay or a GC pause).
        for tick in range(self._done_tick + 1, current + 1):
            bucket = self._wheel.pop(tick, None)
            if bucket is None:
                continue
            for client in bucket:
                if client.slot == tick:
                    client.slot = -1
                    self._pump(client, now, current)
        self._done_tick = current

    def _pump(self, client: _Client, now: float, current: int) -> None:
        """Write the client's due frames, then queue it for the tick of its next frame.

        A stalled server or a backpressured client is parked (not re-queued); set_stall(False) and
        resume_writing wake it.
        """
        if not client.writable() or self.stalled or client.paused:
            return
        if client.dribble_left > 0:
            self._dribble_step(client, current)
            return
        self._write_due(client, now)
        stream = client.stream
        if client.next_seq <= stream.produced_at(now):
            self._schedule(client, current + 1)  # batch cap hit: more due frames right away
            return
        due = stream.due_at(client.next_seq)
        if due != math.inf:
            self._schedule(client, max(current + 1, int((due - self._t0) / self.tick_s) + 1))

    def _dribble_step(self, client: _Client, current: int) -> None:
        """One more fragment of an endless message; the last one carries FIN."""
        assert client.transport is not None
        n = min(client.dribble_chunk, client.dribble_left)
        client.dribble_left -= n
        first = _CONTINUATION_FIN if client.dribble_left == 0 else _CONTINUATION_MORE
        client.transport.underlying_transport.write(encode_raw_frame(first, _dribble_bytes(n)))
        self._schedule(client, current + 1)  # the stream's own frames resume once the message is over

    def _write_due(self, client: _Client, now: float) -> None:
        stream, tr = client.stream, client.transport
        if tr is None:
            return
        produced = stream.produced_at(now)
        # Like a real ring buffer, frames older than the last `keep` are gone (a slow client sees a gap).
        client.next_seq = max(client.next_seq, produced - self.keep + 1)
        last = min(produced, client.next_seq + MAX_FRAMES_PER_WRITE - 1)
        if last < client.next_seq:
            return
        # One raw write of pre-framed bytes per client per tick; ordering with picows' own sends holds
        # because both go through the same transport.
        tr.underlying_transport.write(self._encode(stream, client.next_seq, last))
        stream.sent += last - client.next_seq + 1
        client.next_seq = last + 1

    def _encode(self, stream: _Stream, first: int, last: int) -> bytes:
        size = self.size
        parts: list[bytes] = []
        append = parts.append
        for seq in range(first, last + 1):
            payload = make_payload(stream.wire_seq(seq), stream.ts_ms(seq), size)
            append(ws_frame_header(len(payload)))
            append(payload)
        return b"".join(parts)


def _start_seq(stream: _Stream, created: bool, from_seq: int | None) -> int:
    """Index of the first frame for a new client.

    Decided at request time, not at on_ws_connected, so a frame produced during the handshake is not lost to
    a live-tail client; a stream born with this very request is delivered from its first frame.
    """
    if from_seq is not None:
        return stream.index_of(from_seq, time.monotonic())
    return 1 if created else stream.produced_at(time.monotonic()) + 1


def _dribble_bytes(n: int) -> bytes:
    return b"~" * n


def is_inject_kind(kind: str) -> TypeGuard[InjectKind]:
    return kind in INJECT_KINDS


def _parse_from_seq(query: str) -> int | None:
    """``from_seq`` from a query string: None if absent, -1 if not an integer."""
    values = parse_qs(query).get("from_seq")
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        return -1


def _error_response(status: int, body: bytes) -> WSUpgradeResponseWithListener:
    return WSUpgradeResponseWithListener(WSUpgradeResponse.create_error_response(status, body), None)


# -------------------------------------------------------------------- HTTP control endpoint


def _flag(query: dict[str, list[str]]) -> bool:
    return query.get("on", ["1"])[-1].lower() in ("1", "true", "yes", "on")


def _full_stats(up: FakeUpstream) -> dict[str, Any]:
    streams = up.stats()
    totals = {
        "streams": len(streams),
        "produced": sum(s["produced"] for s in streams.values()),
        "sent": sum(s["sent"] for s in streams.values()),
        "attached": sum(s["attached"] for s in streams.values()),
        "connections": sum(s["connections"] for s in streams.values()),
        "refused": up.refused_total,
    }
    return {"streams": streams, "totals": totals, "stalled": up.stalled, "refusing": up.refusing}


CONTROL_ACTIONS: Final = frozenset({"/drop", "/stall", "/refuse", "/inject", "/stop", "/ensure", "/frames",
                                    "/hold_close"})


def _frames_action(up: FakeUpstream, body: bytes) -> dict[str, Any]:
    """``POST /frames``: a JSON list of groups, each sent with one call; returns clients reached per group.

    A group is ``{"id": S, "frames": [{"first": 129, "payload": BASE64, "pad": N, "masked": false}, …],
    "seal": false}`` (:meth:`FakeUpstream.send_frames`; ``pad`` appends N bytes of ``x`` so big frames
    need not travel in the request) or ``{"id": S, "dribble": TOTAL_BYTES, "chunk": N}``
    (:meth:`FakeUpstream.dribble`).
    """
    try:
        groups = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"body is not JSON: {e}") from None
    if not isinstance(groups, list):
        raise ValueError("body must be a JSON list of groups")
    return {"sent": [_frames_group(up, g) for g in groups]}


def _frames_group(up: FakeUpstream, group: Any) -> int:
    if not isinstance(group, dict):
        raise ValueError("a group must be a JSON object")
    sid = str(group["id"])
    if "dribble" in group:
        return up.dribble(sid, int(group["dribble"]), int(group.get("chunk", 16_384)))
    frames: list[RawFrame] = []
    for f in group["frames"]:
        if not isinstance(f, dict):
            raise ValueError("a frame must be a JSON object")
        payload = base64.b64decode(f.get("payload", ""), validate=True) + b"x" * int(f.get("pad", 0))
        frames.append((int(f["first"]), payload, bool(f.get("masked", False))))
    return up.send_frames(sid, frames, seal=bool(group.get("seal", False)))


def _control_action(up: FakeUpstream, path: str, query: dict[str, list[str]],
                    body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """POST endpoints; a missing or bad parameter is a KeyError / ValueError (HTTP 400)."""
    if path == "/drop":
        return 200, {"dropped": up.drop_all()}
    if path == "/stall":
        up.set_stall(_flag(query))
        return 200, {"stalled": up.stalled}
    if path == "/refuse":
        up.refuse(_flag(query))
        return 200, {"refusing": up.refusing}
    if path == "/hold_close":
        up.hold_close(_flag(query))
        return 200, {"holding_close": up.holding_close}
    if path == "/inject":
        kind = query["kind"][-1]
        if not is_inject_kind(kind):
            raise ValueError(f"kind must be one of {INJECT_KINDS}")
        return 200, {"sent": up.inject(query["id"][-1], kind)}
    if path == "/stop":
        return 200, {"closed": up.stop_stream(query["id"][-1])}
    if path == "/ensure":
        rate = float(query["rate"][-1]) if "rate" in query else None
        age_s = float(query.get("age_s", ["0"])[-1])
        return 200, {"created": sum(up.ensure(sid, rate=rate, age_s=age_s) for sid in query["id"])}
    if path == "/frames":
        return 200, _frames_action(up, body)
    return 404, {"error": "not found"}


def handle_control(up: FakeUpstream, method: str, target: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Route one control request (``target`` = path + query, ``body`` its content) to ``(status, json_body)``."""
    parts = urlsplit(target)
    query = parse_qs(parts.query)
    try:
        if method == "GET" and parts.path == "/stats":
            return 200, _full_stats(up)
        if method == "GET" and parts.path == "/produced":
            sid = query["id"][-1]
            return 200, {"id": sid, "produced": up.produced(sid)}
        if parts.path not in CONTROL_ACTIONS:
            return 404, {"error": "not found"}
        if method != "POST":
            return 405, {"error": f"use POST for {parts.path}"}
        return _control_action(up, parts.path, query, body)
    except (KeyError, ValueError, TypeError, binascii.Error) as exc:
        return 400, {"error": f"bad request: {exc}"}


async def _control_conn(up: FakeUpstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            content = await _read_body(reader, head)
        method, target = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
        status, body = handle_control(up, method, target, content)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
        status, body = 400, {"error": "malformed request"}
    data = orjson.dumps(body)
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % (status, b"OK" if status == 200 else b"Error", len(data))
        + data
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    # Read it all even when unused: closing with unread request bytes makes the kernel send RST, which
    # can destroy our response.
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            if int(value.strip()) > CONTROL_MAX_BODY:
                raise ValueError("request body too large")
            return await reader.readexactly(int(value.strip()))
    return b""


async def start_control_server(up: FakeUpstream, host: str, port: int) -> asyncio.Server:
    """Tiny HTTP/1.0-style control server (one request per connection)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _control_conn(up, reader, writer)

    return await asyncio.start_server(handler, host, port)


# -------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.upstream", description="Fake upstream WebSocket server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    p.add_argument("--rate", type=float, default=1.0, help="frames per second per stream")
    p.add_argument("--size", type=int, default=200, help="approximate frame size in bytes")
    p.add_argument("--keep", type=int, default=10_000, help="frames kept for replay per stream")
    p.add_argument("--tick-ms", type=int, default=20)
    p.add_argument("--oversize-bytes", type=int, default=1 << 20)
    p.add_argument("--first-seq", type=int, default=1, help="seq of every stream's first frame (0 or 1)")
    p.add_argument("--ping-s", type=float, default=0.0,
                   help="ping idle clients and drop those silent this long (0: never)")
    p.add_argument("--stats-file", type=Path, help="JSON stats written every second and on exit")
    p.add_argument("--control-port", type=int, help="HTTP control endpoint port (0 picks a free port)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def _write_stats(up: FakeUpstream, path: Path) -> None:
    # Write-then-rename so a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps(_full_stats(up)))
    os.replace(tmp, path)


async def _stats_loop(up: FakeUpstream, path: Path) -> None:
    while True:
        _write_stats(up, path)
        await asyncio.sleep(1.0)


def _raise_nofile_limit() -> None:
    # Thousands of sockets in one process: lift the soft fd limit to the hard one.
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT."""
    up = FakeUpstream(args.host, args.port, args.rate, args.size, args.keep, args.tick_ms, first_seq=args.first_seq,
                      ping_s=args.ping_s)
    up.oversize_bytes = args.oversize_bytes
    await up.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    control = None
    if args.control_port is not None:
        control = await start_control_server(up, args.host, args.control_port)
        print(f"control http://{args.host}:{control.sockets[0].getsockname()[1]}", flush=True)
    stats_task = loop.create_task(_stats_loop(up, args.stats_file)) if args.stats_file else None
    # Printed last: once this line is out, everything (including the control port) is ready.
    print(f"listening ws://{args.host}:{up.port}", flush=True)
    await stop.wait()
    if stats_task is not None:
        stats_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stats_task
    if control is not None:
        control.close()
    await up.stop()
    if args.stats_file:
        _write_stats(up, args.stats_file)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main()`` on uvloop when it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    _raise_nofile_limit()
    run(lambda: serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
