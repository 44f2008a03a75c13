"""Fault injection, part 2: upstream chaos, clock skew, process kills and garbage items (issue #7).

Five scenarios, each a series of randomized trials against real processes: the fake upstream
(:mod:`bench.upstream`), the local DynamoDB/SQS stack and fleetd shards — child processes, or a thread of
this process where the scenario must read the shard's counters.  Every trial is judged by
:func:`bench.audit.check` (SPEC §6: no missing seq, no double streaming, i.e. no overlapping write
windows and never two sockets at once on one upstream stream), by the shards staying up, and by their
logs holding no traceback nor any error that is not an expected, handled condition.  Each trial is
recorded with :func:`tests.faults.record.record` along with its worst recovery time.

``pytest --long`` runs 20 trials per scenario, CI runs 2.  Randomness is seeded: the seed is printed
and recorded, and ``FLEETD_FAULTS_SEED=N`` replays a run's choices (not its timing).

Recovery (``recovery_s``) is always measured on the fake upstream (one clock): from the end of the
fault until every stream has a client attached and is being sent new frames again; each test says
what "end of the fault" is.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import os
import random
import signal
import subprocess
import time
import urllib.request
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson
import pytest
from botocore.exceptions import ClientError, ParamValidationError
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisDeprecationWarning

from bench.audit import Verdict, check
from bench.profile import fast, fast_env
from fleetd.config import Config, LeaseConfig
from fleetd.schema import HELD_BY_SESSION, SESSION_KIND
from tests.faults.record import record
from tests.fleet import (
    FleetdProc,
    ShardThread,
    UpstreamProc,
    audit,
    ddb,
    owners,
    scan_all,
    seed_items,
    start_shard,
    stop_all,
    wait_for,
)

SEED = int(os.environ.get("FLEETD_FAULTS_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
LONG_TRIALS = 20
CI_TRIALS = 2
# pytest-timeout's 300 s default is too short for 20 trials (20 × 30 s of flapping alone); in CI every
# wait inside a trial is bounded anyway.
LONG_TIMEOUT_S = 1800

# Logged at ERROR for conditions fleetd handles: picows reports a frame it refuses (too big, protocol
# error) at ERROR (logger ``picows.upstream.<n>``) before it closes the socket with 1009 / 1002, and fleetd
# counts it and reconnects.
HANDLED_ERRORS = (("picows.upstream", "WS parser error"),)


@contextlib.contextmanager
def _quiet_hypothesis() -> Iterator[None]:
    """A shard thread's own use of `random` (claim shuffles) trips hypothesis' check for strategies that
    use the global random module while it generates; that is not our strategies' doing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisDeprecationWarning)
        yield


def trials(long_run: bool, ci: int = CI_TRIALS) -> int:
    return LONG_TRIALS if long_run else ci


def rng_for(scenario: str, trial: int) -> random.Random:
    return random.Random(f"{SEED}/{scenario}/{trial}")


@pytest.fixture(autouse=True)
def _announce_seed() -> None:
    print(f"chaos seed {SEED} (FLEETD_FAULTS_SEED={SEED} replays the random choices)")


# ---------------------------------------------------------------------------------------- judging


def log_problems(records: Iterable[dict[str, Any]]) -> list[str]:
    """Log lines that betray an unhandled exception or an unexpected error."""
    bad = []
    for r in records:
        if "raw" in r:  # not a JSON log line: a traceback or a warning printed by Python itself
            bad.append(str(r["raw"]))
            continue
        logger, event, level = str(r.get("logger", "")), str(r.get("event", "")), r.get("level")
        handled = any((logger == name or logger.startswith(name + ".")) and event.startswith(prefix)
                      for name, prefix in HANDLED_ERRORS)
        # picows catches an exception raised by our listener and logs it at WARNING: still a fleetd bug.
        raised = "exc" in r or "Traceback" in event or (logger.startswith("picows") and "exception" in event)
        if raised or (level in ("ERROR", "CRITICAL") and not handled):
            bad.append(orjson.dumps(r).decode()[:2000])
    return bad


