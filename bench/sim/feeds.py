"""Simulated upstreams: one feed per connection id, and the picows-like sockets fleetd reads them through.

Model
-----
* A :class:`Feed` produces seq ``k`` (from a seeded first seq, 0 or 1) at
  ``t0 + (k - first + 1) / rate``, whether or not anyone is connected, and keeps
  everything: a connect with ``from_seq=N`` (the query parameter named by
  ``cfg.upstream.resume_param``) replays from ``N``, then streams live; no parameter
  means from the first seq.
* :func:`Upstreams.connector` is the ``connect`` seam of ``fleetd.shard.Environment``:
  it returns ``(transport, listener)`` with fleetd's own ``_Listener`` fed through
  ``on_ws_frame`` / ``on_ws_disconnected``.  Frames are delivered on the process's
  loop in small bursts (all seqs produced since the last burst), so a paused process
  gets its backlog in one read when it resumes, as from a socket buffer.
* picows's auto-ping is emulated on the process's loop: after ``ping_idle_s`` without
  incoming data the listener's ``send_user_specific_ping`` runs; no pong within
  ``ping_reply_s`` (a stalled upstream) disconnects the socket.
* Upstream faults: refused connects for a window, a CLOSE 1001 from the upstream
  (fleetd echoes and hangs up), a stall (no frames, no pongs, socket left open).
* Every socket is reported to the invariant checker when it opens (the moment the
  client's connect returns) and closes (the client hangs up, or its process dies).

Not modelled: TCP-level resets without a CLOSE, fragmentation, binary frames,
oversized frames, handshake timeouts, DNS, TLS.
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from picows import WSCloseCode, WSMsgType

_BURST_S = 0.2  # frames produced within this are delivered in one read
_RTT_S = 0.002


class SocketSink(Protocol):
    """Where sockets are reported (the invariant checker)."""

    def opened(self, proc: str, cid: str) -> Any: ...

    def closed(self, rec: Any) -> None: ...


class ProcLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def sockets(self) -> dict[Any, None]: ...


@dataclass(slots=True)
class Feed:
    """One upstream's production (see the module docstring)."""

    cid: str
    first: int
    rate: float  # seqs per second
    t0: float
    refuse_until: float = 0.0
    sockets: list[SimTransport] = field(default_factory=list)

    def last_by(self, t: float) -> int:
        """The last seq produced by time ``t`` (``first - 1`` if none yet)."""
        return self.first - 1 + max(0, math.floor((t - self.t0) * self.rate + 1e-9))

    def time_of(self, seq: int) -> float:
        return self.t0 + (seq - self.first + 1) / self.rate


class _Frame:
    """The parts of a picows ``WSFrame`` fleetd's listener reads."""

    __slots__ = ("close_code", "fin", "msg_type", "payload")

    def __init__(self, msg_type: WSMsgType, payload: bytes = b"", close_code: int = 1000) -> None:
        self.msg_type = msg_type
        self.fin = True
        self.payload = payload
        self.close_code = close_code

    @property
    def payload_size(self) -> int:
        return len(self.payload)

    def get_payload_as_memoryview(self) -> memoryview:
        return memoryview(self.payload)

    def get_close_code(self) -> WSCloseCode:
        return WSCloseCode(self.close_code)


class _Sent:
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = WSCloseCode(code)


class _Handshake:
    __slots__ = ("recv", "sent")

    def __init__(self) -> None:
        self.sent: _Sent | None = None
        self.recv: _Sent | None = None


