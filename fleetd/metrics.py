"""The supervisor's Prometheus endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

Shards never touch prometheus-client (``fleetd.stats``): once a second each sends an
absolute snapshot of its counters, gauges and histograms to the supervisor, and
:class:`FleetCollector` turns the latest snapshot per shard index into metric
families on every scrape.  That gives three properties multiprocess mode cannot:

* a dead shard's gauges vanish the moment the supervisor notices the death;
* counters never go backwards: when a shard dies, its final counters are folded
  into a per-index base that the next incarnation's values are added to;
* every family an operator's dashboard queries exists from the first scrape, at 0,
  even before a shard ever incremented it.

Every stats name gets the ``fleetd_`` prefix and a ``shard`` label.  The HTTP server
is a ``ThreadingHTTPServer`` in a daemon thread, so the supervisor's own loop stays a
plain ``multiprocessing.connection.wait`` loop.  A client costs a thread, so slow or idle
clients must not be able to hold many: a socket silent for ``CLIENT_IDLE_TIMEOUT_S`` is
closed, and past ``max_clients`` open at once a new one is closed at accept (and counted),
so a scrape waits behind nobody and the task's thread limit is never the endpoint's to spend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from fleetd.stats import LAG_BUCKETS, LATENCY_BUCKETS, Key, Labels
from fleetd.validation import REFUSAL_REASONS

log = logging.getLogger("fleetd.metrics")

PREFIX = "fleetd_"
READY_MAX_AGE_S = 3.0  # a shard's snapshot older than this (3 report intervals) is not "ready"
Kind = Literal["counter", "gauge", "histogram"]
HistValue = tuple[tuple[float, ...], list[int], int, float]  # buckets, per-bucket counts (+Inf last), count, sum


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family every scrape shows, with the label sets pre-declared at 0."""

    name: str  # stats name, without the prefix; counters end in _total
    kind: Kind
    doc: str
    label_sets: tuple[Mapping[str, str], ...] = ({},)
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # histograms: the layout the shard observes into

    def zero(self) -> float | HistValue:
        """The value of a series nothing was reported for yet."""
        if self.kind == "histogram":
            return self.buckets, [0] * (len(self.buckets) + 1), 0, 0.0
        return 0.0


def _sets(label: str, *values: str) -> tuple[Mapping[str, str], ...]:
    return tuple({label: v} for v in values)


_RESULTS = ("won", "lost", "retryable", "fatal")