_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class LogTrap(logging.Handler):
    """Collects WARNING+ records of a shard running in this process, shaped like its JSON log lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        row: dict[str, Any] = {"level": record.levelname, "logger": record.name, "event": record.getMessage()}
        row.update({k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS and not k.startswith("_")})
        if record.exc_info:
            row["exc"] = logging.Formatter().formatException(record.exc_info)
        self.records.append(row)


@pytest.fixture
def log_trap() -> Iterator[LogTrap]:
    trap = LogTrap()
    root = logging.getLogger()
    root.addHandler(trap)
    try:
        yield trap
    finally:
        root.removeHandler(trap)


def judge(cfg: Config, up: UpstreamProc, ids: list[str], margin_ms: int, lag: int = 25,
          clock_offset_ms: Callable[[str], int] | None = None) -> Verdict:
    """The SPEC §6 verdict over ``ids``, after asserting that each is written up to near its upstream.

    ``clock_offset_ms(session_id)``: the clock skew injected into that session's shard.  Write windows
    are stamped by the writers' clocks; taking the injected skew back out puts every window on one
    clock, so the overlap check stays as strict as without skew (``margin_ms`` alone cannot do that: a
    short window of the earlier owner, stamped by a fast clock, sorts after the next owner's start).
    """
    streams = {cid: s for cid, s in up.stats().items() if cid in set(ids)}
    report = audit(cfg, ids)
    if clock_offset_ms is not None:
        report.writers = {cid: {sess: (first - clock_offset_ms(sess), last - clock_offset_ms(sess))
                                for sess, (first, last) in by_session.items()}
                          for cid, by_session in report.writers.items()}
    never = sorted(set(ids) - set(report.seqs))
    assert not never, f"never written: {never[:5]}"
    behind = {cid: streams[cid]["produced"] - max(report.seqs[cid]) for cid in ids}
    behind = {cid: n for cid, n in behind.items() if n > lag}
    assert not behind, f"streams far behind their upstream: {list(behind.items())[:5]}"
    return check(report, streams, margin_ms)


def assert_ok(verdict: Verdict, what: str, cfg: Config | None = None) -> None:
    if verdict.ok:
        return
    detail = "".join(f"\n  {cid}: {runs}" for cid, runs in writer_runs(cfg, verdict).items()) if cfg else ""
    raise AssertionError(f"{what}: invariants violated: {verdict.summary()}{detail}")


def writer_runs(cfg: Config, verdict: Verdict, limit: int = 3) -> dict[str, list[tuple[str, int, int, int, int]]]:
    """For a few offenders: who wrote which seqs when, as runs of (session, first seq, last seq, first
    received_at_ms, last received_at_ms) in seq order."""
    wanted = list({*verdict.overlaps, *verdict.missing})[:limit]
    out: dict[str, list[tuple[str, int, int, int, int]]] = {}
    items = scan_all(cfg.aws.messages_table, ProjectionExpression="connection_id, seq, session_id, received_at_ms")
    for cid in wanted:
        rows = sorted((int(i["seq"]["N"]), i["session_id"]["S"], int(i["received_at_ms"]["N"]))
                      for i in items if i["connection_id"]["S"] == cid)
        runs: list[tuple[str, int, int, int, int]] = []
        for seq, sess, at in rows:
            if runs and runs[-1][0] == sess and runs[-1][2] == seq - 1:
                runs[-1] = (sess, runs[-1][1], seq, runs[-1][3], at)
            else:
                runs.append((sess, seq, seq, at, at))
        out[cid] = runs
    return out


def wait_streaming(up: UpstreamProc, ids: list[str], since: float, timeout_s: float) -> float:
    """Wait until every stream has one client and is sent new frames; seconds elapsed since ``since``."""
    sent = {cid: s["sent"] for cid, s in up.stats().items()}

    def all_streaming() -> bool:
        stats = up.stats()
        return all(c in stats and stats[c]["attached"] == 1 and stats[c]["sent"] > sent.get(c, 0) for c in ids)

    try:
        wait_for(all_streaming, timeout_s, 0.1, "every stream attached and streaming")
    except AssertionError as e:
        stats = up.stats()
        stuck = {c: {k: stats[c][k] for k in ("attached", "sent", "produced")} if c in stats else None
                 for c in ids if c not in stats or stats[c]["attached"] != 1 or stats[c]["sent"] <= sent.get(c, 0)}
        raise AssertionError(f"{e}; not streaming: {dict(list(stuck.items())[:5])}") from None
    return time.monotonic() - since


def settle_sink() -> None:
    """Let the sinks write what they received (linger 50 ms, retries) before the table is audited."""
    time.sleep(1.5)


# ---------------------------------------------------------------------------------------- a fleet of shard processes


@dataclass
class Fleet:
    """Shard processes over one upstream; each incarnation of a slot runs as its own task id."""

    cfg: Config
    log_dir: Path
    up: UpstreamProc
    ids: list[str]
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, FleetdProc] = field(default_factory=dict)  # slot → current process
    task: dict[str, str] = field(default_factory=dict)  # slot → current task id
    dead: list[FleetdProc] = field(default_factory=list)  # earlier incarnations (logs are still checked)
    clock_offsets: dict[str, int] = field(default_factory=dict)  # task id → FLEETD_CLOCK_OFFSET_MS
    incarnation: int = 0

    def start(self, slot: str, clock_offset_ms: int = 0) -> FleetdProc:
        self.incarnation += 1
        task = f"{slot}i{self.incarnation}"
        proc = start_shard(self.cfg, self.log_dir, 0, task=task, **self.env,
                           FLEETD_CLOCK_OFFSET_MS=str(clock_offset_ms))
        self.procs[slot], self.task[slot] = proc, task
        self.clock_offsets[task] = clock_offset_ms
        return proc

    def offset_of(self, session_id: str) -> int:
        """The clock offset of the shard that ran ``session_id`` (``task/shard/nonce``)."""
        return self.clock_offsets[session_id.split("/", 1)[0]]

    def wait_started(self, *slots: str) -> None:
        pending = [self.procs[slot] for slot in slots or tuple(self.procs)]
        wait_for(lambda: all(_started(p) for p in pending), 30, 0.2, "shards to start")

    def slot_of(self, owner: str) -> str | None:
        task = owner.split("/", 1)[0]
        return next((s for s, t in self.task.items() if t == task), None)

    def holdings(self) -> Counter[str]:
        """slot → items owned by its current incarnation ('' = free or owned by anyone else)."""
        return Counter(self.slot_of(o) or "" for o in owners(self.cfg).values())

    def assert_alive(self) -> None:
        for slot, proc in self.procs.items():
            code = proc.proc.poll()
            assert code is None, f"shard {slot} exited with {code}; log tail: {proc.logs()[-5:]}"

    def problems(self) -> list[str]:
        return [p for proc in [*self.dead, *self.procs.values()] for p in log_problems(proc.logs())]

    def retire(self, slot: str) -> FleetdProc:
        proc = self.procs.pop(slot)
        self.dead.append(proc)
        return proc

    def stop(self) -> None:
        """Graceful stop of every shard (each must exit 0), then the logs must be clean."""
        for proc in self.procs.values():
            proc.signal(signal.SIGTERM)
        codes = {slot: proc.wait(30) for slot, proc in self.procs.items()}
        assert all(c == 0 for c in codes.values()), f"exit codes {codes}"
        problems = self.problems()
        assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])

    def close(self) -> None:
        stop_all(*self.procs.values(), *self.dead)


def _started(proc: FleetdProc) -> bool:
    return any(r.get("event") == "shard started" for r in proc.logs())


def make_fleet(cfg: Config, tmp_path: Path, n_conns: int, rate: float, prefix: str = "c") -> Fleet:
    up = UpstreamProc(tmp_path, rate=rate)
    ids = [f"{prefix}{i:04d}" for i in range(n_conns)]
    seed_items(cfg, {cid: up.url(cid) for cid in ids})
    return Fleet(cfg, tmp_path, up, ids)


def all_owned_by_live(fleet: Fleet) -> bool:
    return fleet.holdings().get("", 0) == 0


# ======================================================================================= 1. upstream flapping


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_upstream_flapping_keeps_leases_and_loses_nothing(cfg: Config, tmp_path: Path, long_run: bool) -> None:
    """The upstream drops every socket every 2-5 s (sometimes refusing handshakes too) for a while:
    every stream resumes without a gap, never two sockets at once, and no lease moves.

    Recovery: from the last drop (or the end of the last refusal) of the trial."""
    fleet = make_fleet(cfg, tmp_path, 40, rate=5.0)
    # Both shards full (20 + 20): they hold some each, and a full fleet has nothing to rebalance,
    # so any lease that moves during a trial was moved by the flapping.
    fleet.env = {"FLEETD_MAX_CONNECTIONS_PER_SHARD": "20"}
    try:
        fleet.start("a")
        fleet.start("b")
        fleet.wait_started()
        wait_for(lambda: all_owned_by_live(fleet), 30, 0.25, "all 40 claimed")
        wait_streaming(fleet.up, fleet.ids, time.monotonic(), 20)
        assert len(fleet.holdings()) == 2, f"both shards should hold some: {fleet.holdings()}"
        for trial in range(trials(long_run)):
            _flapping_trial(fleet, trial, 30.0 if long_run else 8.0)
        fleet.stop()
    finally:
        fleet.close()
        fleet.up.stop()


def _flapping_trial(fleet: Fleet, trial: int, duration_s: float) -> None:
    rng = rng_for("upstream_flapping", trial)
    before = owners(fleet.cfg)
    drops = refusals = 0
    end = time.monotonic() + duration_s
    last_chaos = time.monotonic()
    while time.monotonic() < end:
        time.sleep(rng.uniform(2.0, 5.0))
        refuse_s = rng.uniform(0.1, 1.0) if rng.random() < 0.4 else 0.0
        if refuse_s:
            fleet.up.post("/refuse?on=1")
        fleet.up.post("/drop")
        drops += 1
        if refuse_s:
            time.sleep(refuse_s)
            fleet.up.post("/refuse?on=0")
            refusals += 1
        last_chaos = time.monotonic()
    recovery = wait_streaming(fleet.up, fleet.ids, last_chaos, 20)
    settle_sink()
    fleet.assert_alive()
    verdict = judge(fleet.cfg, fleet.up, fleet.ids, margin_ms=1000)
    after = owners(fleet.cfg)
    moved = {cid: (o, after.get(cid)) for cid, o in before.items() if after.get(cid) != o}
    record("upstream_flapping", trial, verdict, round(recovery, 3), seed=SEED, drops=drops, refusals=refusals,
           leases_moved=len(moved))
    print(f"flapping trial {trial}: {drops} drops ({refusals} with refusal), recovered in {recovery:.2f} s, "
          f"{verdict.summary()['written']} written")
    assert_ok(verdict, f"flapping trial {trial}", fleet.cfg)
    assert not moved, f"a flapping upstream moved leases: {list(moved.items())[:5]}"
    problems = fleet.problems()
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])


# ======================================================================================= 2. fuzzed frames

MAX_FRAME = 65_536  # the fuzzed shard's max_frame_bytes: oversized frames stay cheap to send
FUZZ_STREAMS = 16
FUZZ_FRAMES_LONG = 500  # per trial: 20 trials → 10,000 fuzzed frames
FUZZ_FRAMES_CI = 500  # 2 trials → 1,000

Wire = dict[str, Any]  # one frame of a POST /frames group


def wire(first: int, payload: bytes = b"", pad: int = 0, masked: bool = False) -> Wire:
    frame: Wire = {"first": first, "payload": base64.b64encode(payload).decode()}
    if pad:
        frame["pad"] = pad
    if masked:
        frame["masked"] = True
    return frame


@dataclass(frozen=True)
class Fuzz:
    """One fuzzed message: its frames and the counters fleetd must bump for it."""

    kind: str
    frames: tuple[Wire, ...]
    expect: tuple[str, ...]  # reject reasons, or "duplicate"; empty: nothing to count
    killer: bool = False  # fleetd must hang up on it (so it ends its group)
    dribble: int = 0  # > 0: an endless fragmented message of this many bytes (sent by the upstream itself)


def _is_json(data: bytes) -> bool:
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return True


def _has_int_seq(data: bytes) -> bool:
    obj = orjson.loads(data)
    return type(obj) is dict and type(obj.get("seq")) is int


_CHARS = st.characters(exclude_categories=["Cs"])  # lone surrogates cannot be encoded at all
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_texts = st.text(_CHARS, max_size=12)
_scalars = st.none() | st.booleans() | _ints | st.floats(allow_nan=False, allow_infinity=False) | _texts
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_texts, kids, max_size=3),
                     max_leaves=8)

MALFORMED = st.one_of(
    st.binary(max_size=200).filter(lambda b: not _is_json(b)),
    _json.map(orjson.dumps).map(lambda b: b[: max(0, len(b) - 1)] + b"\x00"),  # truncated, NUL-terminated
    _json.map(lambda v: orjson.dumps(v) + b" trailing"),
    st.sampled_from([b"", b"NaN", b'{"seq": NaN}', b"{'seq': 1}", b'{"seq": 1,}', b'\xff\xfe{"seq": 1}',
                     b'{"seq": 1e999}', b'{"seq": "\xed\xa0\x80"}', b"[" * 2000]),
).filter(lambda b: not _is_json(b))

_seqless = st.dictionaries(_texts.filter(lambda k: k != "seq"), _json, max_size=3)
_wrong_seq = st.one_of(_texts, st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                       st.lists(_ints, max_size=2), st.dictionaries(_texts, _ints, max_size=2))
NOSEQ = st.one_of(
    _json.filter(lambda v: not isinstance(v, dict)).map(orjson.dumps),  # JSON, not an object
    _seqless.map(orjson.dumps),
    st.builds(lambda s, rest: orjson.dumps({**rest, "seq": s}), _wrong_seq, _seqless),
    st.integers(min_value=2**64, max_value=2**80).map(lambda n: b'{"seq": %d}' % n),  # parses as a float
).filter(lambda b: _is_json(b) and not _has_int_seq(b))

BAD_SEQ = st.one_of(st.integers(min_value=-(2**63), max_value=-1),
                    st.integers(min_value=2**53, max_value=2**64 - 1)).map(lambda n: b'{"seq":%d,"data":"bad"}' % n)
STALE = st.integers(min_value=0, max_value=1).map(lambda n: b'{"seq":%d,"data":"stale"}' % n)


@st.composite
def _text_message(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(kind, payload, expected reason) of a complete bad text message."""
    kind = draw(st.sampled_from(["malformed", "noseq", "bad_seq", "duplicate"]))
    payload = draw({"malformed": MALFORMED, "noseq": NOSEQ, "bad_seq": BAD_SEQ, "duplicate": STALE}[kind])
    return kind, payload, kind


def _split(draw: st.DrawFn, payload: bytes, pieces: int) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *cuts, len(payload)]
    return [payload[a:b] for a, b in itertools.pairwise(bounds)]


