"""The seed design fleetd is compared against (issue #5), written to be fair, not to lose.

What the seed is (the blog post fleetd comes from): one asyncio process per worker,
the ``websockets`` client library, and for every held connection a trio of tasks
(:mod:`bench.baseline.conn`):

1. a heartbeat renewing *that connection's* lease item every ``heartbeat_s`` with a
   conditional UpdateItem (``lease_owner = :me AND lease_epoch = :epoch``);
2. a receive loop (``async for msg in ws``) writing every frame with its own awaited
   PutItem into the messages table;
3. a desired-state check, one GetItem every ``desired_state_s``.

Around them: a claim is one conditional UpdateItem (SPEC §3); a reconcile every
``reconcile_s`` (60 s, ±20 %) queries the ``by_state_expiry`` GSI for free or expired
leases and claims them; an SQS long poll takes START hints; SIGTERM releases every
lease.  Nothing is batched and nothing is shared between connections except the two
AWS clients.

Fairness choices (each one helps the baseline, or keeps it honest):

* **Release hints on by default.**  On SIGTERM every released lease gets a START hint,
  so a peer resumes it in about a second; ``--no-release-hints`` gives the seed's
  "up to 60 s" figure (peers find the items at their next reconcile).
* **Self-fence.**  A connection whose lease was not renewed by ``expires − margin``
  stops writing and closes its socket, so a slow or partitioned worker does not
  stream twice; without it the seed would fail the one-streamer invariant.
* **Checkpoint piggybacked on the heartbeat.**  ``last_seq`` rides on the renewal
  (``SET … last_seq = :seq``): resumable progress at no extra DynamoDB call.
* **Resume with ``from_seq``.**  Every (re)connect asks the upstream to replay from
  ``last_seq + 1``, and frames at or below the last written seq are dropped, so no
  seq is lost across reconnects and handovers.
* Also: heartbeats and desired-state checks of a claim burst start at a random phase
  (no thundering herd), claims in a reconcile run ``--claim-concurrency`` at a time,
  the AWS clients use standard retries and a 64-connection pool, and hints we cannot
  take (full, or stopping) are made visible to peers at once instead of being eaten.
* Stock asyncio like the seed; ``--uvloop`` exists to measure how much of the gap is
  the event loop.

Limitations, on purpose (they are the seed's): one PutItem per message (no
BatchWriteItem), one UpdateItem per connection per heartbeat (each moves the GSI
range key), one GetItem per connection per desired-state interval, and a claim whose
response is lost after an SDK retry is not confirmed — the item stays ours, unstreamed,
until its lease expires and a reconcile claims it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import secrets
import signal
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict
from typing import Any

import orjson
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from bench.baseline.conn import Counters, Held
from bench.baseline.options import Options, parse
from bench.baseline.store import Outcome, Store

log = logging.getLogger("bench.baseline")
BOOT_ERROR = 3  # tables/queue/credentials unusable at start
RELEASE_CONCURRENCY = 64
HINT_POLL_GRACE_S = 0.5


def raise_nofile_limit() -> None:
    """Thousands of sockets: lift the soft fd limit to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _aws_config(opts: Options, read_timeout_s: float) -> AioConfig:
    return AioConfig(connect_timeout=opts.aws_timeout_s, read_timeout=read_timeout_s,
                     max_pool_connections=opts.aws_max_pool,
                     retries={"mode": "standard", "total_max_attempts": opts.aws_max_attempts})


