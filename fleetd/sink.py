"""The messages sink: upstream frames → the DynamoDB messages table (SPEC §2, §5).

Protocol
--------
* A shard gets one :class:`Cursor` per owned connection (``Sink.cursor``) and calls
  ``Sink.submit(cur, seq, payload, received_at_ms)`` from its ``on_ws_frame``
  callback, with ``seq`` strictly increasing per cursor.  ``submit`` only appends
  to a deque: the request dicts are built by the flushers.
* ``Sink.run`` forms BatchWriteItem calls (≤ 25 puts; a partial batch leaves after
  ``sink_linger_ms``) with up to ``sink_flushers`` in flight.  Each batch is retried
  — UnprocessedItems and failed calls alike, with exponential backoff and jitter —
  until it is durable or its cursors are deactivated.  Nothing is dropped silently:
  the only messages never written are those of deactivated cursors and those too
  large for a DynamoDB item (known before sending), which are counted in
  ``upstream_frames_rejected_total{reason="too_large_for_sink"}``, logged and skipped.
* A message DynamoDB refuses as invalid (ValidationException: a messages table with
  the wrong key schema, a number it cannot store) is never skipped: a refused batch
  is split into single writes to find the culprits, and each refused message
  *stalls* — it stays buffered and un-durable, so its cursor's ``last_seq`` cannot
  pass it, while the cursor's later messages and other cursors keep being written.
  Stalled messages are retried one at a time, round robin, with a backoff up to
  ``STALL_BACKOFF_MAX_S`` (the usual cause is the table, which an operator fixes);
  when one is accepted, all are retried at once.  Every refusal counts in
  ``sink_errors_total{kind="invalid"}``; the gauges ``sink_stalled_streams`` and
  ``sink_stalled_messages`` show the stall (``/readyz`` fails while a shard has
  one), and a rate-limited log line names a refused message and DynamoDB's reason.
  A stall holds its messages in the buffer, so the high watermark bounds it.
* ``Cursor.last_seq`` advances only over contiguous durable writes: it is the
  highest submitted seq such that every seq submitted before it on that cursor
  is durable (or was too large to store), however out of order the batches
  complete.  The shard checkpoints it into the connection item.
* ``Sink.deactivate`` fences a cursor (lease lost, self-fenced, closed): its
  buffered messages are dropped and never sent again.  A request already on the
  wire cannot be recalled; fencing ``safety_margin_s`` before expiry covers that.
* ``on_pressure(True)`` is called once when ``buffered`` rises above
  ``sink_high_watermark``, ``on_pressure(False)`` once when it falls below
  ``sink_low_watermark`` (the shard pauses / resumes upstream reads).
* Release: ``wait_durable(ddb, cursors, timeout_s)`` waits until those cursors have
  nothing pending, so their final ``last_seq`` can go into the release.
* Shutdown: ``run`` returns when ``stopping`` is set, putting unfinished batches
  back into the buffer; then ``drain`` writes what active cursors still have,
  bounded by its timeout.
* ``sink = "discard"`` makes every submitted message durable at once, without I/O
  (benchmarks of the ingest path).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

from fleetd.aio import Backoff
from fleetd.aws import Outcome, classify, error_code
from fleetd.clock import Clock
from fleetd.config import Config
from fleetd.stats import Stats

log = logging.getLogger(__name__)

BATCH_MAX = 25  # PutRequests per BatchWriteItem
ITEM_MAX_BYTES = 400 * 1024  # DynamoDB item size limit, attribute names included
REQUEST_MAX_BYTES = 16 * 1024 * 1024  # BatchWriteItem request size limit
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
STALL_BACKOFF_MIN_S = 0.5  # retries of messages DynamoDB refused as invalid: first delay…
STALL_BACKOFF_MAX_S = 30.0  # …doubling up to this (an operator has to fix the table)
_NEVER = -1  # a queue length submit never reaches: no wake-up wanted
_LOG_EVERY_S = 5.0

# Bytes of an item besides payload, connection id and session id: the attribute names
# (connection_id, seq, payload, received_at_ms, lease_epoch, session_id = 58 bytes) and
# three numbers at their 21-byte maximum.  Over-estimating only ever rejects frames
# within ~70 bytes of the limit, which max_frame_bytes (350 KB) keeps far away.
_ITEM_FIXED_BYTES = 58 + 3 * 21
# JSON on the wire can be larger than the item: botocore escapes non-ASCII as \\uXXXX
# (up to 12 bytes per code point) and control characters as \\u00XX (6 bytes per byte).
_WIRE_PER_ASCII = 6
_WIRE_PER_CODEPOINT = 12
_THROTTLE_CODES = frozenset({"ProvisionedThroughputExceededException", "ThrottlingException",
                             "RequestLimitExceeded", "TooManyRequestsException"})

Entry = tuple["Cursor", int, bytes | str, int]
"""A submitted message: (cursor, seq, payload, received_at_ms) — all ``submit`` stores."""
Pending = tuple["Cursor", int, dict[str, Any], int, int]
"""A built message: (cursor, seq, PutRequest, received_at_ms, bound on its bytes on the wire)."""


def _no_pressure(paused: bool) -> None:
    pass


def _always(cur: Cursor) -> bool:
    return True


class Cursor:
    """Per-connection write state owned by the sink.

    ``last_seq``: highest seq such that every seq ≤ it submitted on this cursor is
    durable (contiguous), starting at the item's ``last_seq``.  ``checkpointed_seq``:
    the value last written to the connection item (set by the shard's checkpoint
    loop).  ``active``: False once fenced, lost or closed.

    Contiguity: ``_out`` holds the seqs submitted and not yet durable, in submit
    (= increasing) order.  A write that completes for the head of ``_out`` advances
    ``last_seq`` to it, and then over every following seq already in ``_done``; a
    write that completes anywhere else only joins ``_done``.  So ``last_seq`` never
    passes a seq still in flight, whatever order batches complete in.
    """

    __slots__ = ("_done", "_epoch_attr", "_id_attr", "_id_bytes", "_out", "active", "checkpointed_seq",
                 "connection_id", "last_seq", "lease_epoch")

    def __init__(self, connection_id: str, lease_epoch: int, last_seq: int) -> None:
        self.connection_id = connection_id
        self.lease_epoch = lease_epoch
        self.last_seq = last_seq
        self.checkpointed_seq = last_seq
        self.active = True
        self._out: collections.deque[int] = collections.deque()
        self._done: set[int] | None = None  # created on the first out-of-order completion
        # Attribute values shared by all of this cursor's items (botocore only reads them).
        self._id_attr = {"S": connection_id}
        self._epoch_attr = {"N": str(lease_epoch)}
        self._id_bytes = len(connection_id.encode())

    @property
    def pending(self) -> int:
        """Messages submitted on this cursor that ``last_seq`` has not passed (some may be durable already)."""
        return len(self._out)

    def durable(self, seq: int) -> None:
        """Record that the message ``seq`` is durable (or skipped for good: too large for an item)."""
        out = self._out
        if out and out[0] == seq:
            out.popleft()
            done = self._done
            while done and out and out[0] in done:
                seq = out.popleft()
                done.discard(seq)
            self.last_seq = seq
        else:
            if self._done is None:
                self._done = set()
            self._done.add(seq)

    def _drop_pending(self) -> int:
        """Forget every message not yet durable; returns how many there were.

        ``_out`` also holds seqs already durable behind one that is not (``_done``): those
        left the sink's buffer count when they were written.
        """
        n = len(self._out) - len(self._done or ())
        self._out.clear()
        self._done = None
        return n

    def __repr__(self) -> str:
        return (f"Cursor({self.connection_id!r}, epoch={self.lease_epoch}, last_seq={self.last_seq}, "
                f"pending={len(self._out)}, active={self.active})")


class Sink:
    """Buffers submitted messages and writes them with BatchWriteItem (see the module docstring).

    The constructor is pure: no loop, no client, no task.  One coroutine at a time
    "pumps" (forms batches and starts flushes): ``run``, or else a ``drain`` /
    ``wait_durable``; others calling meanwhile wait for the pump's progress.
    """

    def __init__(self, cfg: Config, session_id: str, stats: Stats, clock: Clock,
                 on_pressure: Callable[[bool], None] = _no_pressure,
                 may_write: Callable[[Cursor], bool] = _always) -> None:
        sk = cfg.sink
        self._may_write = may_write
        self._discard = sk.sink == "discard"
        self._table = cfg.aws.messages_table
        self._session_attr = {"S": session_id}
        self._overhead = _ITEM_FIXED_BYTES + len(session_id.encode())
        self._linger_s = sk.sink_linger_ms / 1000.0
        self._max_flushes = sk.sink_flushers
        self._high = sk.sink_high_watermark
        self._low = sk.sink_low_watermark
        self._stats = stats
        self._clock = clock
        self._on_pressure = on_pressure
        self._q: collections.deque[Entry] = collections.deque()  # submitted, not yet built
        self._held: collections.deque[Pending] = collections.deque()  # built, sent before _q
        self._solo: collections.deque[Pending] = collections.deque()  # to be sent one per call
        self._stalled: collections.deque[Pending] = collections.deque()  # refused as invalid, awaiting a retry
        self._stalls: dict[Cursor, set[int]] = {}  # seqs refused as invalid and not written since
        self._stalled_msgs = 0  # sum of the sets' sizes
        self._retry_at: float | None = None  # loop time of the next retry of a stalled message
        # peek(): the wait before the next retry.  The cap is read here, not at import: tests lower
        # it, even below the first delay.
        self._stall_backoff = Backoff(min(STALL_BACKOFF_MIN_S, STALL_BACKOFF_MAX_S), STALL_BACKOFF_MAX_S)
        self._retrying = False  # a stalled message is being retried
        self._last_stall_log = -_LOG_EVERY_S
        self._buffered = 0
        self._pressured = False
        self._wake = asyncio.Event()
        self._wake_at = _NEVER  # submit wakes the pump when the queue reaches this length
        self._flushes: set[asyncio.Task[None]] = set()
        self._pumping = False
        self._run_waiting = False
        self._waiters: list[asyncio.Future[None]] = []  # drain / wait_durable callers while run pumps
        self._last_log = -_LOG_EVERY_S
        self.written = 0  # messages made durable
        self.dropped = 0  # messages of deactivated cursors, never written
        self.rejected = 0  # messages too large for a DynamoDB item, skipped

    # ----- the caller's side (synchronous, hot) -------------------------------------------------------

    def cursor(self, connection_id: str, lease_epoch: int, last_seq: int) -> Cursor:
        """Write state for a connection just claimed with ``lease_epoch`` at checkpoint ``last_seq``."""
        return Cursor(connection_id, lease_epoch, last_seq)

    def submit(self, cur: Cursor, seq: int, payload: bytes | str, received_at_ms: int) -> None:
        """Buffer one message (``seq`` above every seq submitted on ``cur`` before).

        ``payload`` must be owned by the caller (copy a picows frame out of its buffer).
        """
        if not cur.active:
            return  # fenced: whatever still arrives must never be written
        if self._discard:
            cur.last_seq = seq
            self.written += 1
            return
        cur._out.append(seq)
        q = self._q
        q.append((cur, seq, payload, received_at_ms))
        if len(q) == self._wake_at:
            self._wake.set()
        self._buffered += 1
        if self._buffered > self._high and not self._pressured:
            self._pressured = True
            self._on_pressure(True)

    @property
    def buffered(self) -> int:
        """Messages submitted and neither durable nor dropped yet."""
        return self._buffered

    @property
    def pressured(self) -> bool:
        """Above the high watermark and not yet back below the low one: upstream reads should be paused."""
        return self._pressured

    def deactivate(self, cur: Cursor) -> None:
        """Fence ``cur``: its buffered messages are dropped and never written."""
        if not cur.active:
            return
        cur.active = False
        n = cur._drop_pending()
        # Its entries stay in the queues until a flusher meets and skips them; they are
        # accounted for here, once.
        self._buffered -= n
        self.dropped += n
        stalled = self._stalls.pop(cur, None)
        if stalled is not None:
            self._stalled_msgs -= len(stalled)
            self._stall_gauges()
        self._after_progress()
        self._wake.set()  # a drain may be waiting for the buffer to empty

    # ----- flushing -----------------------------------------------------------------------------------

    async def run(self, ddb: Any, stopping: asyncio.Event) -> None:
        """Write batches until ``stopping`` is set; then return without draining."""
        if self._discard:
            await stopping.wait()
            return
        watcher = asyncio.get_running_loop().create_task(self._wake_when(stopping))
        try:
            await self._take_over_pump(stopping)
            if not stopping.is_set():
                await self._pump(ddb, stopping.is_set, self._linger_s)
        finally:
            watcher.cancel()
            if not self._pumping:
                await self._abort_flushes()

    async def _take_over_pump(self, stopping: asyncio.Event) -> None:
        """A drain or wait_durable that started first (run was only scheduled) hands the pump over."""
        if self._pumping and self._run_waiting:
            raise RuntimeError("Sink.run is already running")
        self._run_waiting = True
        try:
            while self._pumping and not stopping.is_set():
                self._wake.set()
                await self._next_progress()
        finally:
            self._run_waiting = False
            self._notify()  # waiters in _settle: run pumps now, or is gone

    async def drain(self, ddb: Any, timeout_s: float) -> bool:
        """Write everything active cursors have buffered, for at most ``timeout_s``; True if all durable.

        Meant for shutdown, after ``run`` returned.  While ``run`` is active it only waits
        (under steady load the buffer is rarely empty: prefer :meth:`wait_durable`).
        """
        if self._discard:
            return True
        return await self._settle(ddb, lambda: self._buffered <= 0, timeout_s)

    async def wait_durable(self, ddb: Any, cursors: Iterable[Cursor], timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until these cursors have nothing pending (release of a few).

        Writes by itself if ``run`` is not active.  True if all of them are durable (or fenced).
        """
        if self._discard:
            return True
        wanted = [cur for cur in cursors if cur.active and cur._out]
        return await self._settle(ddb, lambda: all(not (c.active and c._out) for c in wanted), timeout_s)

    def set_session(self, session_id: str) -> None:
        """Stamp messages built from now on with a new session id (after the shard renewed its session)."""
        self._session_attr = {"S": session_id}
        self._overhead = _ITEM_FIXED_BYTES + len(session_id.encode())

    async def _settle(self, ddb: Any, finished: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``finished()`` or the timeout: wait on the running pump, or pump (no linger) if none runs."""
        own = False
        try:
            async with asyncio.timeout(timeout_s):
                while not finished():
                    if self._pumping or self._run_waiting:
                        await self._next_progress()
                    else:
                        own = True
                        await self._pump(ddb, finished, 0.0, yields=True)
        except TimeoutError:
            pass
        finally:
            if own and not self._pumping:  # flushes in progress belong to whoever pumps now
                await self._abort_flushes()
        return finished()

    async def _next_progress(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wake_when(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self._wake.set()

    async def _pump(self, ddb: Any, finished: Callable[[], bool], linger_s: float, yields: bool = False) -> None:
        """Start flushes while slots are free: at once for a full batch, after ``linger_s`` for a partial one.

        With ``yields`` (drain, wait_durable) it stops as soon as ``run`` wants to take over.
        """
        assert not self._pumping, "one pump at a time"
        self._pumping = True
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while not finished() and not (yields and self._run_waiting):
                timeout = self._retry_due(loop.time())
                if timeout == 0.0:
                    self._start_retry(ddb)
                    continue
                waiting = bool(self._q or self._held or self._solo)
                if waiting and len(self._flushes) < self._max_flushes:
                    now = loop.time()
                    deadline = now + linger_s if deadline is None else deadline
                    if self._held or self._solo or len(self._q) >= BATCH_MAX or now >= deadline:
                        self._start_flush(ddb, self._take())
                        deadline = None
                        continue
                    self._wake_at = BATCH_MAX
                    timeout = deadline - now if timeout is None else min(timeout, deadline - now)
                else:
                    # Queue empty: wake on the first message.  Slots full: a finishing flush wakes us.
                    self._wake_at = _NEVER if waiting else 1
                    deadline = deadline if waiting else None
                self._wake.clear()
                await _wait(self._wake, timeout)
        finally:
            self._wake_at = _NEVER
            self._pumping = False
            self._notify()  # a waiter in _settle may have to take over

    def _take(self) -> list[Pending]:
        """The next batch: ≤ 25 live messages, no key twice, within the request size limit."""
        if self._solo:
            return self._take_solo()
        batch: list[Pending] = []
        keys: set[tuple[str, int]] = set()
        later: list[Pending] = []
        wire = 0
        while len(batch) < BATCH_MAX and (self._held or self._q):
            p = self._held.popleft() if self._held else self._build(self._q.popleft())
            if p is None or not p[0].active:
                continue
            if wire + p[4] > REQUEST_MAX_BYTES and batch:
                self._held.appendleft(p)
                break
            key = (p[0].connection_id, p[1])
            if key in keys:
                later.append(p)  # DynamoDB rejects a batch that puts one key twice
                continue
            keys.add(key)
            batch.append(p)
            wire += p[4]
        self._held.extendleft(reversed(later))
        return batch

    def _take_solo(self) -> list[Pending]:
        while self._solo:
            p = self._solo.popleft()
            if p[0].active:
                return [p]
        return []

    def _build(self, entry: Entry) -> Pending | None:
        """The PutRequest of a submitted message, or None if it was dropped or rejected."""
        cur, seq, payload, received_at_ms = entry
        if not cur.active:
            return None
        value, size, wire = _payload_attr(payload)
        size += self._overhead + cur._id_bytes
        if size > ITEM_MAX_BYTES:
            self._reject(cur, seq, "too_large_for_sink", f"item of ~{size} bytes exceeds DynamoDB's 400 KB")
            return None
        item = {"connection_id": cur._id_attr, "seq": {"N": str(seq)}, "payload": value,
                "received_at_ms": {"N": str(received_at_ms)}, "lease_epoch": cur._epoch_attr,
                "session_id": self._session_attr}
        # wire + size over-counts (the payload twice) but bounds names, numbers and ids too.
        return cur, seq, {"PutRequest": {"Item": item}}, received_at_ms, wire + size

    def _reject(self, cur: Cursor, seq: int, reason: str, why: str) -> None:
        """Skip a message too large for any DynamoDB item: counted, logged, and done, so last_seq moves on.

        Known before sending and independent of the table, so no fix could ever store it
        (SPEC §5).  A message DynamoDB *refuses* is never skipped: see ``_stall``.
        """
        self._stats.inc("upstream_frames_rejected_total", reason=reason)
        log.warning("sink skips message %s/%d: %s", cur.connection_id, seq, why)
        self.rejected += 1
        self._complete(cur, seq)
        self._after_progress()

    def _start_flush(self, ddb: Any, batch: list[Pending]) -> None:
        if batch:
            self._start(self._flush(ddb, batch))

    def _start(self, flush: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(flush)
        self._flushes.add(task)
        task.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._flushes.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("sink flush failed", exc_info=task.exception())

    async def _abort_flushes(self) -> None:
        """Cancel flushes in progress; each puts its unfinished messages back (see ``_flush``)."""
        tasks = list(self._flushes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _flush(self, ddb: Any, batch: list[Pending]) -> None:
        """Write one batch until every message in it is durable, rejected or dropped."""
        backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, jitter=0.5)
        try:
            while True:
                batch = [p for p in batch if p[0].active]
                if not batch:
                    return
                try:
                    batch = await self._do_batch_write(ddb, batch)
                    if not batch:
                        return
                    self._note_error("unprocessed", f"{len(batch)} UnprocessedItems")
                except Exception as e:
                    if error_code(e) == "ValidationException":
                        self._isolate(batch, e)
                        return
                    self._note_error(_error_kind(e), f"{type(e).__name__}: {e}")
                await asyncio.sleep(backoff.next())
        except asyncio.CancelledError:
            # Nothing of ``batch`` is known to be durable: back to the front of the buffer.
            self._held.extendleft(reversed(batch))
            raise

    async def _do_batch_write(self, ddb: Any, batch: list[Pending]) -> list[Pending]:
        """One BatchWriteItem: marks what was written durable, returns the unprocessed rest.

        Fencing is checked at the moment of sending, not only when the lease is lost: a message
        goes out only while ``may_write`` says its stream's lease is valid now.  A process paused
        past its deadline may resume its flushes before its fence loop runs; their cursors are
        deactivated here instead (their messages are the next owner's to write)."""
        for p in batch:
            if p[0].active and not self._may_write(p[0]):
                self.deactivate(p[0])
        batch = [p for p in batch if p[0].active]
        if not batch:
            return []
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            resp = await ddb.batch_write_item(RequestItems={self._table: [p[2] for p in batch]})
        except Exception as e:
            self._count_request(loop.time() - started, classify(e).value)
            raise
        self._count_request(loop.time() - started, Outcome.WON.value)
        unprocessed = resp.get("UnprocessedItems", {}).get(self._table)
        rest = _unprocessed(batch, unprocessed) if unprocessed else []
        self._written(batch, rest)
        return rest

    def _count_request(self, seconds: float, outcome: str) -> None:
        self._stats.observe("sink_batch_seconds", seconds)
        self._stats.inc("dynamodb_requests_total", op="BatchWriteItem", outcome=outcome)

    def _written(self, batch: list[Pending], rest: list[Pending]) -> None:
        left = {id(p) for p in rest}
        oldest_ms = None
        for p in batch:
            if id(p) not in left and p[0].active:
                self._complete(p[0], p[1])
                self.written += 1
                oldest_ms = p[3] if oldest_ms is None else min(oldest_ms, p[3])
        if oldest_ms is not None:
            # One sample per call, its oldest message: the latency that matters for resumption.
            self._stats.observe("sink_latency_seconds", max(0, self._clock.now_ms() - oldest_ms) / 1000.0)
        self._after_progress()

    def _isolate(self, batch: list[Pending], exc: BaseException) -> None:
        """DynamoDB refused the batch as invalid: find the culprit by sending its messages one by one."""
        self._note_error("invalid", f"{type(exc).__name__}: {exc}")
        if len(batch) > 1:
            self._solo.extend(batch)
            self._wake.set()
            return
        self._stall(batch[0], exc)

    # ----- messages refused as invalid: held, retried slowly, never skipped ---------------------------

    def _stall(self, p: Pending, exc: BaseException) -> None:
        """Hold a message DynamoDB refused on its own: not durable, so its cursor's last_seq stops before it."""
        cur, seq = p[0], p[1]
        if not cur.active:
            return
        seqs = self._stalls.setdefault(cur, set())
        if seq not in seqs:
            seqs.add(seq)
            self._stalled_msgs += 1
            self._stall_gauges()
        self._stalled.append(p)
        if self._retry_at is None:
            self._retry_at = asyncio.get_running_loop().time() + self._stall_backoff.peek()
        now = asyncio.get_running_loop().time()
        if now - self._last_stall_log >= _LOG_EVERY_S:
            self._last_stall_log = now
            log.error("sink cannot write message %s/%d, DynamoDB refuses it as invalid: %s; %d messages of "
                      "%d streams are held, their checkpoints stop before them, retrying every <= %g s "
                      "(check the messages table's key schema: `fleetd init --check`)", cur.connection_id, seq,
                      exc, self._stalled_msgs, len(self._stalls), STALL_BACKOFF_MAX_S)

    def _retry_due(self, now: float) -> float | None:
        """Seconds until a stalled message should be retried (0: now), None if none is waiting."""
        if self._retry_at is None or self._retrying or not self._stalled:
            return None
        if len(self._flushes) >= self._max_flushes:
            return None  # a finishing flush wakes the pump
        return max(0.0, self._retry_at - now)

    def _start_retry(self, ddb: Any) -> None:
        """Retry the stalled message next in turn (round robin: one that can never be written blocks none)."""
        while self._stalled:
            p = self._stalled.popleft()
            if p[0].active:
                self._retrying = True
                self._start(self._retry(ddb, p))
                return
        self._retry_at = None

    async def _retry(self, ddb: Any, p: Pending) -> None:
        """One stalled message: refused again → back off; written → the cause is gone, retry them all."""
        try:
            await self._flush(ddb, [p])
        finally:
            self._retrying = False
        cur, seq = p[0], p[1]
        if seq in self._stalls.get(cur, ()):  # refused again (``_stall`` queued it at the back)
            self._stall_backoff.next()  # the next retry waits twice as long
        elif cur.active:
            self._stall_backoff.reset()
            self._held.extendleft(reversed(self._stalled))  # still counted as stalled until written
            self._stalled.clear()
        now = asyncio.get_running_loop().time()
        self._retry_at = now + self._stall_backoff.peek() if self._stalled else None

    def _unstall(self, cur: Cursor, seq: int) -> None:
        """A message that had been refused is written after all."""
        seqs = self._stalls.get(cur)
        if seqs is None or seq not in seqs:
            return
        seqs.discard(seq)
        self._stalled_msgs -= 1
        if not seqs:
            del self._stalls[cur]
            if not self._stalls:
                log.info("sink writes again: no message is held as refused any more")
        self._stall_gauges()

    def _stall_gauges(self) -> None:
        self._stats.set("sink_stalled_streams", len(self._stalls))
        self._stats.set("sink_stalled_messages", self._stalled_msgs)

    def _complete(self, cur: Cursor, seq: int) -> None:
        if cur.active:  # a deactivated cursor's messages were un-counted when it was fenced
            self._buffered -= 1
            cur.durable(seq)
            if self._stalls:
                self._unstall(cur, seq)

    def _after_progress(self) -> None:
        """Keep the buffer gauge current, wake waiters, release backpressure below the low watermark."""
        self._stats.set("sink_buffer_messages", self._buffered)
        if self._waiters:
            self._notify()
        if self._pressured and self._buffered < self._low:
            self._pressured = False
            self._on_pressure(False)

    def _note_error(self, kind: str, detail: str) -> None:
        """Count every failure; log at most one every few seconds (a throttled table fails a lot)."""
        self._stats.inc("sink_errors_total", kind=kind)
        now = asyncio.get_running_loop().time()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("sink write failed (%s), retrying with backoff: %s; %d messages buffered",
                        kind, detail, self._buffered)


def _payload_attr(payload: bytes | str) -> tuple[dict[str, Any], int, int]:
    """(attribute value, its item bytes, a bound on its JSON bytes): text as S, other bytes as B."""
    if isinstance(payload, str):
        return {"S": payload}, _utf8_len(payload), len(payload) * _wire_factor(payload)
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return {"B": payload}, len(payload), (len(payload) + 2) // 3 * 4  # base64 on the wire
    return {"S": text}, len(payload), len(text) * _wire_factor(text)


def _utf8_len(text: str) -> int:
    """Its UTF-8 length, or an upper bound when that is certainly below the item limit."""
    if text.isascii():  # O(1) for str
        return len(text)
    bound = 4 * len(text)
    return bound if bound <= ITEM_MAX_BYTES // 2 else len(text.encode("utf-8", "surrogatepass"))


def _wire_factor(text: str) -> int:
    return _WIRE_PER_ASCII if text.isascii() else _WIRE_PER_CODEPOINT


def _unprocessed(batch: list[Pending], requests: list[dict[str, Any]]) -> list[Pending]:
    """The messages of ``batch`` that UnprocessedItems names (matched by key)."""
    keys = set()
    for r in requests:
        item = r.get("PutRequest", {}).get("Item", {})
        keys.add((item.get("connection_id", {}).get("S"), int(item.get("seq", {}).get("N", -1))))
    return [p for p in batch if (p[0].connection_id, p[1]) in keys]


def _error_kind(exc: BaseException) -> str:
    """A low-cardinality label for ``sink_errors_total``."""
    code = error_code(exc)
    if code in _THROTTLE_CODES:
        return "throttled"
    if code:
        status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status >= 500 or code in ("InternalServerError", "ServiceUnavailable"):
            return "server"
        return "fatal" if classify(exc) is Outcome.FATAL else "client"
    if isinstance(exc, (TimeoutError, ReadTimeoutError, ConnectTimeoutError)):
        return "timeout"
    return "connection"


async def _wait(event: asyncio.Event, limit_s: float | None) -> None:
    """Wait for ``event``, at most ``limit_s`` seconds (None: no limit)."""
    if limit_s is None:
        await event.wait()
        return
    try:
        async with asyncio.timeout(limit_s):
            await event.wait()
    except TimeoutError:
        pass