def _fragments(draw: st.DrawFn, first_opcode: int, payload: bytes, pings: bool = True) -> list[Wire]:
    parts = _split(draw, payload, draw(st.integers(2, 5)))
    frames = []
    for i, part in enumerate(parts):
        opcode = first_opcode if i == 0 else 0x0
        frames.append(wire(opcode | (0x80 if i == len(parts) - 1 else 0), part))
        if pings and i < len(parts) - 1 and draw(st.booleans()):
            frames.append(wire(0x89, draw(st.binary(max_size=125))))  # control frames may come between
    return frames


@st.composite
def plain_fuzz(draw: st.DrawFn) -> Fuzz:
    """A bad message after which the connection goes on."""
    shape = draw(st.sampled_from(["text", "text", "text", "fragmented", "binary", "binary_fragmented",
                                  "interrupted", "stray_continuation", "control"]))
    if shape in ("text", "fragmented", "interrupted"):
        kind, payload, reason = draw(_text_message())
        if shape == "text":
            return Fuzz(kind, (wire(0x81, payload),), (reason,))
        if shape == "fragmented":
            return Fuzz(f"fragmented_{kind}", tuple(_fragments(draw, 0x1, payload)), (reason,))
        # A new message before the previous one's last fragment (RFC 6455 §5.4 forbids it).
        partial = wire(0x01, draw(st.binary(max_size=50)))
        return Fuzz(f"interrupted_{kind}", (partial, wire(0x81, payload)), ("protocol", reason))
    if shape == "binary":
        return Fuzz("binary", (wire(0x82, draw(st.binary(max_size=300))),), ("binary",))
    if shape == "binary_fragmented":
        return Fuzz("binary_fragmented", tuple(_fragments(draw, 0x2, draw(st.binary(min_size=2, max_size=300)),
                                                          pings=False)), ("binary",))
    if shape == "stray_continuation":
        return Fuzz("stray_continuation", (wire(draw(st.sampled_from([0x00, 0x80])), draw(st.binary(max_size=50))),),
                    ("protocol",))
    return Fuzz("control", (wire(draw(st.sampled_from([0x89, 0x8A])), draw(st.binary(max_size=125))),), ())