class Worker:
    """One baseline worker process.  Pure constructor: clients and tasks are made in :meth:`run`."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.owner = f"{opts.worker_id}/{secrets.token_hex(6)}"  # lease_owner and messages' session_id
        self.counters = Counters()
        self.held: dict[str, Held] = {}
        self.claiming: set[str] = set()
        self.store: Store | None = None
        self.stopping: asyncio.Event | None = None
        self.aborting: asyncio.Event | None = None

    # ----- lifecycle -----------------------------------------------------------------------------------------

    async def run(self) -> int:
        raise_nofile_limit()
        self.stopping, self.aborting = asyncio.Event(), asyncio.Event()
        async with AsyncExitStack() as stack:
            try:
                self.store = await self._open_store(stack)
            except Exception as e:
                log.error("cannot boot: %r (do the tables and queue exist?)", e)
                return BOOT_ERROR
            self._install_signals()
            print("ready", flush=True)
            loop = asyncio.get_running_loop()
            stats = loop.create_task(self._stats_loop())
            work = [loop.create_task(self._reconcile_loop()), loop.create_task(self._hints_loop())]
            await self.stopping.wait()
            code = await self._shutdown_within_budget(work)
            stats.cancel()
            self.write_stats()
            return code

    async def _open_store(self, stack: AsyncExitStack) -> Store:
        session = get_session()
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        ddb = await stack.enter_async_context(session.create_client(
            "dynamodb", region_name=region, config=_aws_config(self.opts, self.opts.aws_timeout_s)))
        sqs = await stack.enter_async_context(session.create_client(
            "sqs", region_name=region, config=_aws_config(self.opts, self.opts.hint_wait_s + 10.0)))
        await ddb.describe_table(TableName=self.opts.connections_table)
        await ddb.describe_table(TableName=self.opts.messages_table)
        queue_url = (await sqs.get_queue_url(QueueName=self.opts.hints_queue))["QueueUrl"]
        return Store(ddb, sqs, self.owner, connections=self.opts.connections_table,
                     messages=self.opts.messages_table, queue_url=queue_url, ttl_ms=self.opts.ttl_ms,
                     skew_ms=self.opts.skew_ms, hint_wait_s=self.opts.hint_wait_s)

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        # Record only: the first signal starts the graceful shutdown, a second one cuts it short.
        assert self.stopping is not None and self.aborting is not None
        (self.aborting if self.stopping.is_set() else self.stopping).set()

    # ----- claiming ------------------------------------------------------------------------------------------

    def _full(self) -> bool:
        limit = self.opts.max_connections
        return limit > 0 and len(self.held) + len(self.claiming) >= limit

    async def try_claim(self, cid: str) -> bool:
        """One claim; on success the connection's three tasks start."""
        assert self.store is not None and self.stopping is not None
        if self.stopping.is_set() or cid in self.held or cid in self.claiming or self._full():
            return False
        self.claiming.add(cid)
        sent = asyncio.get_running_loop().time()
        try:
            claimed = await self.store.claim(cid)
        finally:
            self.claiming.discard(cid)
        if claimed is None:
            self.counters.claims_failed += 1
            return False
        self.counters.claims += 1
        held = Held(claimed, self.store, self.opts, self.counters,
                    fence_at=sent + self.opts.lease_ttl_s - self.opts.safety_margin_s, on_end=self._forget)
        self.held[cid] = held
        held.start()
        return True

    def _forget(self, held: Held) -> None:
        if self.held.get(held.cid) is held:
            del self.held[held.cid]

    async def _claim_all(self, cids: list[str]) -> None:
        """Claim ``cids``, ``claim_concurrency`` at a time, until stopping or full."""
        assert self.stopping is not None
        step = self.opts.claim_concurrency
        for i in range(0, len(cids), step):
            if self.stopping.is_set() or self._full():
                return
            await asyncio.gather(*(self.try_claim(c) for c in cids[i:i + step]))

    # ----- fleet loops ---------------------------------------------------------------------------------------

    async def _sleep(self, seconds: float) -> None:
        """Sleep, woken early by stopping."""
        assert self.stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _reconcile_loop(self) -> None:
        assert self.store is not None and self.stopping is not None
        while not self.stopping.is_set():
            try:
                async for page in self.store.free_items():
                    await self._claim_all([c for c in page if c not in self.held])
                    if self.stopping.is_set() or self._full():
                        break
            except Exception as e:
                log.warning("reconcile failed: %r", e)
            await self._sleep(self.opts.reconcile_s * random.uniform(0.8, 1.2))

    async def _hints_loop(self) -> None:
        assert self.store is not None and self.stopping is not None
        while not self.stopping.is_set():
            try:
                # Not cancelled at stopping: a long poll abandoned by us may still be handed messages
                # by SQS (our own release hints among them), hidden from peers for the visibility
                # timeout.  The shutdown lets it run on and this loop gives back what it returns.
                await self._handle_hints(await self.store.receive_hints())
            except Exception as e:
                log.warning("hint poll failed: %r", e)
                await self._sleep(1.0)

    async def _handle_hints(self, messages: list[tuple[str | None, str]]) -> None:
        assert self.store is not None and self.stopping is not None
        done: list[str] = []
        skipped: list[str] = []
        for cid, receipt in messages:
            if cid is not None and (self._full() or self.stopping.is_set()):
                skipped.append(receipt)  # a peer should have it now, not after the visibility timeout
                continue
            if cid is not None:
                await self.try_claim(cid)
            done.append(receipt)
        await self.store.delete_hints(done)
        await self.store.return_hints(skipped)

    # ----- shutdown ------------------------------------------------------------------------------------------

    async def _shutdown_within_budget(self, work: list[asyncio.Task[None]]) -> int:
        assert self.aborting is not None
        shutdown = asyncio.ensure_future(self._shutdown(work))
        abort = asyncio.ensure_future(self.aborting.wait())
        await asyncio.wait([shutdown, abort], timeout=self.opts.shutdown_budget_s,
                           return_when=asyncio.FIRST_COMPLETED)
        abort.cancel()
        if shutdown.done():
            if shutdown.exception() is None:
                return 0
            log.error("shutdown failed: %r", shutdown.exception())
            return 1
        shutdown.cancel()
        log.error("shutdown cut short (second signal or budget of %.0f s spent)", self.opts.shutdown_budget_s)
        return 1

    async def _shutdown(self, work: list[asyncio.Task[None]]) -> None:
        """Stop claiming → close sockets → release leases → START hints; each phase logged with its time."""
        assert self.store is not None
        reconcile, hints = work
        began = time.monotonic()
        await asyncio.wait([reconcile])  # returns promptly once stopping is set
        conns = list(self.held.values())
        ended = await asyncio.gather(*(h.close("shutdown") for h in conns))
        tasks = [t for h in conns for t in h.tasks]
        if tasks:  # a desired-state task may be releasing a STOPPED item: let it finish
            await asyncio.wait(tasks)
        log.info("shutdown: closed %d connections after %.2f s", len(conns), time.monotonic() - began)
        released = await self._release_all([h for h, first in zip(conns, ended, strict=True) if first])
        log.info("shutdown: released %d leases after %.2f s", len(released), time.monotonic() - began)
        if self.opts.release_hints and released:
            sent = await self.store.send_hints(released)
            log.info("shutdown: sent %d START hints after %.2f s", sent, time.monotonic() - began)
            await asyncio.wait([hints], timeout=HINT_POLL_GRACE_S)  # the poll in flight may get them: give back
        hints.cancel()

    async def _release_all(self, conns: list[Held]) -> list[str]:
        assert self.store is not None
        store = self.store
        gate = asyncio.Semaphore(RELEASE_CONCURRENCY)

        async def release(h: Held) -> str | None:
            async with gate:
                return h.cid if await store.release(h.cid, h.last_seq) is Outcome.OK else None

        released = [c for c in await asyncio.gather(*(release(h) for h in conns)) if c is not None]
        self.counters.released += len(released)
        return released

    # ----- observability -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"held": len(self.held), "streaming": c.streaming, "messages": c.messages, "rejected": c.rejected,
                "claims": c.claims, "pid": os.getpid(), "owner": self.owner, "at_ms": int(time.time() * 1000),
                "counters": asdict(c), "calls": dict(self.store.calls) if self.store else {}}

    def write_stats(self) -> None:
        path = self.opts.stats_file
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(self.stats()))
        os.replace(tmp, path)

    async def _stats_loop(self) -> None:
        while True:
            try:
                self.write_stats()
            except OSError as e:
                log.warning("cannot write stats: %r", e)
            await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    logging.getLogger("aiobotocore").setLevel(logging.WARNING)
    worker = Worker(opts)
    if opts.uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(worker.run())
    return asyncio.run(worker.run())
