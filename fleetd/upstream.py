"""One owned upstream stream: a picows client that reconnects and resumes (SPEC §5).

A :class:`Connection` lives exactly as long as its lease is held.  Its task
connects, streams, and on any drop reconnects with jittered exponential backoff,
asking the upstream to resume at ``last received + 1``.  Frames are parsed inside
the picows callback (their memory is only valid there), sequenced, de-duplicated
and handed to the sink.  Bad frames are counted and logged, never fatal.

Three ways out, chosen by the shard: :meth:`Connection.fence` (lease lost: drop
the socket at once, write nothing more), :meth:`Connection.close` (stop or
shutdown: polite CLOSE, bounded wait) and task cancellation.  A fourth, chosen by
the stream itself: parking (below).

Sequencing
----------
``last_received`` is the highest seq handed to the sink; ``None`` until the first
frame of an item that never wrote anything.  Then no ``from_seq`` is sent and the
first frame's seq is taken as it comes (numbering may start at 0, 1 or anywhere).

* A frame with an integer seq in ``(last, last + max_seq_jump]`` is accepted; above
  ``last + 1`` it is also counted as a gap (``seq_gaps_total``) and logged.
* A seq ``<= last`` within ``max_seq_jump`` below it is a duplicate (a replay
  overlap): dropped and counted (``upstream_duplicates_total``).
* A frame without a seq in a stream that never carried one gets ``previous + 1``;
  the first such frame of a fresh stream gets 1 (no previous counts as 0), so an
  unsequenced stream is numbered 1, 2, 3 … as it always was.  In a sequenced stream
  a frame without a seq is rejected (``noseq``).

Sequence anomalies (``max_seq_jump``, default 10,000; 0 turns the policy off):

* a **jump**: seq above ``last + max_seq_jump``;
* a **reset**: seq below ``last - max_seq_jump``, or, on a connection that resumed
  with ``from_seq``, a first new frame at 0 or 1 while ``last >= 2`` (the upstream
  started its numbering over instead of resuming).

An anomaly is never written at once.  The frame is held back (not submitted),
counted as ``upstream_seq_anomalies_total{kind="jump"|"reset"}`` and logged, the
socket is closed (1001) and the stream resumes from ``last + 1`` as after any
drop; the rest of that socket's frames are ignored (the resume brings them
again).  The fresh resume decides, by its first frame that is not a duplicate:

* a normal frame: the anomaly was a one-off, forgotten; nothing was lost;
* the same kind of anomaly again: the upstream means it.  A confirmed **jump** is
  accepted as a gap (``kind="jump_accepted"`` plus ``seq_gaps_total``): the
  upstream really skipped those seqs.  A confirmed **reset** parks the stream
  (``kind="reset_parked"``, an error log): the socket is closed and not reopened,
  nothing more is written, the lease stays held and ``last_seq`` stays at the last
  message of the old numbering.  A new numbering cannot share the old one's keys:
  the messages table is keyed (connection, seq) and the sink's cursor only moves
  forward, so accepting it would overwrite old messages or drop new ones.  The
  operator decides: stop the connection and start the new numbering under a new
  connection id (or fix the upstream and start the item again).

So a jump or a reset is only acted on after the upstream repeated it on a fresh
resume, and nothing is ever dropped without a count and a log line.

Where a socket may go (SSRF guard)
----------------------------------
The URL comes from the connections table, which anyone with write access to it controls.
picows is told to follow no redirect (``max_redirects=0``): an allow-listed host answering
3xx is a failed connect, counted as ``upstream_connect_refused_total{reason="redirect"}``.
And picows does not resolve the host itself: :func:`open_checked_socket` (its
``socket_factory``) resolves it, checks every address with
:func:`fleetd.validation.address_refusal` (loopback, private, link-local, multicast,
unspecified and other non-global addresses are refused unless in ``allowed_networks`` or
the host is in ``allowed_hosts``) and connects to a checked address itself.  picows then
speaks TLS and HTTP over that socket with the original name (SNI, certificate check and
``Host`` header), so no second lookup can rebind the name to another address between check
and connect.  Refused addresses are counted by reason (``loopback``, ``link_local`` …);
URLs in log lines are redacted (:func:`fleetd.validation.redact_url`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from picows import (
    WSCloseCode,
    WSFrame,
    WSHandshakeError,
    WSListener,
    WSMsgType,
    WSParsedURL,
    WSProtocolError,
    WSTransport,
    ws_connect,
)

from fleetd.aio import Backoff
from fleetd.clock import Clock
from fleetd.config import UpstreamConfig
from fleetd.logs import RateLimiter
from fleetd.sink import Cursor, Sink
from fleetd.stats import Stats
from fleetd.tracing import NO_TENURE, Tenure
from fleetd.validation import address_refusal, host_exempt, redact_url

log = logging.getLogger("fleetd.upstream")
_limiter = RateLimiter(10.0)
_STABLE_S = 10.0  # a connection up this long resets the reconnect backoff
# Largest seq accepted: 2^53 - 1, the largest integer JSON carries exactly between implementations
# (RFC 7493 §2.2).  Beyond it a seq is a bad frame, never a jump.
MAX_SEQ = 2**53 - 1
# How a connection opens a socket: picows's ``ws_connect`` (the deterministic simulation passes its own).
Connector = Callable[..., Awaitable[tuple[WSTransport, Any]]]


def resume_url(url: str, param: str, from_seq: int) -> str:
    """``url`` with ``param=from_seq`` set in its query (replacing an existing one)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if k != param]
    query.append((param, str(from_seq)))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class UpstreamRefused(ConnectionError):
    """A connect refused by policy before a byte went out: the host resolves only to addresses not allowed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # a value of fleetd.validation.REFUSAL_REASONS


async def open_checked_socket(parsed: WSParsedURL, cfg: UpstreamConfig) -> socket.socket:
    """A TCP socket connected to an allowed address of ``parsed``'s host (picows's ``socket_factory``).

    The host is resolved here, every address checked (unless the host is in ``allowed_hosts``) and
    the socket connected to a checked one, trying the next on a connect error as
    ``loop.create_connection`` does.  Raises :class:`UpstreamRefused` if no address is allowed.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(parsed.host, parsed.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    exempt = host_exempt(parsed.host, cfg.allowed_hosts)
    refused: tuple[str, str] | None = None
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        reason = None if exempt else address_refusal(str(address[0]), cfg.allowed_networks)
        if reason is not None:
            refused = refused or (reason, str(address[0]))
            continue
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    if error is not None:
        raise error
    if refused is None:
        raise OSError(f"no address for {parsed.host}")
    reason, where = refused
    what = where if where == parsed.host else f"{parsed.host} resolves to {where}, which"
    raise UpstreamRefused(reason, f"{what} is a {reason.replace('_', '-')} address, not in allowed_networks "
                                  "(and the host is not in allowed_hosts)")


def _refusal(e: BaseException) -> str | None:
    """The ``upstream_connect_refused_total`` reason of a failed connect, or None for another failure."""
    if isinstance(e, UpstreamRefused):
        return e.reason
    if isinstance(e, WSHandshakeError) and e.response is not None and int(e.response.status) in _REDIRECT_STATUSES:
        return "redirect"
    return None


def _valid_close_code(code: int) -> bool:
    """A status code an endpoint may send (RFC 6455 §7.4.1, IANA registry: 1012–1014 added later)."""
    return 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999


class _Listener(WSListener):
    """picows callbacks for one socket; forwards to its :class:`Connection`.

    Reassembles fragmented text messages itself, bounded by ``max_frame_bytes``.
    Fragmentation errors picows lets through (RFC 6455 §5.4: a new data message
    before the last one's final fragment, a continuation with no message to
    continue) are counted as ``protocol`` rejects and tolerated: the unfinished
    message is dropped, the frames around it are kept.  Errors picows catches
    itself (reserved opcodes, masked or oversized control frames, some bad CLOSE
    codes) make it close with 1002, counted here on disconnect; the bad CLOSE codes
    it passes on are counted and answered with 1002 here.

    No ``__slots__``: picows keeps a weak reference to the listener for its
    pause/resume_writing hooks.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fragments: bytearray | None = None  # a text message being reassembled
        self.skipping = False  # inside a fragmented binary message (rejected once, continuations ignored)
        self.closed_oversized = False  # we closed with 1009 ourselves (and counted it)
        self.closed_protocol = False  # we answered an invalid CLOSE code with 1002 (and counted it)

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.conn.on_connected(transport)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        mt = frame.msg_type
        if mt is WSMsgType.TEXT and frame.fin and self.fragments is None and not self.skipping:
            payload = frame.get_payload_as_memoryview()
            if len(payload) <= self.conn.max_frame_bytes:
                self.conn.on_text(payload)
            elif not self.closed_oversized:
                self._too_big(transport)
        elif mt is WSMsgType.TEXT or mt is WSMsgType.CONTINUATION or mt is WSMsgType.BINARY:
            if not self.closed_oversized:  # frames still buffered after our own 1009 close are moot
                self._data_frame(transport, frame)
        elif mt is WSMsgType.CLOSE:
            self._on_close(transport, frame)

    def _on_close(self, transport: WSTransport, frame: WSFrame) -> None:
        """picows does not answer a CLOSE itself (NOTES.md): echo it, then hang up.

        Echoing "no status" literally would be a protocol error: answer 1000 then.  A code
        RFC 6455 §7.4 forbids on the wire (1006, 1015, ≥ 5000 …) passes picows's own checks:
        count it as a protocol error and answer 1002 rather than echo an invalid code.
        """
        code = frame.get_close_code()
        reply = code
        if code == WSCloseCode.NO_INFO:
            reply = WSCloseCode.OK
        elif not _valid_close_code(int(code.value)):
            self.closed_protocol = True
            self.conn.reject("protocol")
            reply = WSCloseCode.PROTOCOL_ERROR
        if not transport.is_close_frame_sent:
            transport.send_close(reply)
        transport.disconnect()

    def _data_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        """Every data frame off the fast path: fragments, binary, fragmentation errors."""
        mt = frame.msg_type
        if frame.payload_size > self.conn.max_frame_bytes:
            # picows refuses such a frame at its header (1009), but its parser goes on reading, so a frame
            # that arrives in several reads is still delivered: enforce the limit here, count it once.
            self._too_big(transport)
            return
        if mt is not WSMsgType.CONTINUATION:  # a new message
            if self.fragments is not None or self.skipping:
                self.conn.reject("protocol")  # the previous message never got its final fragment
            self.fragments, self.skipping = None, False
            if mt is WSMsgType.BINARY:
                self.conn.reject("binary")
                self.skipping = not frame.fin
                return
            if frame.fin:
                self.conn.on_text(frame.get_payload_as_memoryview())
                return
            self.fragments = bytearray()
        elif self.skipping:
            self.skipping = not frame.fin
            return
        elif self.fragments is None:
            self.conn.reject("protocol")  # a continuation of no message
            return
        self._fragment(transport, frame)

    def _fragment(self, transport: WSTransport, frame: WSFrame) -> None:
        assert self.fragments is not None
        self.fragments += frame.get_payload_as_memoryview()
        if len(self.fragments) > self.conn.max_frame_bytes:
            self._too_big(transport)  # a never-ending fragmented message must not grow memory without bound
        elif frame.fin:
            payload, self.fragments = self.fragments, None
            self.conn.on_text(memoryview(payload))

    def _too_big(self, transport: WSTransport) -> None:
        """A message above ``max_frame_bytes``: count it once, close with 1009 (the stream resumes)."""
        self.fragments, self.skipping = None, False
        self.closed_oversized = True
        self.conn.reject("oversized")
        if not transport.is_close_frame_sent:
            transport.send_close(WSCloseCode.MESSAGE_TOO_BIG)
        transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        handshake = transport.close_handshake
        sent = handshake.sent if handshake is not None else None
        code = getattr(sent.code, "value", sent.code) if sent is not None else None  # picows may give a bare int
        if code == WSCloseCode.MESSAGE_TOO_BIG.value and not self.closed_oversized:
            # picows refused a frame above max_frame_size and closed with 1009 itself.
            self.conn.reject("oversized")
        elif code == WSCloseCode.PROTOCOL_ERROR.value and not self.closed_protocol:
            # picows refused a malformed frame (reserved opcode, masked, bad control frame) with 1002.
            self.conn.reject("protocol")
        self.conn.on_disconnected()

    def send_user_specific_ping(self, transport: WSTransport) -> None:
        if self.conn.paused:
            # We stopped reading (sink backpressure), so a pong could not reach us and the
            # auto-ping would drop a healthy stream.  Skip the ping and count it answered once
            # the ping loop has armed its wait (it does so right after this call returns).
            asyncio.get_running_loop().call_soon(transport.notify_user_specific_pong_received)
            return
        transport.send_ping()

    def pause_writing(self) -> None:  # defined so picows does not warn; we barely write
        pass

    def resume_writing(self) -> None:
        pass


class Connection:
    """A leased upstream stream (see module docstring for the protocol)."""

    __slots__ = (
        "_connected_once",
        "_fresh",
        "_hung_up",
        "_resumed",
        "_suspect",
        "_task",
        "_transport",
        "cfg",
        "clock",
        "closing",
        "connect",
        "connected",
        "connection_id",
        "cursor",
        "last_received",
        "max_frame_bytes",
        "max_seq_jump",
        "parked",
        "paused",
        "seq_field",
        "sequenced",
        "sink",
        "stats",
        "tenure",
        "url",
    )

    def __init__(self, connection_id: str, url: str, cursor: Cursor, last_seq: int | None, sink: Sink,
                 cfg: UpstreamConfig, stats: Stats, clock: Clock, connect: Connector = ws_connect,
                 tenure: Tenure = NO_TENURE) -> None:
        self.connection_id = connection_id
        self.connect = connect
        self.url = url
        self.cursor = cursor
        # None: the item never recorded a seq, so we cannot ask for a resume point.
        self.last_received = last_seq
        self.sequenced = False  # set by the first frame carrying a seq
        self.sink = sink
        self.cfg = cfg
        self.stats = stats
        self.clock = clock
        self.tenure = tenure  # the lease tenure's trace span (fleetd.tracing): reconnects, gaps, anomalies
        self.seq_field = cfg.seq_field
        self.max_frame_bytes = cfg.max_frame_bytes
        self.max_seq_jump = cfg.max_seq_jump
        self.closing = False
        self.connected = False
        self.paused = False
        self.parked = False  # a confirmed numbering reset: no reconnect, nothing more written
        self._suspect: str | None = None  # anomaly ("jump" / "reset") that a fresh resume must confirm
        self._fresh = True  # no new frame on this socket yet (duplicates do not count)
        self._resumed = False  # this socket asked for from_seq
        self._hung_up = False  # we closed this socket over an anomaly: ignore what it still delivers
        self._connected_once = False  # a socket of this tenure completed its handshake
        self._transport: WSTransport | None = None
        self._task: asyncio.Task[None] | None = None

    # ----- lifecycle (called by the shard) ----------------------------------------------------------

    def start(self) -> None:
        # A context of its own: the task outlives whatever started it (a reconcile round, whose trace
        # span it would otherwise keep alive as long as the stream is held).
        self._task = asyncio.get_running_loop().create_task(self._run_loop(), name=f"conn:{self.connection_id}",
                                                            context=contextvars.Context())

    def fence(self) -> None:
        """Lease lost or about to expire: stop writing and drop the socket now, no handshake."""
        self.closing = True
        self.sink.deactivate(self.cursor)
        if self._transport is not None:
            self._transport.disconnect(graceful=False)
        if self._task is not None:
            self._task.cancel()

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop politely: CLOSE 1000, wait for the upstream's echo (bounded), end the task."""
        self.closing = True
        tr = self._transport
        if tr is not None and not tr.is_disconnected:
            tr.send_close(WSCloseCode.OK)
            try:
                await asyncio.wait_for(tr.wait_disconnected(), timeout_s)
            except TimeoutError:
                tr.disconnect(graceful=False)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def pause_reading(self) -> None:
        self.paused = True
        if self._transport is not None:
            self._transport.underlying_transport.pause_reading()

    def resume_reading(self) -> None:
        self.paused = False
        if self._transport is not None:
            self._transport.underlying_transport.resume_reading()

    # ----- the reconnect loop ----------------------------------------------------------------------

    async def _run_loop(self) -> None:
        backoff = Backoff(self.cfg.backoff_min_s, self.cfg.backoff_max_s, jitter=0.5)
        while not self.closing and not self.parked:
            started = self.clock.monotonic()
            cause = "disconnected"
            try:
                await self._stream_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                cause = type(e).__name__
                self._log_failure(e)
            if self.closing or self.parked:
                return
            if self.clock.monotonic() - started > _STABLE_S:
                backoff.reset()
            self.stats.inc("upstream_reconnects_total")
            delay = backoff.next()
            self.tenure.event("upstream_reconnect", cause=cause, delay_s=round(delay, 3))
            await asyncio.sleep(delay)

    async def _stream_once(self) -> None:
        url = self._connect_url()
        self._resumed = url != self.url
        self._fresh, self._hung_up = True, False
        transport, _ = await self.connect(
            lambda: _Listener(self),
            url,
            websocket_handshake_timeout=self.cfg.handshake_timeout_s,
            enable_auto_ping=True,
            auto_ping_idle_timeout=self.cfg.ping_idle_s,
            auto_ping_reply_timeout=self.cfg.ping_reply_s,
            max_frame_size=self.cfg.max_frame_bytes,
            read_buffer_init_size=self.cfg.read_buffer_bytes,
            logger_name="upstream",
            max_redirects=0,  # an allow-listed host must not send us elsewhere (module docstring)
            socket_factory=self._open_socket,
        )
        if self.closing:  # fenced or closed while the handshake was in flight
            self._transport = None
            transport.disconnect(graceful=False)
            return
        self._transport = transport
        self.connected = True
        self._connected_once = True
        if self.paused:
            transport.underlying_transport.pause_reading()
        try:
            await transport.wait_disconnected()
        except WSProtocolError:
            pass  # picows refused a frame and closed (1009 / 1002): counted by the listener, not a connect error
        finally:
            self._transport = None
            self.connected = False

    def _connect_url(self) -> str:
        """The first connect of a stream with no resume point asks for no ``from_seq`` (SPEC §5); once a
        socket was up, seqs may have been produced that it never delivered, so a reconnect with still
        nothing received asks for everything the upstream has (``from_seq=0``)."""
        if not self.cfg.resume:
            return self.url
        if self.last_received is not None:
            return resume_url(self.url, self.cfg.resume_param, self.last_received + 1)
        return resume_url(self.url, self.cfg.resume_param, 0) if self._connected_once else self.url

    def _open_socket(self, parsed: WSParsedURL) -> Awaitable[socket.socket]:
        return open_checked_socket(parsed, self.cfg)

    def _log_failure(self, e: Exception) -> None:
        self.stats.inc("upstream_connect_errors_total", kind=type(e).__name__)
        reason = _refusal(e)
        if reason is not None:
            self.stats.inc("upstream_connect_refused_total", reason=reason)
        if not _limiter.allow(self.connection_id):
            return
        extra: dict[str, Any] = {"connection_id": self.connection_id, "url": redact_url(self.url),
                                 "error": f"{type(e).__name__}: {e}"}
        if reason is None:
            log.warning("upstream connect failed", extra=extra)
            return
        if reason == "redirect":
            assert isinstance(e, WSHandshakeError) and e.response is not None
            extra["location"] = redact_url(e.response.headers.get("Location", ""))
        log.warning("upstream connect refused", extra={**extra, "reason": reason})

    # ----- frames (picows callbacks, hot path) ----------------------------------------------------

    def on_connected(self, transport: WSTransport) -> None:
        """The handshake is done: frames may follow before ``connect`` returns to ``_stream_once``."""
        self._transport = transport

    def on_text(self, payload: memoryview) -> None:
        if self.closing or self._hung_up:
            return
        if len(payload) > self.max_frame_bytes:
            self.reject("oversized")
            return
        try:
            obj: Any = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.reject("malformed")
            return
        seq = obj.get(self.seq_field) if type(obj) is dict else None
        if type(seq) is int:
            if not 0 <= seq <= MAX_SEQ:
                # Accepting it would poison the stream: a negative seq is not a position, and a huge one
                # would make every real frame after it a "duplicate" and every resume start past the end.
                self.reject("bad_seq")
                return
            if not self._accept(seq):
                return
        elif self.sequenced:
            # In a sequenced stream, numbering a stray frame previous + 1 would make the real
            # next frame look like a duplicate and lose it: reject the stray instead.
            self.reject("noseq")
            return
        else:
            # SPEC §5: an unsequenced stream counts for itself, from 1 (module docstring).
            seq = 1 if self.last_received is None else self.last_received + 1
        self.last_received = seq
        self.sink.submit(self.cursor, seq, bytes(payload), self.clock.now_ms())
        self.stats.messages += 1

    def _accept(self, seq: int) -> bool:
        """Dedupe, gap accounting and the anomaly policy for a frame carrying ``seq``."""
        self.sequenced = True
        last = self.last_received
        if last is None:
            self._fresh = False
            return True
        kind = self._anomaly(last, seq)
        if kind is not None:
            return self._anomalous(kind, last, seq)
        if seq <= last:
            self.stats.inc("upstream_duplicates_total")
            return False
        self._fresh, self._suspect = False, None
        if seq > last + 1 and not (last == -1 and seq == 1):  # from_seq=0 to an upstream numbering from 1
            self._gap(last, seq)
        return True

    def _anomaly(self, last: int, seq: int) -> str | None:
        """``"jump"``, ``"reset"`` or None (plausible) for ``seq`` after ``last``."""
        limit = self.max_seq_jump
        if limit == 0:
            return None
        if seq > last + limit:
            return "jump"
        if seq < last - limit or (self._fresh and self._resumed and seq <= 1 < last):
            return "reset"
        return None

    def _anomalous(self, kind: str, last: int, seq: int) -> bool:
        """Hold the frame back and resume, unless this fresh resume repeats the anomaly."""
        if not (self._fresh and self._suspect == kind):
            self._suspect = kind
            self.stats.inc("upstream_seq_anomalies_total", kind=kind)
            self.tenure.event("seq_anomaly", kind=kind, after=last, got=seq)
            if _limiter.allow("anomaly:" + self.connection_id):
                log.warning("sequence anomaly: frame held back, resuming to confirm",
                            extra={"connection_id": self.connection_id, "kind": kind, "after": last, "got": seq})
            self._hang_up()
            return False
        self._fresh, self._suspect = False, None
        if kind == "jump":
            self.stats.inc("upstream_seq_anomalies_total", kind="jump_accepted")
            self._gap(last, seq)
            return True
        self.stats.inc("upstream_seq_anomalies_total", kind="reset_parked")
        self.tenure.event("parked", after=last, got=seq)
        log.error("upstream numbering restarted on a fresh resume: stream parked; stop it and start the new "
                  "numbering under a new connection id",
                  extra={"connection_id": self.connection_id, "after": last, "got": seq})
        self.parked = True
        self._hang_up()
        return False

    def _hang_up(self) -> None:
        """Close this socket (1001) and ignore what it still delivers; the run loop decides what follows."""
        self._hung_up = True
        tr = self._transport
        if tr is not None and not tr.is_disconnected:
            if not tr.is_close_frame_sent:
                tr.send_close(WSCloseCode.GOING_AWAY)
            tr.disconnect()

    def _gap(self, last: int, seq: int) -> None:
        self.stats.inc("seq_gaps_total")
        self.tenure.event("seq_gap", after=last, got=seq)
        if _limiter.allow("gap:" + self.connection_id):
            log.warning("sequence gap", extra={"connection_id": self.connection_id, "after": last, "got": seq})

    def reject(self, reason: str) -> None:
        self.stats.inc("upstream_frames_rejected_total", reason=reason)
        if _limiter.allow(f"reject:{reason}:{self.connection_id}"):
            log.warning("upstream frame rejected", extra={"connection_id": self.connection_id, "reason": reason})

    def on_disconnected(self) -> None:
        self.connected = False