KILLERS = ("protocol", "dribble", "endless_fragments", "oversized_fragments", "oversized_text", "oversized_binary",
           "close")


@st.composite
def killer_fuzz(draw: st.DrawFn) -> Fuzz:
    """A message fleetd (or picows) must hang up on; the stream then resumes from the last seq."""
    # Not sampled_from: each short run of examples starts simple, which would favour the first shape.
    shape = KILLERS[draw(st.integers(0, 2**16 - 1)) % len(KILLERS)]
    over = draw(st.integers(1, 40_000))
    if shape == "oversized_text":
        return Fuzz(shape, (wire(0x81, b'{"seq":1,"data":"', pad=MAX_FRAME + over),), ("oversized",), True)
    if shape == "oversized_binary":
        return Fuzz(shape, (wire(0x82, pad=MAX_FRAME + over),), ("oversized",), True)
    if shape in ("oversized_fragments", "endless_fragments"):
        # Each fragment is within max_frame_size; together they are not.  "endless": no final fragment.
        chunk = draw(st.integers(8_000, 30_000))
        n = (MAX_FRAME + over) // chunk + 1
        last = 0x80 if shape == "oversized_fragments" else 0x00
        frames = [wire(0x01, pad=chunk)] + [wire(0x00, pad=chunk) for _ in range(n - 2)] + [wire(last, pad=chunk)]
        return Fuzz(shape, tuple(frames), ("oversized",), True)
    if shape == "dribble":
        return Fuzz(shape, (), ("oversized",), True, dribble=MAX_FRAME + over)
    if shape == "protocol":
        return Fuzz(shape, (draw(st.sampled_from([
            wire(0x80 | draw(st.sampled_from([3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF])), b"?"),  # reserved opcode
            wire(0x81, b"{}", masked=True),  # servers must not mask
            wire(0x89, b"p" * draw(st.integers(126, 2000))),  # control frame over 125 bytes
            wire(0x09, b"ping"),  # fragmented control frame
            wire(0x88, b"x"),  # CLOSE with a one-byte body
            wire(0x88, draw(st.sampled_from([999, 1005])).to_bytes(2, "big")),  # close codes picows refuses
        ])),), ("protocol",), True)
    # A plain CLOSE (0 reads as "no code"): fleetd answers, hangs up and resumes; nothing to count.  Codes
    # RFC 6455 §7.4 does not allow on the wire that picows passes on: counted, answered with 1002.
    code = draw(st.sampled_from([1000, 1001, 1011, 4000, 0, 1006, 1015, 2999, 5000]))
    bad = code in (1006, 1015, 2999, 5000)
    return Fuzz("close", (wire(0x88, code.to_bytes(2, "big") + b"bye"),), ("protocol",) if bad else (), True)


@st.composite
def fuzz_batch(draw: st.DrawFn, ids: list[str]) -> tuple[str, list[Fuzz]]:
    """Up to 8 bad messages for one stream, followed one time in ten by a killer."""
    items = draw(st.lists(plain_fuzz(), max_size=8))
    if draw(st.integers(0, 9)) == 0:
        items.append(draw(killer_fuzz()))
    return draw(st.sampled_from(ids)), items


def post_frames(up: UpstreamProc, groups: list[dict[str, Any]]) -> list[int]:
    req = urllib.request.Request(up.control + "/frames", method="POST", data=orjson.dumps(groups))
    with urllib.request.urlopen(req, timeout=10) as resp:
        return list(orjson.loads(resp.read())["sent"])


def send_batch(up: UpstreamProc, sid: str, items: list[Fuzz]) -> list[Fuzz]:
    """Send one batch to ``sid``; returns the messages its client got (none if it was not attached)."""
    plain = [f for f in items if not f.dribble]
    groups: list[dict[str, Any]] = []
    if plain:
        groups.append({"id": sid, "frames": [w for f in plain for w in f.frames], "seal": plain[-1].killer})
    if items and items[-1].dribble:
        groups.append({"id": sid, "dribble": items[-1].dribble, "chunk": 16_384})
    sent = post_frames(up, groups) if groups else []
    delivered = plain if plain and sent[0] else []
    if items and items[-1].dribble and sent[-1]:
        delivered.append(items[-1])
    return delivered


REJECT_REASONS = ("malformed", "binary", "noseq", "bad_seq", "oversized", "protocol")


def fuzz_counters(st_: ShardThread) -> Counter[str]:
    c: Counter[str] = Counter({r: int(st_.counter("upstream_frames_rejected_total", reason=r))
                               for r in REJECT_REASONS})
    c["duplicate"] = int(st_.counter("upstream_duplicates_total"))
    return c


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_fuzzed_frames_are_counted_and_streams_lose_nothing(
        cfg: Config, tmp_path: Path, long_run: bool, log_trap: LogTrap) -> None:
    """Thousands of hypothesis-generated bad frames between real ones: each is counted under the right
    reason, a frame fleetd must hang up on (oversized, endless fragments, protocol errors) costs only a
    reconnect with resume, and every stream's real frames all reach the table.

    Recovery: from the trial's last batch of bad frames."""
    up = UpstreamProc(tmp_path, rate=20.0)
    ids = [f"f{i:03d}" for i in range(FUZZ_STREAMS)]
    seed_items(cfg, {cid: up.url(cid) for cid in ids})
    shard = ShardThread(fast(cfg, max_frame_bytes=MAX_FRAME))
    try:
        wait_streaming(up, ids, time.monotonic(), 30)
        wait_for(lambda: all(s["sent"] >= 5 for s in up.stats().values()), 10, 0.1, "5 frames on every stream")
        per_trial = FUZZ_FRAMES_LONG if long_run else FUZZ_FRAMES_CI
        total = 0
        for trial in range(trials(long_run)):
            total += _fuzz_trial(cfg, up, ids, shard, trial, per_trial, log_trap)
        print(f"fuzzed messages delivered: {total}")
    finally:
        code = shard.stop()
        up.stop()
    assert code == 0
    problems = log_problems(log_trap.records)
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])