# The families dashboards and alerts are built on (see the list); anything else a
# shard reports is exported too, with a generic help text.
REQUIRED: tuple[Family, ...] = (
    Family("active_connections", "gauge", "Connections the shard holds a lease for."),
    Family("upstream_connected", "gauge", "Held connections whose upstream socket is open."),
    Family("session_live", "gauge", "1 while the shard's session lease is renewed in time, else 0."),
    Family("sink_buffer_messages", "gauge", "Messages buffered in the sink, not yet durably written."),
    Family("sink_stalled_streams", "gauge",
           "Streams whose checkpoint is held by a message DynamoDB refuses as invalid (retried, never skipped)."),
    Family("sink_stalled_messages", "gauge", "Messages DynamoDB refused as invalid and not written since."),
    Family("event_loop_lag_seconds", "histogram",
           "How late the shard's event loop ran a timer, sampled every 0.25 s: the lag of every callback it runs.",
           buckets=LAG_BUCKETS),
    Family("lease_claims_total", "counter", "Conditional claims by result.", _sets("result", *_RESULTS)),
    Family("lease_renewals_total", "counter", "Lease renewals by result.", _sets("result", *_RESULTS)),
    Family("lease_lost_total", "counter", "Connections fenced because their lease was lost, by reason.",
           _sets("reason", "self_fence", "session_lost", "taken")),
    Family("self_fence_total", "counter", "Times the shard fenced itself before its lease could expire."),
    Family("messages_total", "counter", "Upstream messages accepted by the shard."),
    Family("sink_batch_seconds", "histogram", "Duration of one sink BatchWriteItem call."),
    Family("upstream_reconnects_total", "counter", "Upstream reconnect attempts."),
    Family("upstream_frames_rejected_total", "counter", "Upstream frames rejected, by reason.",
           _sets("reason", "binary", "malformed", "noseq", "oversized")),
    Family("upstream_connect_refused_total", "counter",
           "Upstream connects refused by the SSRF guard, by reason: a redirect, or the host resolving only to "
           "addresses of that kind (not in allowed_networks).",
           _sets("reason", *REFUSAL_REASONS)),
    Family("seq_gaps_total", "counter", "Jumps in upstream sequence numbers."),
    Family("upstream_seq_anomalies_total", "counter",
           "Implausible upstream seqs (beyond max_seq_jump, or a resume starting over), by kind: jump and reset "
           "were held back and the stream resumed; jump_accepted and reset_parked: the resume repeated it, "
           "so the jump became a gap, or the stream was parked until an operator acts.",
           _sets("kind", "jump", "reset", "jump_accepted", "reset_parked")),
    Family("reconcile_claims_total", "counter", "Connections won by the reconcile loop."),
    Family("hint_claims_total", "counter", "Connections won through a START hint."),
    Family("hints_total", "counter",
           "Hint messages by kind (START ids received or sent, OFFER ids received, DEAD_SESSION received).",
           _sets("kind", "received", "sent", "offered", "offer_refused", "dead_session")),
    Family("offer_claims_total", "counter", "Connections taken from a stopping peer's offer (one write each)."),
    Family("handoff_total", "counter",
           "A stopping shard's streams by how they left: taken by a peer from its offer, or released.",
           _sets("result", "taken", "released")),
    Family("handed_claims_total", "counter", "Connections adopted after a peer handed them over (rebalancing)."),
    Family("rebalance_moves_total", "counter", "Connections handed to a peer by rebalancing, by result.",
           _sets("result", *_RESULTS)),
    Family("rebalance_given_back_total", "counter",
           "Handed connections freed again: more than the shard had room for."),
    Family("lease_claims_orphaned_total", "counter",
           "Claims won too late to be used (session given up or item lease past its deadline), given back."),
    Family("dead_session_unclaimable_freed_total", "counter",
           "Items no claim fits, freed from a dead session so that it can be forgotten."),
    Family("orphans_freed_total", "counter",
           "Connections the orphan sweep freed: owned by a session that no longer exists."),
    Family("loop_errors_total", "counter",
           "Rounds of a shard loop that failed (counted, logged at most every 10 s; the loop goes on), by loop.",
           _sets("loop", "heartbeat", "reconcile", "hints", "desired_state", "checkpoint",
                 "orphan_sweep", "rebalance", "receive")),
    Family("dynamodb_requests_total", "counter", "DynamoDB requests by operation and outcome.",
           tuple({"op": op, "outcome": "won"} for op in ("UpdateItem", "BatchWriteItem", "Query"))),
)
_REQUIRED_BY_NAME = {f.name: f for f in REQUIRED}


def _labels(labels: Mapping[str, str], shard: int) -> Labels:
    return tuple(sorted({**labels, "shard": str(shard)}.items()))


def _merge_hist(a: HistValue | None, b: HistValue) -> HistValue:
    """``a + b`` bucket by bucket; a bucket layout change keeps only ``b`` (it cannot be merged)."""
    if a is None or a[0] != b[0]:
        return b
    return b[0], [x + y for x, y in zip(a[1], b[1], strict=True)], a[2] + b[2], a[3] + b[3]


@dataclass(slots=True)
class ShardRecord:
    """What the supervisor knows about one shard index across its incarnations."""

    index: int
    alive: bool = False
    pid: int = 0
    snapshot: dict[str, Any] | None = None
    seen_at: float = 0.0  # monotonic time of the latest snapshot
    base_counters: dict[Key, float] = field(default_factory=dict)  # dead incarnations' final totals
    base_histograms: dict[Key, HistValue] = field(default_factory=dict)
    restarts: int = 0

    def counters(self) -> dict[Key, float]:
        out = dict(self.base_counters)
        for key, value in (self.snapshot or {}).get("counters", {}).items():
            out[key] = out.get(key, 0.0) + value
        return out

    def histograms(self) -> dict[Key, HistValue]:
        out = dict(self.base_histograms)
        for key, value in (self.snapshot or {}).get("histograms", {}).items():
            out[key] = _merge_hist(out.get(key), value)
        return out

    def gauges(self) -> dict[Key, float]:
        if not self.alive:
            return {}
        return dict((self.snapshot or {}).get("gauges", {}))

    def fold(self) -> None:
        """The incarnation ended: its counters become the base of the next one; gauges go."""
        self.base_counters = self.counters()
        self.base_histograms = self.histograms()
        self.snapshot = None
        self.alive = False


