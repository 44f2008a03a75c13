"""One held connection of the seed design: three tasks sharing a lease item.

* ``_heartbeat_loop`` renews the item every ``heartbeat_s`` (carrying the ``last_seq``
  checkpoint) and self-fences when no renewal succeeded by ``expires - safety_margin``;
* ``_receive_loop`` holds the upstream socket, reconnecting with resume, and writes each
  frame with its own awaited PutItem;
* ``_desired_loop`` reads ``desired_state`` every ``desired_state_s`` and stops the
  connection when it is no longer STARTED.

Whichever task ends the connection calls :meth:`Held.close`: the socket is closed, the
receive loop finishes the write it is in, the sibling tasks are cancelled and the worker
forgets the connection.  Releasing the lease is up to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from bench.baseline.options import Options
from bench.baseline.store import STARTED, Claimed, Outcome, Store

log = logging.getLogger("bench.baseline")
CLOSE_WAIT_S = 5.0  # bound on our side of a close handshake


@dataclass(slots=True)
class Counters:
    """Totals of one worker process (what the stats file reports)."""

    streaming: int = 0
    messages: int = 0
    rejected: int = 0
    duplicates: int = 0
    gaps: int = 0
    write_errors: int = 0
    reconnects: int = 0
    claims: int = 0
    claims_failed: int = 0
    lost: int = 0
    fenced: int = 0
    stopped: int = 0
    released: int = 0


def resume_url(url: str, last_seq: int) -> str:
    """``url`` with ``from_seq=<last_seq + 1>`` in its query (unchanged when no checkpoint is known)."""
    if last_seq < 0:
        return url
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "from_seq"]
    query.append(("from_seq", str(last_seq + 1)))
    return urlunsplit(parts._replace(query=urlencode(query)))


class Held:
    """A connection this worker holds the lease of; see the module docstring for the protocol."""

    def __init__(self, claimed: Claimed, store: Store, opts: Options, counters: Counters,
                 fence_at: float, on_end: Callable[[Held], None]) -> None:
        self.cid = claimed.connection_id
        self.url = claimed.ws_url
        self.epoch = claimed.epoch
        self.last_seq = claimed.last_seq  # highest seq durably written (-1: none known)
        self.store = store
        self.opts = opts
        self.counters = counters
        self.fence_at = fence_at  # loop time after which we may no longer stream (expiry - margin)
        self.on_end = on_end
        self.ws: ClientConnection | None = None
        self.reason = ""  # why it ended; '' while held
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._heartbeat_loop()), loop.create_task(self._receive_loop()),
                      loop.create_task(self._desired_loop())]

    def _fenced(self) -> bool:
        return asyncio.get_running_loop().time() >= self.fence_at

    # ----- ending --------------------------------------------------------------------------------------------

    async def close(self, reason: str, grace_s: float = CLOSE_WAIT_S) -> bool:
        """Close the socket and end the three tasks; True for the call that ended it (it may release).

        ``grace_s`` bounds the close handshake; after it the socket is aborted.
        """
        if self.reason:
            await self.done.wait()
            return False
        self.reason = reason
        me = asyncio.current_task()
        receiver = self.tasks[1]
        try:
            if self.ws is not None:
                await self._close_socket(self.ws, grace_s)
            elif receiver is not me:
                receiver.cancel()  # connecting or backing off: nothing is being written
            if receiver is not me:
                await asyncio.wait([receiver])
        finally:
            for task in self.tasks:
                if task is not me:
                    task.cancel()
            self.on_end(self)
            self.done.set()
        return True

    async def _close_socket(self, ws: ClientConnection, grace_s: float) -> None:
        try:
            async with asyncio.timeout(grace_s):
                await ws.close()
        except (TimeoutError, OSError, WebSocketException):
            ws.transport.abort()

    # ----- task 1: heartbeat ------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.opts.heartbeat_s * random.uniform(0.5, 1.0)  # spread a claim burst
        while True:
            await asyncio.sleep(max(0.0, min(next_at, self.fence_at) - loop.time()))
            if self._fenced():
                break
            sent = loop.time()
            try:
                async with asyncio.timeout_at(self.fence_at):  # a hung call must not outlive the lease
                    outcome = await self.store.renew(self.cid, self.epoch, self.last_seq)
            except TimeoutError:
                break
            if outcome is Outcome.OK:
                self.fence_at = sent + self.opts.lease_ttl_s - self.opts.safety_margin_s
                next_at = sent + self.opts.heartbeat_s
            elif outcome is Outcome.LOST:
                self.counters.lost += 1
                log.warning("lease lost: %s", self.cid)
                await self.close("lost")
                return
            else:
                next_at = loop.time() + min(self.opts.heartbeat_s, 1.0)
        self.counters.fenced += 1
        log.warning("self-fenced: %s (no renewal before expiry - margin)", self.cid)
        # Peers may claim only at expiry + skew (= fence_at + 2 margins): the handshake gets one margin.
        await self.close("fenced", grace_s=self.opts.safety_margin_s)

    # ----- task 2: receive -----------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        delay = self.opts.backoff_min_s
        while not self.reason and not self._fenced():
            try:
                async with connect(resume_url(self.url, self.last_seq), proxy=None) as ws:
                    self.ws = ws
                    self.counters.streaming += 1
                    delay = self.opts.backoff_min_s
                    await self._pump(ws)
            except (OSError, TimeoutError, WebSocketException) as e:
                log.debug("upstream %s: %r", self.cid, e)
            except Exception:  # the receiver must never die while the lease is held
                log.exception("receive loop of %s", self.cid)
            finally:
                if self.ws is not None:
                    self.ws = None
                    self.counters.streaming -= 1
            if self.reason or self._fenced():
                return
            self.counters.reconnects += 1
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, self.opts.backoff_max_s)

    async def _pump(self, ws: ClientConnection) -> None:
        async for frame in ws:
            if self.reason or self._fenced():
                return
            if not await self._handle(frame):
                return  # the write failed: reconnect and resume from last_seq + 1

    async def _handle(self, frame: str | bytes) -> bool:
        """Write one frame; False when the write failed and the stream must resume."""
        if isinstance(frame, bytes):
            self.counters.rejected += 1
            return True
        try:
            msg = orjson.loads(frame)
        except orjson.JSONDecodeError:
            self.counters.rejected += 1
            return True
        if not isinstance(msg, dict):
            self.counters.rejected += 1
            return True
        seq = msg.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            seq = max(self.last_seq, 0) + 1
        elif seq <= self.last_seq:
            self.counters.duplicates += 1
            return True
        elif self.last_seq >= 0 and seq > self.last_seq + 1:
            self.counters.gaps += 1
            log.info("gap on %s: %d after %d", self.cid, seq, self.last_seq)
        return self._written(seq, await self.store.put_message(self.cid, seq, frame, self.epoch))

    def _written(self, seq: int, outcome: Outcome) -> bool:
        if outcome is Outcome.OK:
            self.last_seq = seq
            self.counters.messages += 1
            return True
        if outcome is Outcome.INVALID:  # e.g. larger than a DynamoDB item: skip it, never crash
            self.counters.rejected += 1
            return True
        self.counters.write_errors += 1
        return False

    # ----- task 3: desired state ----------------------------------------------------------------------------

    async def _desired_loop(self) -> None:
        await asyncio.sleep(self.opts.desired_state_s * random.uniform(0.1, 1.0))
        while True:
            try:
                state = await self.store.desired_state(self.cid)
            except Exception as e:
                log.debug("desired state of %s: %r", self.cid, e)
                state = STARTED  # unknown: keep streaming, ask again next round
            if state != STARTED:
                self.counters.stopped += 1
                log.info("desired state of %s is %r: closing", self.cid, state)
                if await self.close("stopped") and await self.store.release(self.cid, self.last_seq) is Outcome.OK:
                    self.counters.released += 1
                return
            await asyncio.sleep(self.opts.desired_state_s)