def _fuzz_trial(cfg: Config, up: UpstreamProc, ids: list[str], shard: ShardThread, trial: int, quota: int,
                log_trap: LogTrap) -> int:
    pace = rng_for("fuzzed_frames", trial)
    before = fuzz_counters(shard)
    expected: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    delivered = 0

    @settings(max_examples=40, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=fuzz_batch(ids))
    def send(batch: tuple[str, list[Fuzz]]) -> None:
        nonlocal delivered
        if delivered >= quota:
            return
        got = send_batch(up, *batch)
        delivered += len(got)
        for f in got:
            expected.update(f.expect)
            kinds[f.kind] += 1
        time.sleep(pace.uniform(0.0, 0.02))  # let real frames in between

    round_ = 0
    while delivered < quota:
        with _quiet_hypothesis():
            seed(pace.randrange(2**32))(send)()
        round_ += 1
        assert round_ < 100, f"only {delivered} fuzzed messages delivered"
    recovery = wait_streaming(up, ids, time.monotonic(), 30)
    wait_for(lambda: all(s["sent"] >= s["produced"] - 2 for s in up.stats().values()), 20, 0.1, "caught up")
    settle_sink()
    got = fuzz_counters(shard) - before
    verdict = judge(cfg, up, ids, margin_ms=1000)
    record("fuzzed_frames", trial, verdict, round(recovery, 3), seed=SEED, fuzzed=delivered,
           kinds=dict(kinds), counted=dict(got), expected=dict(expected))
    killers = {k: v for k, v in kinds.items() if k in KILLERS}
    print(f"fuzz trial {trial}: {delivered} messages ({sum(killers.values())} killers: {killers}); counted "
          f"{dict(got)}, expected {dict(expected)}; all streaming {recovery:.2f} s after the last")
    assert_ok(verdict, f"fuzz trial {trial}", cfg)
    assert shard.thread.is_alive(), "the shard died"
    for reason in (*REJECT_REASONS, "duplicate"):
        assert got[reason] == expected[reason], f"{reason}: counted {got[reason]}, sent {expected[reason]}"
    problems = log_problems(log_trap.records)
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])
    return delivered




# ======================================================================================= 3. clock skew

# Over the fast profile: a 2 s margin (the assumed maximum skew) so that ±1.5 s of skew stays below it,
# the TTL 2 s longer with it; 40 streams a shard, so that the two survivors of a trial hold all 60.
SKEW_SETTINGS: dict[str, Any] = {"lease_ttl_s": 8.0, "safety_margin_s": 2.0, "max_connections_per_shard": 40}
SKEW = fast(**SKEW_SETTINGS)
SKEW_MS = int(SKEW.lease.safety_margin_s * 1000) - 500  # margin − 0.5 s


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_clock_skew_below_the_margin_never_double_streams(cfg: Config, tmp_path: Path, long_run: bool) -> None:
    """Three shards whose clocks are −1.5 s, 0 and +1.5 s off (margin 2 s); each trial kills or stops one
    at random and its peers take over: never two sockets on one stream, no seq lost.

    Recovery: from the signal (SIGKILL: the session expires first, TTL 8 s + margin)."""
    fleet = make_fleet(cfg, tmp_path, 60, rate=5.0)
    fleet.env = fast_env(**SKEW_SETTINGS)
    offsets = [-SKEW_MS, 0, SKEW_MS]
    rng_for("clock_skew", -1).shuffle(offsets)
    skew = dict(zip(("a", "b", "c"), offsets, strict=True))
    try:
        for slot, offset in skew.items():
            fleet.start(slot, clock_offset_ms=offset)
        fleet.wait_started()
        wait_for(lambda: all_owned_by_live(fleet), 30, 0.25, "all 60 claimed")
        wait_streaming(fleet.up, fleet.ids, time.monotonic(), 20)
        for trial in range(trials(long_run)):
            _skew_trial(fleet, skew, trial)
        fleet.stop()
    finally:
        fleet.close()
        fleet.up.stop()


def _skew_trial(fleet: Fleet, skew: dict[str, int], trial: int) -> None:
    rng = rng_for("clock_skew", trial)
    # The first two trials (all of CI) cover both signals; later ones draw them.
    sig = (signal.SIGKILL, signal.SIGTERM)[trial] if trial < 2 else rng.choice([signal.SIGKILL, signal.SIGTERM])
    victim = rng.choice(sorted(s for s, n in fleet.holdings().items() if s and n))
    fleet.procs[victim].signal(sig)
    hit = time.monotonic()
    fleet.procs[victim].wait(20)
    fleet.retire(victim)
    # SIGKILL: the session expires (TTL 8 s) and is seen dead margin (2 s) later on the peers' clocks.
    takeover_s = SKEW.lease.lease_ttl_s + SKEW.lease.safety_margin_s + 2 * SKEW_MS / 1000
    wait_for(lambda: all_owned_by_live(fleet), takeover_s + 6, 0.2, "peers to take over")
    recovery = wait_streaming(fleet.up, fleet.ids, hit, 20)
    fleet.start(victim, clock_offset_ms=skew[victim])
    fleet.wait_started(victim)
    settle_sink()
    fleet.assert_alive()
    verdict = judge(fleet.cfg, fleet.up, fleet.ids, margin_ms=1000, clock_offset_ms=fleet.offset_of)
    record("clock_skew", trial, verdict, round(recovery, 3), seed=SEED, signal=signal.Signals(sig).name,
           victim_offset_ms=skew[victim], offsets_ms=skew)
    print(f"skew trial {trial}: {signal.Signals(sig).name} to the {skew[victim]:+d} ms shard, "
          f"streaming again after {recovery:.2f} s")
    assert_ok(verdict, f"clock skew trial {trial}", fleet.cfg)
    problems = fleet.problems()
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])


# ======================================================================================= 4. SIGKILL during shutdown

KILL_ENV = {"FLEETD_MAX_CONNECTIONS_PER_SHARD": "40"}
BUDGET_S = fast().runtime.shutdown_budget_s
TAKEOVER_S = fast().lease.lease_ttl_s + fast().lease.safety_margin_s + fast().lease.reconcile_s
TAKEOVER_SLACK_S = 4.0


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_sigkill_at_random_points_of_shutdown(cfg: Config, tmp_path: Path, long_run: bool) -> None:
    """SIGTERM a shard, SIGKILL it after a random delay within the shutdown budget: its peers own and
    stream everything within TTL + margin + reconcile (+ slack), with no seq lost and no double stream.

    Recovery: from the SIGTERM (the victim stops renewing its session then)."""
    fleet = make_fleet(cfg, tmp_path, 60, rate=5.0)
    fleet.env = dict(KILL_ENV)
    try:
        for slot in ("a", "b", "c"):
            fleet.start(slot)
        fleet.wait_started()
        wait_for(lambda: all_owned_by_live(fleet), 30, 0.25, "all 60 claimed")
        wait_streaming(fleet.up, fleet.ids, time.monotonic(), 20)
        n = trials(long_run, ci=3)  # fast, slow-close and whole-budget kills
        for trial in range(n):
            _kill_trial(fleet, trial, n)
        fleet.stop()
    finally:
        fleet.close()
        fleet.up.stop()


# A graceful shutdown here takes ~0.2 s (close, drain, release, hints); with the upstream holding CLOSE
# echoes, ~2.3 s (each polite close waits its 2 s out).  Kill delays are drawn over those spans, so that
# they land before, during and after the releases; every third trial draws over the whole budget.
SHUTDOWN_SPAN_S = {"fast": 0.4, "slow_close": 3.0}