class _Builder:
    """Accumulates samples per family name during one collect()."""

    def __init__(self) -> None:
        self.kinds: dict[str, Kind] = {}
        self.counters: dict[str, dict[Labels, float]] = {}
        self.gauges: dict[str, dict[Labels, float]] = {}
        self.histograms: dict[str, dict[Labels, HistValue]] = {}

    def declare(self, name: str, kind: Kind) -> None:
        self.kinds.setdefault(name, kind)

    def add(self, kind: Kind, name: str, labels: Labels, value: Any) -> None:
        if self.kinds.setdefault(name, kind) != kind:
            return  # the same name reported as two kinds: keep the first, never emit an invalid family
        table: dict[str, dict[Labels, Any]] = getattr(self, kind + "s")
        table.setdefault(name, {})[labels] = value

    def setdefault(self, kind: Kind, name: str, labels: Labels, value: Any) -> None:
        table: dict[str, dict[Labels, Any]] = getattr(self, kind + "s")
        table.setdefault(name, {}).setdefault(labels, value)


class FleetCollector:
    """A prometheus-client collector over the latest snapshot of each shard index.

    The supervisor thread calls :meth:`shard_started`, :meth:`update`,
    :meth:`shard_exited`; HTTP threads call :meth:`collect` and :meth:`ready`.  One
    lock guards the records; collect() works on copies.
    """

    def __init__(self, shards: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.records = [ShardRecord(i) for i in range(shards)]
        self.draining = False  # set when the supervisor stops: /readyz turns 503 at once
        self._lock = threading.Lock()

    # ----- supervisor side ---------------------------------------------------------------------------

    def shard_started(self, index: int, pid: int, restart: bool = False) -> None:
        with self._lock:
            rec = self.records[index]
            rec.alive, rec.pid, rec.snapshot, rec.seen_at = True, pid, None, 0.0
            if restart:
                rec.restarts += 1

    def update(self, index: int, snapshot: dict[str, Any]) -> None:
        with self._lock:
            rec = self.records[index]
            if rec.alive:  # a late snapshot of a dead incarnation would resurrect its gauges
                rec.snapshot, rec.seen_at = snapshot, self.clock()

    def shard_exited(self, index: int) -> None:
        with self._lock:
            self.records[index].fold()

    # ----- readers -------------------------------------------------------------------------------------

    def task_active_connections(self) -> float:
        """Connections held by the whole task (live shards only)."""
        with self._lock:
            return sum(rec.gauges().get(("active_connections", ()), 0.0) for rec in self.records)

    def task_counters(self, keys: Iterable[Key]) -> dict[Key, float]:
        """Task-wide totals of these counters over every incarnation of every shard index.

        They never decrease: a dead incarnation's final counts are the base its successor's
        are added to, so a restart neither loses what was counted nor counts it again."""
        wanted = set(keys)
        out = dict.fromkeys(wanted, 0.0)
        with self._lock:
            for rec in self.records:
                for key, value in rec.counters().items():
                    if key in wanted:
                        out[key] += value
        return out

    def ready(self) -> bool:
        """Every shard is alive, reported recently, its session is live, and its sink writes everything.

        A sink stalled on messages DynamoDB refuses (a misconfigured messages table) holds
        its streams' checkpoints: the task does not do its job until an operator acts.
        """
        now = self.clock()
        with self._lock:
            if self.draining:
                return False
            return all(
                rec.alive and rec.snapshot is not None and now - rec.seen_at <= READY_MAX_AGE_S
                and rec.gauges().get(("session_live", ()), 0.0) == 1.0
                and rec.gauges().get(("sink_stalled_streams", ()), 0.0) == 0.0
                for rec in self.records
            )

    def collect(self) -> Iterator[Metric]:
        b = _Builder()
        with self._lock:
            views = [_View(rec.index, rec.alive, rec.restarts, rec.counters(), rec.gauges(), rec.histograms())
                     for rec in self.records]
        for v in views:
            _shard_samples(b, v)
        yield from _families(b)
        total = Metric(PREFIX + "task_active_connections", "Connections held by all shards of this task.", "gauge")
        total.add_sample(total.name, {}, sum(v.gauges.get(("active_connections", ()), 0.0) for v in views))
        running = Metric(PREFIX + "shards_running", "Shard processes currently running.", "gauge")
        running.add_sample(running.name, {}, float(sum(v.alive for v in views)))
        yield from (total, running)


@dataclass(frozen=True, slots=True)
class _View:
    """A consistent copy of one :class:`ShardRecord`, taken under the lock."""

    index: int
    alive: bool
    restarts: int
    counters: dict[Key, float]
    gauges: dict[Key, float]
    histograms: dict[Key, HistValue]


def _shard_samples(b: _Builder, v: _View) -> None:
    for (name, labels), value in v.counters.items():
        b.add("counter", name, _labels(dict(labels), v.index), value)
    for (name, labels), value in v.gauges.items():
        b.add("gauge", name, _labels(dict(labels), v.index), value)
    for (name, labels), hist in v.histograms.items():
        b.add("histogram", name, _labels(dict(labels), v.index), hist)
    b.add("counter", "shard_restarts_total", _labels({}, v.index), float(v.restarts))
    _defaults(b, v.index, v.alive)


def _defaults(b: _Builder, index: int, alive: bool) -> None:
    """Zero series for the required families; gauges only for live shards (a dead one's must vanish)."""
    for fam in REQUIRED:
        b.declare(fam.name, fam.kind)
        if fam.kind == "gauge" and not alive:
            continue
        for labels in fam.label_sets:
            b.setdefault(fam.kind, fam.name, _labels(labels, index), fam.zero())


def _doc(name: str) -> str:
    fam = _REQUIRED_BY_NAME.get(name)
    if fam is not None:
        return fam.doc
    if name == "shard_restarts_total":
        return "Times the supervisor restarted this shard index after it died."
    return f"fleetd shard metric {name}."


def _families(b: _Builder) -> Iterator[Metric]:
    for name in sorted(b.kinds):
        kind = b.kinds[name]
        if kind == "counter":
            yield _counter(name, b.counters.get(name, {}))
        elif kind == "gauge":
            yield _gauge(name, b.gauges.get(name, {}))
        else:
            yield _histogram(name, b.histograms.get(name, {}))


def _counter(name: str, samples: dict[Labels, float]) -> Metric:
    base = name.removesuffix("_total")
    m = Metric(PREFIX + base, _doc(name), "counter")
    for labels, value in sorted(samples.items()):
        m.add_sample(PREFIX + base + "_total", dict(labels), value)
    return m


def _gauge(name: str, samples: dict[Labels, float]) -> Metric:
    m = Metric(PREFIX + name, _doc(name), "gauge")
    for labels, value in sorted(samples.items()):
        m.add_sample(PREFIX + name, dict(labels), value)
    return m


def _histogram(name: str, samples: dict[Labels, HistValue]) -> Metric:
    m = Metric(PREFIX + name, _doc(name), "histogram")
    for labels, (buckets, counts, count, total) in sorted(samples.items()):
        lab = dict(labels)
        cumulative = 0
        for bound, n in zip((*buckets, float("inf")), counts, strict=True):
            cumulative += n
            m.add_sample(PREFIX + name + "_bucket", {**lab, "le": _le(bound)}, float(cumulative))
        m.add_sample(PREFIX + name + "_count", lab, float(count))
        m.add_sample(PREFIX + name + "_sum", lab, total)
    return m


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def exposition(collector: FleetCollector) -> bytes:
    """The Prometheus text format of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


# ----- HTTP ---------------------------------------------------------------------------------------------


CLIENT_IDLE_TIMEOUT_S = 5.0  # a scrape sends its request at once; Prometheus's own timeout is 10 s
MAX_CLIENTS = 64  # scrapers and health checks of one task: a handful


def _handler(collector: FleetCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = CLIENT_IDLE_TIMEOUT_S  # socket timeout: a silent or half-sent request ends the thread

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, exposition(collector), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                ok = collector.ready()
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

        def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape would drown the daemon's own logs

    return Handler


class _CappedServer(ThreadingHTTPServer):
    """At most ``max_clients`` connections served at once; one more is closed at accept."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_clients: int) -> None:
        super().__init__(addr, handler)
        self.max_clients = max_clients
        self.clients = 0
        self.refused = 0
        self._lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self.clients >= self.max_clients
            if full:
                self.refused += 1
            else:
                self.clients += 1
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self.clients -= 1


class MetricsServer:
    """``/metrics``, ``/healthz``, ``/readyz`` on ``host:port`` (port 0 picks one: see :attr:`url`)."""

    def __init__(self, addr: str, collector: FleetCollector, max_clients: int = MAX_CLIENTS) -> None:
        host, _, port = addr.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.collector = collector
        self.max_clients = max_clients
        self._server: _CappedServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def clients(self) -> int:
        """Connections being served now."""
        return self._server.clients if self._server is not None else 0

    @property
    def refused(self) -> int:
        """Connections closed at accept because ``max_clients`` were being served."""
        return self._server.refused if self._server is not None else 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Bind (OSError if the address is taken) and serve in a daemon thread."""
        server = _CappedServer((self.host, self.port), _handler(self.collector), self.max_clients)
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info(f"metrics listening on {self.url}", extra={"url": self.url})

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def scrape(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """``(sample name, labels, value)`` of every sample in an exposition (tests, ``fleetd dev``)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield s.name, dict(s.labels), float(s.value)
