"""Tracing (fleetd/tracing.py): off without OTLP settings, and what a real fleet exports with them.

The spans are received by :class:`Receiver`, an OTLP/HTTP endpoint on loopback that decodes each
request with the real protobuf classes (``opentelemetry-proto``), as a collector would.  The fleet
test runs ``fleetd run`` (supervisor, forkserver, shard) against the local stack on the fast profile.
"""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from fleetd import tracing
from fleetd.config import Config
from fleetd.logs import RateLimiter
from tests.fleet import FleetdProc, UpstreamProc, audit, fleetd_env, owners, seed_items, stop_all, wait_for
from tests.helpers import arun

OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


# ----- an OTLP/HTTP receiver --------------------------------------------------------------------------


@dataclass(frozen=True)
class Got:
    """One received span, flattened."""

    name: str
    trace_id: str
    span_id: str
    parent: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]
    resource: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[str]  # span ids
    status: int  # 0 unset, 2 error
    dropped_events: int


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


class Receiver:
    """POST /v1/traces with an ``ExportTraceServiceRequest`` (protobuf, gzip or not), on 127.0.0.1."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.requests.append(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self, name: str | None = None) -> list[Got]:
        with self.lock:
            requests = list(self.requests)
        out = []
        for request in requests:
            for rs in request.resource_spans:
                resource = _attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        if name is None or s.name == name:
                            out.append(Got(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                           s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes),
                                           resource, [(e.name, _attrs(e.attributes)) for e in s.events],
                                           [link.span_id.hex() for link in s.links], s.status.code,
                                           s.dropped_events_count))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> Receiver:
    """This process exports to ``receiver`` (and nothing else of the environment's OTEL_* applies)."""
    for key in OTEL_VARS:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    return receiver


# ----- off -------------------------------------------------------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=False)


def test_without_an_otlp_endpoint_the_tracer_is_null_and_opentelemetry_is_never_imported() -> None:
    """A whole shard's code path with the packages installed but no endpoint set: nothing of OTel loads."""
    res = _python("""
import sys
from fleetd import supervisor, tracing
from fleetd.shard import runtime
from fleetd.shard.session import Identity
tracer = runtime.env_tracer(Identity("t", 0, 10, lambda: "n"))
assert tracer is tracing.NULL, tracer
assert tracer.tenure("c", "s", 1, None) is tracing.NO_TENURE
with tracer.span("reconcile_round", quiet=True) as span:
    assert span is tracing.NO_SPAN
assert supervisor.tracing.preload() == []
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
""", OTEL_SERVICE_NAME="fleetd-test")  # an OTEL_ setting that is not an endpoint turns nothing on
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_an_endpoint_without_the_packages_is_one_warning_and_no_tracing() -> None:
    res = _python("""
import logging, sys
sys.modules["opentelemetry"] = None  # as if not installed: every import of it fails
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from fleetd import tracing
from fleetd.config import Config
from fleetd.logs import RateLimiter
assert tracing.from_env({"task_id": "t"}) is tracing.NULL
print("ok")
""", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/v1/traces")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert res.stderr.count("WARNING") == 1 and "pip install 'fleetd[otel]'" in res.stderr, res.stderr


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "false"}, True),
    ({"OTEL_SERVICE_NAME": "fleetd", "OTEL_TRACES_EXPORTER": "otlp"}, False),  # no endpoint: off
])
def test_enabled_only_with_an_otlp_endpoint(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled_by_env(env) is on


# ----- the OpenTelemetry tracer, in this process -------------------------------------------------------------


def test_quiet_spans_are_exported_only_when_something_happened_in_them(otel_env: Receiver) -> None:
    async def body() -> None:
        tracer = tracing.from_env({"task_id": "unit", "shard": 3})
        assert tracer.enabled
        with tracer.span("reconcile_round", quiet=True, held=0) as idle:
            idle.set(held_after=0)  # attributes alone do not record it
        with tracer.span("reconcile_round", quiet=True, held=0) as busy:
            with tracer.span("takeover", quiet=True, dead_session="dead/0/x"):
                tenure = tracer.tenure("c1", "me/0/n", 7, 41, source="reconcile")
            busy.set(held_after=1)
        with pytest.raises(ValueError), tracer.span("takeover", quiet=True, dead_session="dead/0/y"):
            raise ValueError("boom")
        for i in range(tracing.MAX_EVENTS + 5):
            tenure.event("seq_gap", after=i, got=i + 2)
        tenure.end("fenced", fence_reason="self_fence")
        tenure.end("released")  # a second end is ignored
        await tracer.close(5.0)

    arun(body())
    rounds = otel_env.spans("reconcile_round")
    assert len(rounds) == 1, "the idle round is not exported"
    (rnd,) = rounds
    takeovers = {s.attrs["fleetd.dead_session"]: s for s in otel_env.spans("takeover")}
    assert set(takeovers) == {"dead/0/x", "dead/0/y"}
    assert takeovers["dead/0/x"].parent == rnd.span_id and takeovers["dead/0/x"].trace_id == rnd.trace_id
    assert takeovers["dead/0/y"].status == 2 and takeovers["dead/0/y"].parent == ""
    assert takeovers["dead/0/x"].start_ns >= rnd.start_ns and rnd.attrs["fleetd.held_after"] == 1
    (tenure,) = otel_env.spans("tenure")
    assert tenure.parent == "" and tenure.trace_id != rnd.trace_id, "a tenure is the root of its own trace"
    assert tenure.links == [takeovers["dead/0/x"].span_id], "it links to the span it began in"
    assert tenure.attrs == {"fleetd.connection_id": "c1", "fleetd.session_id": "me/0/n", "fleetd.lease_epoch": 7,
                            "fleetd.resume_seq": 41, "fleetd.source": "reconcile", "fleetd.end_reason": "fenced",
                            "fleetd.fence_reason": "self_fence", "fleetd.events_dropped": 5}
    assert len(tenure.events) == tracing.MAX_EVENTS and tenure.events[0] == ("seq_gap", {"fleetd.after": 0,
                                                                                         "fleetd.got": 2})
    assert tenure.resource["service.name"] == "fleetd" and tenure.resource["fleetd.task_id"] == "unit"
    assert tenure.resource["fleetd.shard"] == 3
    # X-Ray's form: the trace id starts with its epoch second.
    assert abs(int(tenure.trace_id[:8], 16) - time.time()) < 60


class _Broken:
    """An OpenTelemetry span whose every call fails."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} failed")
        return fail


def test_a_failing_opentelemetry_call_is_logged_and_never_raises(
        otel_env: Receiver, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease protocol calls the tracer between a fence and a release: a fault there must not skip them."""
    monkeypatch.setattr(tracing, "_limiter", RateLimiter(10.0))  # none logged before this test

    async def body() -> None:
        tracer = tracing.from_env({"task_id": "unit"})
        tenure = tracer.tenure("c1", "s", 1, None)
        tenure._span = _Broken()  # type: ignore[attr-defined]
        tenure.event("upstream_reconnect", cause="disconnected")
        tenure.end("fenced")
        with tracer.span("shutdown") as span:
            span._span = _Broken()  # type: ignore[attr-defined]
            span.set(held=1)
            span.event("phase", phase="release")
        await tracer.close(5.0)

    arun(body())
    failures = [r for r in caplog.records if r.getMessage().startswith("tracing call failed")]
    assert len(failures) == 1, "logged once per interval, not once per call"


def test_close_is_bounded_when_the_collector_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers
    try:
        for key in OTEL_VARS:
            monkeypatch.delenv(key)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")

        async def body() -> float:
            tracer = tracing.from_env({"task_id": "unit"})
            tracer.tenure("c1", "s", 1, None).end("released")
            started = time.monotonic()
            await tracer.close(0.5)
            return time.monotonic() - started

        assert arun(body()) < 1.5
    finally:
        silent.close()


# ----- a fleet ---------------------------------------------------------------------------------------------


def start_run(cfg: Config, tmp_path: Path, task: str, receiver: Receiver, **env: str) -> FleetdProc:
    """``fleetd run`` with one shard, exporting to ``receiver`` (batches every 0.2 s)."""
    clean = {k: v for k, v in fleetd_env(cfg, FLEETD_TASK_ID=task, FLEETD_SHARDS="1", **env).items()
             if not k.startswith("OTEL_")}
    full = {**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    return FleetdProc([sys.executable, "-m", "fleetd", "run", "--metrics-addr", "127.0.0.1:0"], full,
                      tmp_path / f"run-{task}.log")


def tasks_of(cfg: Config, ids: list[str]) -> dict[str, int]:
    """Owning task → number of ``ids`` it owns ('' for free)."""
    counts: dict[str, int] = {}
    for cid, owner in owners(cfg).items():
        if cid in ids:
            task = owner.split("/")[0]
            counts[task] = counts.get(task, 0) + 1
    return counts


def test_tenures_of_a_hand_over_share_the_connection_id_and_follow_each_others_epochs(
        cfg: Config, tmp_path: Path, receiver: Receiver) -> None:
    """Task a holds 20 streams; task b starts and a's rebalancing hands it some (one push each); then a
    gets SIGTERM and offers the rest, which b takes (or, not taken in time, releases them for b to
    claim through the hints); then b stops.  Every stream has exactly two tenures in the traces, a's
    then b's, and what they say agrees with the table."""
    conns = [f"c{i:02d}" for i in range(20)]
    up = UpstreamProc(tmp_path, rate=10.0)
    a: FleetdProc | None = None
    b: FleetdProc | None = None
    try:
        seed_items(cfg, {cid: up.url(cid) for cid in conns})
        # b finds streams mostly through a's hand-overs and hints: its periodic reconcile is a minute away.
        a = start_run(cfg, tmp_path, "a", receiver, FLEETD_REBALANCE_S="2")
        wait_for(lambda: tasks_of(cfg, conns) == {"a": 20}, 30, 0.25, "a claims all 20")
        wait_for(lambda: all(len(s) >= 3 for s in audit(cfg, conns).seqs.values())
                 and len(audit(cfg, conns).seqs) == 20, 20, 0.5, "a writes a few messages of each")
        b = start_run(cfg, tmp_path, "b", receiver, FLEETD_REBALANCE_S="2", FLEETD_RECONCILE_S="60")
        wait_for(lambda: tasks_of(cfg, conns).get("b", 0) >= 5, 40, 0.5, "a hands b some streams")
        time.sleep(2)  # past a's settle time: no more moves pending
        a.signal(signal.SIGTERM)
        assert a.wait(25) == 0
        wait_for(lambda: tasks_of(cfg, conns) == {"b": 20}, 20, 0.25, "b owns all 20")
        time.sleep(1)
        b.signal(signal.SIGTERM)
        assert b.wait(25) == 0
    finally:
        stop_all(*(p for p in (a, b) if p is not None), up)

    tenures: dict[str, list[Got]] = {}
    for t in receiver.spans("tenure"):
        tenures.setdefault(t.attrs["fleetd.connection_id"], []).append(t)
    assert sorted(tenures) == conns, f"streams without tenures: {sorted(set(conns) - set(tenures))}"
    handed = offered = released = 0
    for cid, pair in tenures.items():
        assert len(pair) == 2, f"{cid}: {len(pair)} tenures"
        first, second = sorted(pair, key=lambda t: t.start_ns)
        assert first.resource["fleetd.task_id"] == "a" and second.resource["fleetd.task_id"] == "b", cid
        assert first.attrs["fleetd.session_id"].startswith("a/") and second.attrs["fleetd.session_id"].startswith("b/")
        assert first.attrs["fleetd.lease_epoch"] == 1 and "fleetd.resume_seq" not in first.attrs, \
            "a's tenure is each item's first: no resume point"
        assert first.attrs["fleetd.source"] == "reconcile"
        if second.attrs["fleetd.source"] == "hint":
            # A hint goes out once the release is answered, which ends the tenure.  (Found otherwise, b's
            # tenure may begin before a's release answer arrives: the traces may overlap by that much.)
            assert first.end_ns <= second.start_ns, f"{cid}: b's tenure began before a's ended"
        assert first.attrs["fleetd.last_seq"] >= 3
        assert second.attrs["fleetd.resume_seq"] == first.attrs["fleetd.last_seq"], \
            f"{cid}: b resumed from a's final checkpoint"
        epochs = (first.attrs["fleetd.lease_epoch"], second.attrs["fleetd.lease_epoch"])
        if first.attrs["fleetd.end_reason"] == "handed_over":
            # The push moves the epoch (a's writes are fenced by it), and b's adopting claim moves it again.
            handed += 1
            assert first.attrs["fleetd.handed_to"] == second.attrs["fleetd.session_id"], cid
            assert second.attrs["fleetd.source"] == "handed" and epochs[1] == epochs[0] + 2, (cid, epochs)
        elif first.attrs["fleetd.end_reason"] == "offer_taken":
            # At SIGTERM a offers its streams and b takes each with one write, naming a's session.
            offered += 1
            assert second.attrs["fleetd.source"] == "offer", (cid, second.attrs["fleetd.source"])
            assert second.attrs["fleetd.taken_from"] == first.attrs["fleetd.session_id"], cid
            assert epochs[1] == epochs[0] + 1, (cid, epochs)
        else:
            released += 1  # what no peer took from the offers within their wait
            assert first.attrs["fleetd.end_reason"] == "shutdown", cid
            assert first.attrs["fleetd.release_result"] == "won", cid
            # Claimed through a's hints, or by b's reconcile if that ran first (it wakes when a session it
            # saw is due to expire, and a's was: a live session's expiry is within b's long horizon).
            assert second.attrs["fleetd.source"] in ("hint", "reconcile"), (cid, second.attrs["fleetd.source"])
            assert epochs[1] == epochs[0] + 1, (cid, epochs)
        assert second.attrs["fleetd.end_reason"] == "shutdown", cid
        assert second.attrs["fleetd.release_result"] == "won", cid
    print(f"tenures: {handed} streams handed over by rebalancing, {offered} taken from a's offers and "
          f"{released} released at SIGTERM")
    assert handed >= 5 and offered + released >= 1, (handed, offered, released)

    # The rounds that claimed a's streams are exported, linked from the tenures; the idle ones are not.
    spans = {s.span_id: s for s in receiver.spans()}
    rounds = [s for s in spans.values() if s.name == "reconcile_round"]
    linked = {link for t in receiver.spans("tenure") for link in t.links}
    parents = {s.parent for s in spans.values()}
    assert rounds and all(r.span_id in linked or r.span_id in parents for r in rounds), "an idle round exported"
    assert all(spans[link].name in ("reconcile_round", "takeover") for link in linked if link in spans)
    moves = [s for s in spans.values() if s.name == "hand_over"]
    assert sum(m.attrs["fleetd.moved"] for m in moves) == handed
    assert {m.resource["fleetd.task_id"] for m in moves} == {"a"}
    shutdowns = {s.resource["fleetd.task_id"]: s for s in spans.values() if s.name == "shutdown"}
    assert set(shutdowns) == {"a", "b"} and shutdowns["a"].attrs["fleetd.held"] == offered + released
    phases = {e[1]["fleetd.phase"]: e[1]["fleetd.outcome"] for e in shutdowns["a"].events if e[0] == "phase"}
    assert phases["hand_over"] == phases["release"] == "done", phases
    assert {"fence_remaining", "end_session"} <= set(phases), phases