def _kill_plan(rng: random.Random, trial: int, n: int) -> tuple[str, float]:
    """(shutdown kind, kill delay): uniform over the span, stratified so few trials still spread out."""
    kind = "slow_close" if trial % 2 else "fast"
    span = BUDGET_S if trial % 3 == 2 else SHUTDOWN_SPAN_S[kind]
    strata = max(1, n // 2)
    return kind, span * ((trial // 2) % strata + rng.random()) / strata


def _kill_trial(fleet: Fleet, trial: int, n: int) -> None:
    rng = rng_for("kill_during_shutdown", trial)
    kind, delay = _kill_plan(rng, trial, n)
    dropped = rng.random() < 0.3  # the shutdown then meets connections mid-reconnect
    victim = rng.choice(sorted(s for s, n_ in fleet.holdings().items() if s and n_))
    fleet.up.post(f"/hold_close?on={int(kind == 'slow_close')}")
    if dropped:
        fleet.up.post("/drop")
        time.sleep(rng.uniform(0.0, 0.6))
    proc = fleet.procs[victim]
    proc.signal(signal.SIGTERM)
    termed = time.monotonic()
    try:
        code: int | None = proc.wait(delay)
    except subprocess.TimeoutExpired:
        code = None
        proc.signal(signal.SIGKILL)
        proc.wait(10)
    killed_after = time.monotonic() - termed
    fleet.up.post("/hold_close?on=0")
    fleet.retire(victim)
    phase = _shutdown_phase(proc, code)
    # The victim stopped renewing at SIGTERM: its session is dead TTL + margin later at the latest.
    wait_for(lambda: all_owned_by_live(fleet), TAKEOVER_S + TAKEOVER_SLACK_S + 5, 0.1, "peers to own everything")
    recovery = wait_streaming(fleet.up, fleet.ids, termed, 20)
    fleet.start(victim)
    fleet.wait_started(victim)
    settle_sink()
    fleet.assert_alive()
    verdict = judge(fleet.cfg, fleet.up, fleet.ids, margin_ms=1000)
    record("kill_during_shutdown", trial, verdict, round(recovery, 3), seed=SEED, shutdown=kind,
           kill_delay_s=round(delay, 3), killed_after_s=round(killed_after, 3), phase=phase, upstream_dropped=dropped)
    print(f"kill trial {trial}: {kind} shutdown, {phase} ({killed_after:.2f} s after SIGTERM, upstream dropped: "
          f"{dropped}); all streaming {recovery:.2f} s after SIGTERM")
    assert_ok(verdict, f"kill trial {trial}", fleet.cfg)
    assert code in (None, 0), f"graceful exit code {code}"
    assert recovery <= TAKEOVER_S + TAKEOVER_SLACK_S, f"takeover took {recovery:.2f} s"
    problems = fleet.problems()
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])


def _shutdown_phase(proc: FleetdProc, code: int | None) -> str:
    """How far the victim's shutdown got before the SIGKILL, from its log."""
    if code is not None:
        return "exited before the kill"
    events = [str(r.get("event")) for r in proc.logs()]
    if "shutting down" not in events:
        return "killed before the shutdown began"
    return "killed after its last log line" if "shard stopped" in events else "killed during the shutdown"


# ======================================================================================= 5. garbage items

GOOD_PER_TRIAL = 8
SOUP_PER_TRIAL = 12
# More than a claim step looks at (2 × want + 10 = 310 at capacity 3000), sorted ahead of every good item by
# their negative expiry: they must not starve the good ones.
UNCLAIMABLE_MANY = 400
_NAMES = ["ws_url", "desired_state", "lease_owner", "lease_epoch", "lease_expires_at_ms", "last_seq",
          "created_at_ms", "updated_at_ms", "last_error", "attempts"]


def _ddb_value() -> st.SearchStrategy[dict[str, Any]]:
    text = st.text(_CHARS, max_size=40)
    number = st.one_of(st.integers(-(10**15), 10**15), st.decimals(-(10**9), 10**9, places=3)).map(str)
    scalar = st.one_of(text.map(lambda s: {"S": s}), number.map(lambda n: {"N": n}),
                       st.binary(max_size=16).map(lambda b: {"B": b}), st.booleans().map(lambda b: {"BOOL": b}),
                       st.just({"NULL": True}),
                       st.sets(text, min_size=1, max_size=3).map(lambda s: {"SS": sorted(s)}),
                       st.sets(number, min_size=1, max_size=3).map(lambda s: {"NS": sorted(s)}))
    return st.recursive(scalar, lambda kids: st.lists(kids, max_size=3).map(lambda v: {"L": v})
                        | st.dictionaries(text.filter(bool), kids, max_size=3).map(lambda v: {"M": v}), max_leaves=6)


SOUP = st.dictionaries(st.sampled_from(_NAMES) | st.text(min_size=1, max_size=12), _ddb_value(), max_size=6)


def _bad_urls(up: UpstreamProc, trial: int) -> list[tuple[str, dict[str, Any] | None]]:
    """ws_url values that must leave the item parked (None: attribute missing)."""
    # A 300 KB item makes every scan and desired-state sweep that much heavier: one every 10 trials.
    huge = [("huge", {"S": "ws://h.example/" + "a" * 300_000})] if trial % 10 == 0 else []
    return [*huge,
        ("missing", None), ("empty", {"S": ""}), ("number", {"N": "5"}), ("map", {"M": {"u": {"S": "ws://x/"}}}),
        ("list", {"L": [{"S": up.url("x")}]}), ("bool", {"BOOL": True}), ("null", {"NULL": True}),
        ("bytes", {"B": b"ws://"}), ("garbage", {"S": "::not a url::"}), ("https", {"S": "https://example.com/"}),
        ("ftp", {"S": "ftp://example.com/x"}), ("spaces", {"S": " ws://exa mple.com/ "}),
        ("userinfo", {"S": "ws://user:pw@example.com/"}),
    ]


@dataclass
class BadItems:
    """What one trial wrote and what fleetd must make of it."""

    good: dict[str, str] = field(default_factory=dict)  # connection id → its upstream stream id
    bad_url: list[str] = field(default_factory=list)
    unparseable: list[str] = field(default_factory=list)
    unclaimable: list[str] = field(default_factory=list)
    invisible: list[str] = field(default_factory=list)  # never a candidate for claiming
    soup: list[str] = field(default_factory=list)
    refused: int = 0  # items DynamoDB itself rejected (e.g. an index key of the wrong type)

    def put_many(self, table: str, bucket: list[str], items: list[dict[str, Any]]) -> None:
        """Items DynamoDB accepts as they are (no index key of a wrong type), 25 a call."""
        client = ddb()
        for i in range(0, len(items), 25):
            batch: dict[str, Any] = {table: [{"PutRequest": {"Item": it}} for it in items[i:i + 25]]}
            while batch:
                batch = client.batch_write_item(RequestItems=batch).get("UnprocessedItems") or {}
        bucket += [it["connection_id"]["S"] for it in items]

    def put(self, table: str, bucket: list[str] | None, item: dict[str, Any]) -> bool:
        try:
            ddb().put_item(TableName=table, Item=item)
        except (ClientError, ParamValidationError):
            self.refused += 1
            return False
        if bucket is not None:
            bucket.append(item["connection_id"]["S"])
        return True


# Good items may be odd and still valid: they must stream from seq 1 without loss.
_ODD_BUT_VALID: list[dict[str, Any]] = [
    {}, {"last_seq": {"N": "-3"}}, {"lease_epoch": {"N": "-7"}}, {"created_at_ms": {"S": "yesterday"}},
    {"last_error": {"M": {"x": {"L": []}}}, "attempts": {"S": "many"}}, {"last_seq": {"S": "12"}},
]


def _write_bad_items(cfg: Config, up: UpstreamProc, trial: int, rng: random.Random) -> BadItems:
    table, now = cfg.aws.connections_table, int(time.time() * 1000)
    out = BadItems()
    dead = f"dead{trial}/0/{uuid.uuid4().hex[:8]}"  # a session that died: its items are claimed from it

    def claimable(cid: str, url: dict[str, Any] | None, **extra: dict[str, Any]) -> dict[str, Any]:
        """A STARTED item, free, owned by the dead session or by an expired item-mode lease, at random."""
        item: dict[str, Any] = {"connection_id": {"S": cid}, "desired_state": {"S": "STARTED"},
                                "lease_epoch": {"N": str(rng.randint(0, 5))}}
        how = rng.choice(["free", "dead_session", "expired_item"])
        if how == "free":
            item["lease_expires_at_ms"] = {"N": "0"}
        elif how == "dead_session":
            item.update(lease_owner={"S": dead}, lease_expires_at_ms={"N": str(HELD_BY_SESSION)})
        else:
            item.update(lease_owner={"S": f"ghost/0/{trial}"}, lease_expires_at_ms={"N": str(now - 60_000)})
        if url is not None:
            item["ws_url"] = url
        return {**item, **extra}

    for i in range(GOOD_PER_TRIAL):
        sid = f"t{trial}-good{i}"
        cid = sid if i % 3 else f"t{trial} gööd/{i} ☃ " + "x" * rng.randint(0, 300)  # odd ids are fine too
        if out.put(table, None, claimable(cid, {"S": up.url(sid)}, **_ODD_BUT_VALID[i % len(_ODD_BUT_VALID)])):
            out.good[cid] = sid
    for name, url in _bad_urls(up, trial):
        out.put(table, out.bad_url, claimable(f"t{trial}-url-{name}", url))
    never = {"S": up.url("never")}
    out.put(table, out.unparseable, claimable(f"t{trial}-frac-epoch", never, lease_epoch={"N": "2.5"}))
    out.put(table, out.unparseable, claimable(f"t{trial}-frac-seq", never, last_seq={"N": "1.5"}))
    # ADD lease_epoch 1 fails on a string, so no claim can ever succeed; a negative expiry sorts first.
    out.put_many(table, out.unclaimable, [
        claimable(f"t{trial}-unclaimable{i}", never, lease_epoch={"S": "seven"}, lease_expires_at_ms={"N": "-1"})
        for i in range(UNCLAIMABLE_MANY if trial == 0 else rng.randint(1, 5))])
    for name, extra in (("no-state", {}), ("lower-state", {"desired_state": {"S": "started"}}),
                        ("no-expiry", {"desired_state": {"S": "STARTED"}}),
                        ("state-n", {"desired_state": {"N": "1"}, "lease_expires_at_ms": {"N": "0"}}),
                        ("expiry-s", {"desired_state": {"S": "STARTED"}, "lease_expires_at_ms": {"S": "0"}}),
                        ("owner-n", {"desired_state": {"S": "STARTED"}, "lease_expires_at_ms": {"N": "0"},
                                     "lease_owner": {"N": "1"}})):
        out.put(table, out.invisible, {"connection_id": {"S": f"t{trial}-{name}"}, "ws_url": never, **extra})
    _write_soup(table, trial, rng, out)
    # The dead session's own item last, as when a shard dies owning its items: a shard that finds it
    # dead claims its items and, once it owns none, deletes it (items given to it later would be lost).
    ddb().put_item(TableName=cfg.aws.sessions_table, Item={
        "session_id": {"S": dead}, "kind": {"S": SESSION_KIND}, "expires_at_ms": {"N": str(now - 60_000)}})
    return out


def _write_soup(table: str, trial: int, rng: random.Random, out: BadItems) -> None:
    """Random attribute soup from hypothesis on top of a claimable STARTED item."""
    n = 0

    @settings(max_examples=SOUP_PER_TRIAL, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(soup=SOUP)
    def put_soup(soup: dict[str, Any]) -> None:
        nonlocal n
        n += 1
        item = {"desired_state": {"S": "STARTED"}, "lease_expires_at_ms": {"N": "0"}, **soup,
                "connection_id": {"S": f"t{trial}-soup{n}"}}
        out.put(table, out.soup, item)

    with _quiet_hypothesis():
        seed(rng.randrange(2**32))(put_soup)()


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_garbage_items_are_parked_and_counted_while_good_ones_stream(
        cfg: Config, tmp_path: Path, long_run: bool, log_trap: LogTrap) -> None:
    """Items with garbage written straight into the table, next to good ones (free, or owned by a dead
    session or an expired lease): the shard stays up, parks and counts what it cannot stream without
    bouncing it, skips what it can never claim, and the good connections stream with no seq missing.

    Recovery: from the start of the writes until every good connection streams."""
    up = UpstreamProc(tmp_path, rate=5.0)
    # The full desired-state sweep (BatchGetItem of every held item) every second, so that each trial
    # sees several: an item it cannot parse must not be taken for deleted.
    sweep = {"desired_sweep_s": 1.0} if "desired_sweep_s" in {f.name for f in fields(LeaseConfig)} else {}
    shard = ShardThread(fast(cfg, **sweep, max_connections_per_shard=3000))
    try:
        wait_for(lambda: shard.shard.session_id, 20, 0.1, "the shard's session")
        for trial in range(trials(long_run)):
            _bad_items_trial(cfg, up, shard, trial, log_trap)
    finally:
        code = shard.stop()
        up.stop()
    assert code == 0


def _held_by_me(cfg: Config, shard: ShardThread, ids: Iterable[str]) -> bool:
    me, own = shard.shard.session_id, owners(cfg)
    return all(own.get(cid) == me for cid in ids)


def _bad_counts(shard: ShardThread) -> Counter[str]:
    counts = Counter({r: int(shard.counter("bad_items_total", reason=r))
                      for r in ("bad_url", "unparseable", "unclaimable")})
    counts["fatal_claims"] = int(shard.counter("dynamodb_requests_total", op="UpdateItem", outcome="fatal"))
    counts["lost"] = int(sum(v for (name, _), v in shard.shard.stats.counters.items() if name == "lease_lost_total"))
    return counts


def _bad_items_trial(cfg: Config, up: UpstreamProc, shard: ShardThread, trial: int, log_trap: LogTrap) -> None:
    rng = rng_for("bad_items", trial)
    before = _bad_counts(shard)
    written_at = time.monotonic()
    items = _write_bad_items(cfg, up, trial, rng)
    expect_held = [*items.good, *items.bad_url, *items.unparseable]
    try:
        wait_for(lambda: _held_by_me(cfg, shard, expect_held), 30, 0.5, "good, bad-url and unparseable items held")
    except AssertionError as e:
        me, own = shard.shard.session_id, owners(cfg)
        failures = [r for r in log_trap.records if "failed" in r["event"]][-3:]
        raise AssertionError(f"{e}: {[(cid[:60], own.get(cid)) for cid in expect_held if own.get(cid) != me][:5]}, "
                             f"held {len(shard.shard.held_ids())}, our session {me}; "
                             f"last failures {failures}") from None
    recovery = wait_streaming(up, list(items.good.values()), written_at, 20)
    time.sleep(3 * shard.cfg.lease.desired_state_s + 1)  # several desired-state checks and reconcile rounds
    settle_sink()
    got = _bad_counts(shard) - before
    verdict = _judge_good(cfg, up, items.good)
    record("bad_items", trial, verdict, round(recovery, 3), seed=SEED, bad_url=len(items.bad_url),
           unparseable=len(items.unparseable), unclaimable=len(items.unclaimable), invisible=len(items.invisible),
           soup=len(items.soup), refused_by_dynamodb=items.refused, counted=dict(got))
    print(f"bad items trial {trial}: {len(items.bad_url)} bad urls, {len(items.unparseable)} unparseable, "
          f"{len(items.unclaimable)} unclaimable, {len(items.invisible)} invisible, {len(items.soup)} soup, "
          f"{items.refused} refused by DynamoDB; counted {dict(got)}; good streaming after {recovery:.2f} s")
    assert_ok(verdict, f"bad items trial {trial}")
    assert shard.thread.is_alive(), "the shard died"
    # Exact for what was written on purpose; soup items may land in any of these too.  An unparseable
    # item is parked without looking at its URL: counted once, as unparseable.
    soup = len(items.soup)
    for reason, n, also in (("bad_url", len(items.bad_url), 0),
                            ("unparseable", len(items.unparseable), 0), ("unclaimable", len(items.unclaimable), 0)):
        assert n <= got[reason] <= n + also + soup, f"{reason}: counted {got[reason]}, wrote {n} (+{soup} soup)"
    assert got["fatal_claims"] <= len(items.unclaimable) + soup, "an unclaimable item was claimed again"
    assert got["lost"] == 0, "a parked item bounced (lost and re-adopted)"
    assert _held_by_me(cfg, shard, expect_held), "a held item was let go"
    me, own = shard.shard.session_id, owners(cfg)
    assert not [cid for cid in items.invisible + items.unclaimable if own.get(cid) == me]
    problems = log_problems(log_trap.records)
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])
    # Stop what this trial started, so that the load (streams, sweeps) does not pile up over 20 trials
    # on the one local DynamoDB: slow enough, it makes the shard self-fence, rightly.
    for cid in [*items.good, *items.bad_url, *items.soup]:
        ddb().update_item(TableName=cfg.aws.connections_table, Key={"connection_id": {"S": cid}},
                          UpdateExpression="SET desired_state = :s", ExpressionAttributeValues={":s": {"S": "STOPPED"}})