class SimTransport:
    """One open upstream socket, as fleetd's ``upstream.py`` uses a picows ``WSTransport``."""

    def __init__(self, proc: ProcLike, feed: Feed, sink: SocketSink, next_seq: int, idle_s: float,
                 reply_s: float) -> None:
        self.proc = proc
        self.loop = proc.loop
        self.feed = feed
        self.sink = sink
        self.next_seq = next_seq
        self.idle_s = idle_s
        self.reply_s = reply_s
        self.listener: Any = None
        self.rec: Any = None
        self.is_disconnected = False
        self.is_close_frame_sent = False
        self.close_handshake: _Handshake | None = None
        self.stalled = False
        self.reading = True
        self.last_rx = self.loop.time()
        self.ping_out = False
        self._waiters: list[asyncio.Future[None]] = []
        self._pump_timer: asyncio.TimerHandle | None = None

    @property
    def underlying_transport(self) -> SimTransport:
        return self

    # ----- what fleetd calls ---------------------------------------------------------------------

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            self._arm_pump(self.loop.time())

    def disconnect(self, graceful: bool = True) -> None:
        if self.is_disconnected:
            return
        self.is_disconnected = True
        self.sink.closed(self.rec)
        self.proc.sockets.pop(self, None)
        if self in self.feed.sockets:
            self.feed.sockets.remove(self)
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()
        listener = self.listener
        self.loop.call_soon(listener.on_ws_disconnected, self)

    def send_close(self, code: Any = 1000) -> None:
        if self.is_disconnected or self.is_close_frame_sent:
            return
        self.is_close_frame_sent = True
        hs = self.close_handshake or _Handshake()
        hs.sent = _Sent(int(getattr(code, "value", code)))
        self.close_handshake = hs
        if not self.stalled:  # the upstream echoes the CLOSE
            self.loop.call_at(self.loop.time() + _RTT_S, self._deliver_close, int(hs.sent.code.value))

    async def wait_disconnected(self) -> None:
        if self.is_disconnected:
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(fut)
        await fut

    def send_ping(self) -> None:
        if not self.stalled and not self.is_disconnected:
            self.loop.call_at(self.loop.time() + _RTT_S, self.notify_user_specific_pong_received)

    def notify_user_specific_pong_received(self) -> None:
        self.ping_out = False
        self.last_rx = self.loop.time()

    # ----- the upstream's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._arm_pump(self.loop.time())
        self.loop.call_at(self.last_rx + self.idle_s, self._idle_check)

    def _arm_pump(self, at: float) -> None:
        timer = self._pump_timer
        if timer is not None:
            if timer.when() <= at:
                return
            timer.cancel()
        self._pump_timer = self.loop.call_at(at, self._pump)

    def _pump(self) -> None:
        self._pump_timer = None
        if self.is_disconnected or self.stalled or not self.reading or self.is_close_frame_sent:
            return
        now = self.loop.time()
        last = self.feed.last_by(now)
        listener = self.listener
        delivered = False
        while self.next_seq <= last and not self.is_disconnected and self.reading:
            seq = self.next_seq
            self.next_seq += 1
            delivered = True
            listener.on_ws_frame(self, _Frame(WSMsgType.TEXT, b'{"seq":%d}' % seq))
        if delivered:
            self.last_rx = now
        if not self.is_disconnected and self.reading:
            self._arm_pump(max(self.feed.time_of(self.next_seq), now + _BURST_S))

    def _idle_check(self) -> None:
        if self.is_disconnected:
            return
        now = self.loop.time()
        if self.ping_out:
            return
        if now - self.last_rx < self.idle_s - 1e-9:
            self.loop.call_at(self.last_rx + self.idle_s, self._idle_check)
            return
        self.ping_out = True
        self.listener.send_user_specific_ping(self)
        self.loop.call_at(now + self.reply_s, self._ping_timeout)

    def _ping_timeout(self) -> None:
        if self.is_disconnected:
            return
        if self.ping_out:
            self.disconnect(graceful=False)  # picows: no pong within auto_ping_reply_timeout
            return
        self.loop.call_at(self.last_rx + self.idle_s, self._idle_check)

    def _deliver_close(self, code: int) -> None:
        if not self.is_disconnected:
            self.listener.on_ws_frame(self, _Frame(WSMsgType.CLOSE, close_code=code))

    def upstream_close(self, code: int = 1001) -> None:
        """The upstream says goodbye: a CLOSE frame (fleetd echoes it and hangs up)."""
        if not self.is_disconnected:
            self.loop.call_at(self.loop.time() + _RTT_S, self._deliver_close, code)

    def crash(self) -> None:
        """The client process died: the socket is gone at once, no callbacks run."""
        if not self.is_disconnected:
            self.is_disconnected = True
            self.sink.closed(self.rec)
            if self in self.feed.sockets:
                self.feed.sockets.remove(self)


Connector = Callable[..., Any]


class Upstreams:
    """All feeds, their sockets, and the upstream faults."""

    def __init__(self, sink: SocketSink, resume_param: str, latency: Callable[[], float]) -> None:
        self.sink = sink
        self.resume_param = resume_param
        self.latency = latency
        self.feeds: dict[str, Feed] = {}
        self.connects = 0
        self.trace: Callable[[str], None] | None = None

    def add(self, feed: Feed) -> None:
        self.feeds[feed.cid] = feed

    def url(self, cid: str) -> str:
        return f"wss://up.sim/{cid}"

    def connector(self, proc: ProcLike) -> Connector:
        async def connect(listener_factory: Callable[[], Any], url: str, **kw: Any) -> tuple[SimTransport, Any]:
            return await self._connect(proc, listener_factory, url, kw)
        return connect

    async def _connect(self, proc: ProcLike, listener_factory: Callable[[], Any], url: str,
                       kw: dict[str, Any]) -> tuple[SimTransport, Any]:
        loop = proc.loop
        parts = urllib.parse.urlsplit(url)
        cid = parts.path.lstrip("/")
        query = dict(urllib.parse.parse_qsl(parts.query))
        fut: asyncio.Future[None] = loop.create_future()
        loop.call_at(loop.time() + self.latency(), _set_none, fut)
        await fut
        feed = self.feeds.get(cid)
        self.connects += 1
        if feed is None or loop.time() < feed.refuse_until:
            if self.trace:
                self.trace(f"socket refused {proc.name} {cid}")
            raise ConnectionRefusedError(f"simulated: {cid} refused the connection")
        start = int(query[self.resume_param]) if self.resume_param in query else feed.first
        tr = SimTransport(proc, feed, self.sink, start, float(kw.get("auto_ping_idle_timeout", 10.0)),
                          float(kw.get("auto_ping_reply_timeout", 5.0)))
        tr.listener = listener_factory()
        tr.rec = self.sink.opened(proc.name, cid)
        proc.sockets[tr] = None
        feed.sockets.append(tr)
        if self.trace:
            self.trace(f"socket open {proc.name} {cid} from_seq={query.get(self.resume_param, '-')}")
        # picows's own ``on_ws_connected`` is typed for its WSTransport; fleetd does not override it.
        tr.start()
        return tr, tr.listener

    def close(self, cid: str) -> None:
        for tr in list(self.feeds[cid].sockets):
            tr.upstream_close()

    def stall(self, cid: str) -> None:
        for tr in list(self.feeds[cid].sockets):
            tr.stalled = True

    def refuse(self, cid: str, until: float) -> None:
        self.feeds[cid].refuse_until = max(self.feeds[cid].refuse_until, until)


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