def _judge_good(cfg: Config, up: UpstreamProc, good: dict[str, str]) -> Verdict:
    """The verdict over the good items, whose connection ids need not be their upstream stream ids."""
    stats = up.stats()
    streams = {sid: stats[sid] for sid in good.values()}
    report = audit(cfg, good)
    never = sorted(set(good) - set(report.seqs))
    assert not never, f"never written: {never[:5]}"
    report.seqs = {good[c]: s for c, s in report.seqs.items()}
    report.writers = {good[c]: w for c, w in report.writers.items()}
    behind = {sid: streams[sid]["produced"] - max(report.seqs[sid]) for sid in streams}
    assert all(n <= 25 for n in behind.values()), f"good streams far behind: {behind}"
    return check(report, streams, margin_ms=1000)


# ======================================================================================= 6. process pause

PAUSE_TTL_S = fast().lease.lease_ttl_s
PAUSE_MARGIN_S = fast().lease.safety_margin_s


@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_a_paused_shard_streams_and_checkpoints_nothing_it_lost(cfg: Config, tmp_path: Path, long_run: bool) -> None:
    """One of two shards is SIGSTOPped for longer than its TTL while its peer takes its streams over, then
    SIGCONTed: on resuming, its timers fire late and its flushes may run before its fence loop, yet it
    must not write a message nor a checkpoint for anything it lost (write windows must not overlap), and
    it must go on running and take a share again.  The fake upstream pings its clients every second and
    drops a silent one, as a real upstream drops a paused client's socket.

    Recovery: from the SIGSTOP (the session expires first: TTL + margin, then the peer's reconcile)."""
    up = UpstreamProc(tmp_path, rate=5.0, ping_s=1.0)
    ids = [f"p{i:04d}" for i in range(30)]
    seed_items(cfg, {cid: up.url(cid) for cid in ids})
    fleet = Fleet(cfg, tmp_path, up, ids, env={"FLEETD_MAX_CONNECTIONS_PER_SHARD": "40"})
    try:
        fleet.start("a")
        fleet.start("b")
        fleet.wait_started()
        wait_for(lambda: all_owned_by_live(fleet), 30, 0.25, "all 30 claimed")
        wait_streaming(up, ids, time.monotonic(), 20)
        for trial in range(trials(long_run)):
            _pause_trial(fleet, trial)
        fleet.stop()
    finally:
        fleet.close()
        up.stop()


def _pause_trial(fleet: Fleet, trial: int) -> None:
    rng = rng_for("process_pause", trial)
    wait_for(lambda: sum(1 for s, n in fleet.holdings().items() if s and n) == 2, 60, 0.5, "both shards holding")
    victim = rng.choice(sorted(s for s, n in fleet.holdings().items() if s and n))
    pause_s = PAUSE_TTL_S + PAUSE_MARGIN_S + rng.uniform(2.0, 6.0)
    proc = fleet.procs[victim]
    proc.signal(signal.SIGSTOP)
    hit = time.monotonic()
    try:
        wait_for(lambda: fleet.holdings().get(victim, 0) == 0 and all_owned_by_live(fleet), pause_s, 0.2,
                 "the peer to take the paused shard's streams")
        recovery = wait_streaming(fleet.up, fleet.ids, hit, pause_s)
        time.sleep(max(0.0, hit + pause_s - time.monotonic()))
    finally:
        proc.signal(signal.SIGCONT)
    time.sleep(3.0)  # it resumes, fences, opens a new session
    settle_sink()
    fleet.assert_alive()
    verdict = judge(fleet.cfg, fleet.up, fleet.ids, margin_ms=0)
    record("process_pause", trial, verdict, round(recovery, 3), seed=SEED, paused_s=round(pause_s, 2))
    print(f"pause trial {trial}: {victim} paused {pause_s:.1f} s, streaming again after {recovery:.2f} s")
    assert_ok(verdict, f"process pause trial {trial}", fleet.cfg)
    problems = fleet.problems()
    assert not problems, "unexpected log lines:\n" + "\n".join(problems[:10])
