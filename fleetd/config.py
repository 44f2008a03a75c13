"""fleetd configuration: one frozen, validated dataclass tree.

Every setting lives in exactly one dataclass field whose name is unique across the
tree and carries its unit (``lease_ttl_s``, ``max_frame_bytes``).  Each field can be
set, in increasing precedence, by an optional TOML file, by the environment variable
``FLEETD_<FIELD NAME IN CAPITALS>`` and by the command-line flag ``--<field-name>``.
Lists are comma-separated in the environment and on the command line.

Invalid input raises :class:`ConfigError` with one readable line; the CLI turns it
into exit code 2 (see ``fleetd.cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import math
import os
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

LeaseMode = Literal["session", "item"]
SinkKind = Literal["dynamodb", "discard"]
CloudWatchMode = Literal["api", "emf", "off"]
LogFormat = Literal["json", "text"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

ENV_PREFIX = "FLEETD_"
# FLEETD_* variables that are not settings, so not refused as unknown (see load()).  Everything else with
# the prefix must be a setting: a typo such as FLEETD_ALLOWED_HOST would otherwise silently mean "allow all".
ENV_NOT_SETTINGS: Mapping[str, str] = {
    "FLEETD_CONFIG": "the TOML config file",
    "FLEETD_DYNALITE": "path of dynalite's cli.js for the local stack (`fleetd dev`, tests)",
    "FLEETD_FAULTS_SEED": "test harness: the fault suite's seed",
    "FLEETD_FAULTS_RESULTS": "test harness: where the fault suite records its trials",
    "FLEETD_FAULTS_KEEP": "test harness: keep the fault suite's tables",
}
# The local stack's upstreams listen on loopback: `fleetd dev`, the tests and the benchmarks allow it.
LOOPBACK_NETWORKS: tuple[str, ...] = ("127.0.0.0/8", "::1/128")


# Lease timings whose default depends on the mode (a setting of 0 means "the mode's default").  Session mode
# renews one item per shard, so it can afford a short TTL: a lost task is detected in TTL + margin.  Item mode
# renews every connection item, so it keeps the seed design's cost.
MODE_TIMINGS: Mapping[str, Mapping[str, float]] = {
    "session": {"lease_ttl_s": 6.0, "heartbeat_s": 1.5},
    "item": {"lease_ttl_s": 20.0, "heartbeat_s": 5.0},
}


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent (one line)."""


def _doc(text: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached as metadata."""
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    """Lease protocol timings (SPEC §3, §4)."""

    lease_mode: LeaseMode = _doc(
        "`session`: one session lease per shard renews all its connections (default); "
        "`item`: every connection item is renewed (seed-compatible).",
        default="session",
    )
    lease_ttl_s: float = _doc(
        "Lifetime of a session or item lease without renewal; 0 = the mode's default: 6 s in session mode "
        "(a lost task's streams are taken over about 8 s after its last renewal), 20 s in item mode (the "
        "seed's; every item renewal is a write).", default=0.0)
    heartbeat_s: float = _doc(
        "Interval between lease renewals, counted from each send; must be below the TTL.  0 = the mode's "
        "default: 1.5 s in session mode, 5 s in item mode.", default=0.0)
    safety_margin_s: float = _doc(
        "Self-fence this long before expiry without a renewal; also the assumed max clock skew.",
        default=2.0,
    )
    reconcile_s: float = _doc("Interval between scans for free, expired and orphaned items.", default=5.0)
    reconcile_jitter: float = _doc("Relative jitter applied to `reconcile_s` (0.2 = ±20 %).", default=0.2)
    desired_state_s: float = _doc(
        "Interval between desired-state checks: a GSI query for STOPPED items still held.", default=10.0)
    desired_sweep_s: float = _doc(
        "Interval between full desired-state sweeps (BatchGetItem of every held item: also finds items "
        "deleted, taken or given a new URL).", default=60.0)
    checkpoint_s: float = _doc(
        "Interval between `last_seq` checkpoints of connections that advanced `checkpoint_min_seqs` or more.",
        default=30.0,
    )
    checkpoint_min_seqs: int = _doc(
        "A connection that advanced fewer seqs than this is checkpointed only every `checkpoint_idle_s`.",
        default=100,
    )
    checkpoint_idle_s: float = _doc(
        "Longest time a changed connection goes without a checkpoint (bounds the replay after a crash).",
        default=300.0,
    )
    rebalance_s: float = _doc(
        "Session mode: interval between load comparisons with a sample of live sessions; a shard over "
        "its share hands streams straight to the emptiest (one write each). 0 disables.", default=30.0)
    rebalance_tolerance: float = _doc(
        "A shard hands streams over above (1 + this) x the fleet's mean load, to peers below (1 - this) x.",
        default=0.1)
    rebalance_max_moves: int = _doc("Streams one shard hands over per rebalance round at most.", default=200)
    dead_session_grace_s: float = _doc(
        "A dead session that owns nothing is forgotten only this long after it died: a claim it sent "
        "just before dying can land one SDK retry window later, and only a listed session's items are "
        "found.  At least `aws_timeout_s` x `aws_max_attempts`.", default=60.0)
    orphan_sweep_s: float = _doc(
        "Interval between orphan sweeps: one of 16 segments of the `by_owner` index is read (keys only) and "
        "items owned by a session that no longer exists are freed, those of a dead one taken over.  The "
        "backstop for items no takeover found (a claim landing after its session was forgotten, index lag).  "
        "0 disables.", default=300.0)
    renew_concurrency: int = _doc("Item mode: renewals in flight at once per shard.", default=64)
    claim_concurrency: int = _doc("Claims in flight at once per shard during reconcile.", default=32)
    clock_offset_ms: int = _doc(
        "Added to this process's wall clock (fault-injection of clock skew; keep 0 in production).",
        default=0,
    )

    def __post_init__(self) -> None:
        for name, value in MODE_TIMINGS[self.lease_mode].items():
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)  # frozen: resolved once, at construction


@dataclass(frozen=True, slots=True)
class AwsConfig:
    """Where fleetd keeps its state.  Endpoints come from the SDK's standard settings."""

    region: str = _doc("AWS region (falls back to `AWS_REGION` / `AWS_DEFAULT_REGION`).", default="")
    connections_table: str = _doc("DynamoDB table of connection items.", default="fleetd-connections")
    sessions_table: str = _doc("DynamoDB table of shard sessions.", default="fleetd-sessions")
    messages_table: str = _doc("DynamoDB table the sink writes upstream messages to.", default="fleetd-messages")
    hints_queue: str = _doc("SQS queue name for START hints.", default="fleetd-hints")
    hint_wait_s: int = _doc("SQS long-poll wait (0–20).", default=20)
    aws_timeout_s: float = _doc("Connect and read timeout of one DynamoDB call.", default=5.0)
    aws_max_attempts: int = _doc("SDK attempts per call (standard retry mode).", default=3)
    aws_max_pool: int = _doc("HTTP connections per AWS client.", default=64)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Upstream WebSocket connections and the resumption protocol (SPEC §5)."""

    allowed_schemes: tuple[str, ...] = _doc("URL schemes `ctl start` and shards accept.", default=("wss",))
    allowed_hosts: tuple[str, ...] = _doc(
        "Host allow-list; empty allows every host.  A host listed here is also exempt from the address check "
        "of `allowed_networks` (its operator vouches for where its name resolves).", default=())
    allowed_networks: tuple[str, ...] = _doc(
        "CIDR networks an upstream may resolve to although they are not global (`127.0.0.0/8,::1/128` for a "
        "local upstream, `10.0.0.0/8` for a VPC one).  Every upstream's name is resolved at connect time and "
        "the socket opened to a checked address (so DNS rebinding cannot swap it): loopback, private "
        "(RFC 1918, fc00::/7), link-local (169.254.0.0/16, fe80::/10), multicast, unspecified and other "
        "non-global addresses (IPv4-mapped IPv6 included) are refused unless in one of these networks or the "
        "host is in `allowed_hosts`.  Redirects are never followed.  Refusals count as "
        "`upstream_connect_refused_total{reason}`.", default=())
    seq_field: str = _doc("JSON field holding a frame's sequence number.", default="seq")
    resume_param: str = _doc("Query parameter carrying the first seq wanted on reconnect.", default="from_seq")
    resume: bool = _doc("Append the resume parameter when reconnecting with a known `last_seq`.", default=True)
    max_frame_bytes: int = _doc("Largest upstream frame accepted; larger ones are rejected.", default=350_000)
    max_seq_jump: int = _doc(
        "Largest plausible move of an upstream `seq`: a frame more than this above the last seq received "
        "(a jump) or below it (a reset), or a resumed stream starting over at 0 or 1, is held back and the "
        "stream resumes; the jump is accepted, or the reset parks the stream, only if the upstream repeats "
        "it on that fresh resume.  0 disables the check (every jump a gap, every lower seq a duplicate).",
        default=10_000)
    backoff_min_s: float = _doc("First reconnect delay (jittered, doubled up to the max).", default=0.5)
    backoff_max_s: float = _doc("Largest reconnect delay.", default=30.0)
    handshake_timeout_s: float = _doc("WebSocket handshake timeout.", default=5.0)
    ping_idle_s: float = _doc("Send a ping after this much upstream silence.", default=10.0)
    ping_reply_s: float = _doc("Drop the upstream if a ping is not answered within this.", default=5.0)
    read_buffer_bytes: int = _doc("Initial read buffer per connection (memory per idle stream).", default=2048)


@dataclass(frozen=True, slots=True)
class SinkConfig:
    """The messages sink (SPEC §5)."""

    sink: SinkKind = _doc("`dynamodb` writes the messages table; `discard` drops (benchmarks).", default="dynamodb")
    sink_linger_ms: int = _doc("Flush a partial batch after this long.", default=50)
    sink_flushers: int = _doc("BatchWriteItem calls in flight at once per shard.", default=8)
    sink_high_watermark: int = _doc("Buffered messages above which upstream reads pause.", default=20_000)
    sink_low_watermark: int = _doc("Buffered messages below which upstream reads resume.", default=5_000)


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Processes, capacity, metrics and logs (SPEC §1)."""

    task_id: str = _doc("This task's id (defaults to the hostname).", default="")
    shards: int = _doc("Shard processes; 0 = one per usable CPU.", default=0)
    max_connections_per_shard: int = _doc("Connections one shard holds at most.", default=700)
    shutdown_budget_s: float = _doc("Graceful shutdown must finish within this.", default=20.0)
    metrics_addr: str = _doc("host:port of the Prometheus endpoint (explicit bind address).", default="127.0.0.1:9108")
    cloudwatch_mode: CloudWatchMode = _doc("`api` PutMetricData, `emf` log line, `off`.", default="off")
    cloudwatch_s: float = _doc("Interval between ActiveConnections publications.", default=30.0)
    cloudwatch_namespace: str = _doc("CloudWatch namespace.", default="WsFleet")
    cluster_name: str = _doc("ClusterName dimension of the published metric.", default="fleetd")
    service_name: str = _doc("ServiceName dimension of the published metric.", default="fleetd")
    log_format: LogFormat = _doc("`json` lines or `text` for humans.", default="json")
    log_level: LogLevel = _doc("Minimum log level.", default="INFO")


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration of a fleetd process."""

    lease: LeaseConfig = field(default_factory=LeaseConfig)
    aws: AwsConfig = field(default_factory=AwsConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    sink: SinkConfig = field(default_factory=SinkConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


GROUPS: tuple[tuple[str, type[Any]], ...] = (
    ("lease", LeaseConfig),
    ("aws", AwsConfig),
    ("upstream", UpstreamConfig),
    ("sink", SinkConfig),
    ("runtime", RuntimeConfig),
)


@dataclass(frozen=True, slots=True)
class Setting:
    """One leaf setting: where it lives, its type, default and documentation."""

    group: str
    name: str
    type: Any
    default: Any
    doc: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def settings() -> Iterator[Setting]:
    """Every leaf setting, in definition order (used for flags, env and docs)."""
    for group, cls in GROUPS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield Setting(group, f.name, hints[f.name], f.default, f.metadata["doc"])


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _coerce(s: Setting, raw: Any, source: str) -> Any:
    """Convert one raw value (string from env/flags, or TOML value) to the setting's type."""
    try:
        return _convert(s.type, raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: invalid {s.name}: {e}") from None


def _convert(tp: Any, raw: Any) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if raw not in choices:
            raise ValueError(f"{raw!r} is not one of {', '.join(map(str, choices))}")
        return raw
    if origin is tuple:
        items = [p.strip() for p in raw.split(",")] if isinstance(raw, str) else list(raw)
        return tuple(str(i) for i in items if str(i))
    if tp is bool:
        return raw if isinstance(raw, bool) else _parse_bool(str(raw))
    if tp is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"expected an integer, got {raw!r}")
        return int(raw)
    if tp is float:
        if isinstance(raw, bool):
            raise ValueError(f"expected a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    if tp is str:
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {raw!r}")
        return raw
    if isinstance(tp, types.UnionType):  # pragma: no cover - no unions today
        raise ValueError("unsupported type")
    raise ValueError(f"unsupported type {tp!r}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8: {e.reason} at byte {e.start}") from None
    flat: dict[str, Any] = {}
    groups = {g for g, _ in GROUPS}
    for key, value in data.items():
        if key in groups and isinstance(value, dict):
            flat.update(value)  # [lease] lease_ttl_s = 20  and  lease_ttl_s = 20  are both accepted
        else:
            flat[key] = value
    return flat


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per setting (all default to None = not given)."""
    grp = parser.add_argument_group("configuration (also FLEETD_<NAME> env vars or a TOML file)")
    grp.add_argument("--config", metavar="FILE", default=None, help="TOML file (env: FLEETD_CONFIG)")
    for s in settings():
        grp.add_argument(s.flag, dest=f"cfg_{s.name}", default=None, metavar="V", help=s.doc.replace("%", "%%"))


def load(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Config:
    """Build and validate a :class:`Config` from TOML file < environment < flags.

    ``flags`` maps setting names to raw values (None = not given); ``env`` defaults
    to ``os.environ``; ``config_file`` defaults to ``$FLEETD_CONFIG``.
    """
    env = os.environ if env is None else env
    flags = flags or {}
    _refuse_unknown_env(env)
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    file_values = _read_toml(path) if path else {}
    known = {s.name for s in settings()}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting {unknown[0]}")
    values: dict[str, dict[str, Any]] = {g: {} for g, _ in GROUPS}
    for s in settings():
        if flags.get(s.name) is not None:
            values[s.group][s.name] = _coerce(s, flags[s.name], s.flag)
        elif s.env in env:
            values[s.group][s.name] = _coerce(s, env[s.env], s.env)
        elif s.name in file_values:
            values[s.group][s.name] = _coerce(s, file_values[s.name], f"config file {path}")
    cfg = Config(**{g: cls(**values[g]) for g, cls in GROUPS})
    validate(cfg)
    return cfg


def _refuse_unknown_env(env: Mapping[str, str]) -> None:
    """A ``FLEETD_*`` variable that is no setting (nor in :data:`ENV_NOT_SETTINGS`) is a mistake: refuse it."""
    known = {s.env for s in settings()} | set(ENV_NOT_SETTINGS)
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)
    if unknown:
        bare = {name.removeprefix(ENV_PREFIX): name for name in known}  # the shared prefix would match anything
        close = difflib.get_close_matches(unknown[0].removeprefix(ENV_PREFIX), sorted(bare), n=1)
        hint = f" (did you mean {bare[close[0]]}?)" if close else ""
        raise ConfigError(f"unknown environment variable {unknown[0]}: not a fleetd setting{hint}")


def flags_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """Extract the per-setting flag values added by :func:`add_flags`."""
    return {s.name: getattr(ns, f"cfg_{s.name}", None) for s in settings()}


def _checks(cfg: Config) -> Iterator[tuple[bool, str]]:
    """(condition that must hold, message if it does not)."""
    le, aw, up, sk, rt = cfg.lease, cfg.aws, cfg.upstream, cfg.sink, cfg.runtime
    for name in ("lease_ttl_s", "heartbeat_s", "reconcile_s", "desired_state_s", "checkpoint_s"):
        yield getattr(le, name) > 0, f"{name} must be > 0 (got {getattr(le, name)})"
    yield le.safety_margin_s >= 0, f"safety_margin_s must be >= 0 (got {le.safety_margin_s})"
    yield le.desired_sweep_s >= le.desired_state_s, (
        f"desired_sweep_s ({le.desired_sweep_s}) must be >= desired_state_s ({le.desired_state_s})")
    yield le.checkpoint_min_seqs >= 1, f"checkpoint_min_seqs must be >= 1 (got {le.checkpoint_min_seqs})"
    yield le.checkpoint_idle_s >= le.checkpoint_s, (
        f"checkpoint_idle_s ({le.checkpoint_idle_s}) must be >= checkpoint_s ({le.checkpoint_s})")
    yield le.heartbeat_s < le.lease_ttl_s, (
        f"heartbeat_s ({le.heartbeat_s}) must be below lease_ttl_s ({le.lease_ttl_s})"
    )
    yield le.heartbeat_s + le.safety_margin_s < le.lease_ttl_s, (
        f"heartbeat_s + safety_margin_s ({le.heartbeat_s} + {le.safety_margin_s}) must be below "
        f"lease_ttl_s ({le.lease_ttl_s}), or a healthy shard would self-fence"
    )
    yield 0 <= le.reconcile_jitter < 1, f"reconcile_jitter must be in [0, 1) (got {le.reconcile_jitter})"
    yield le.rebalance_s >= 0, f"rebalance_s must be >= 0 (got {le.rebalance_s})"
    yield le.orphan_sweep_s >= 0, f"orphan_sweep_s must be >= 0 (got {le.orphan_sweep_s})"
    yield 0 < le.rebalance_tolerance < 1, f"rebalance_tolerance must be in (0, 1) (got {le.rebalance_tolerance})"
    yield le.rebalance_max_moves >= 1, "rebalance_max_moves must be >= 1"
    yield le.renew_concurrency >= 1, "renew_concurrency must be >= 1"
    yield le.claim_concurrency >= 1, "claim_concurrency must be >= 1"
    for name in ("connections_table", "sessions_table", "messages_table"):
        v = getattr(aw, name)
        yield 3 <= len(v) <= 255, f"{name} must be 3-255 characters (got {v!r})"
    yield bool(aw.hints_queue), "hints_queue must not be empty"
    yield 0 <= aw.hint_wait_s <= 20, f"hint_wait_s must be in 0..20 (got {aw.hint_wait_s})"
    yield aw.aws_timeout_s > 0 and aw.aws_max_attempts >= 1 and aw.aws_max_pool >= 1, (
        "aws_timeout_s, aws_max_attempts and aws_max_pool must be positive"
    )
    yield le.dead_session_grace_s >= aw.aws_timeout_s * aw.aws_max_attempts, (
        f"dead_session_grace_s ({le.dead_session_grace_s}) must be >= aws_timeout_s x aws_max_attempts "
        f"({aw.aws_timeout_s} x {aw.aws_max_attempts}), or a late claim could orphan an item")
    yield bool(up.allowed_schemes), "allowed_schemes must not be empty"
    bad = [s for s in up.allowed_schemes if s not in ("ws", "wss")]
    yield not bad, f"allowed_schemes may contain only ws and wss (got {','.join(bad)})"
    bad = [n for n in up.allowed_networks if not _valid_network(n)]
    yield not bad, f"allowed_networks must be CIDR networks such as 10.0.0.0/8 (got {','.join(bad)})"
    yield up.max_frame_bytes > 0, "max_frame_bytes must be > 0"
    yield up.max_seq_jump >= 0, f"max_seq_jump must be >= 0 (got {up.max_seq_jump})"
    yield 0 < up.backoff_min_s <= up.backoff_max_s, "need 0 < backoff_min_s <= backoff_max_s"
    yield up.handshake_timeout_s > 0 and up.ping_idle_s > 0 and up.ping_reply_s > 0, (
        "handshake_timeout_s, ping_idle_s and ping_reply_s must be > 0"
    )
    yield up.ping_reply_s <= up.ping_idle_s, (
        f"ping_reply_s ({up.ping_reply_s}) must not exceed ping_idle_s ({up.ping_idle_s})"
    )
    yield up.read_buffer_bytes >= 256, "read_buffer_bytes must be >= 256"
    yield sk.sink_linger_ms >= 0 and sk.sink_flushers >= 1, "sink_linger_ms >= 0 and sink_flushers >= 1"
    yield 0 < sk.sink_low_watermark < sk.sink_high_watermark, (
        "need 0 < sink_low_watermark < sink_high_watermark"
    )
    yield rt.shards >= 0, f"shards must be >= 0 (got {rt.shards})"
    yield rt.max_connections_per_shard >= 1, "max_connections_per_shard must be >= 1"
    yield rt.shutdown_budget_s > 0, "shutdown_budget_s must be > 0"
    yield rt.cloudwatch_s > 0, "cloudwatch_s must be > 0"
    yield _valid_addr(rt.metrics_addr), f"metrics_addr must be host:port (got {rt.metrics_addr!r})"


def _valid_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _valid_addr(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 <= int(port) < 65536


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the first inconsistency."""
    for ok, message in _checks(cfg):
        if not ok:
            raise ConfigError(message)


def replace(cfg: Config, **changes: Any) -> Config:
    """A copy of ``cfg`` with leaf settings changed by name (validated)."""
    by_group: dict[str, dict[str, Any]] = {}
    index = {s.name: s.group for s in settings()}
    for name, value in changes.items():
        if name not in index:
            raise ConfigError(f"unknown setting {name}")
        by_group.setdefault(index[name], {})[name] = value
    if "lease" in by_group:
        _follow_mode(cfg.lease, by_group["lease"])
    new = dataclasses.replace(
        cfg, **{g: dataclasses.replace(getattr(cfg, g), **v) for g, v in by_group.items()}
    )
    validate(new)
    return new


def _follow_mode(lease: LeaseConfig, changes: dict[str, Any]) -> None:
    """A mode change carries along the timings that were the old mode's defaults (not set explicitly)."""
    mode = changes.get("lease_mode", lease.lease_mode)
    if mode == lease.lease_mode:
        return
    for name, value in MODE_TIMINGS[lease.lease_mode].items():
        if name not in changes and getattr(lease, name) == value:
            changes[name] = 0.0


def as_env(cfg: Config) -> dict[str, str]:
    """The environment variables that reproduce ``cfg`` (for child processes)."""
    out: dict[str, str] = {}
    for s in settings():
        value = getattr(getattr(cfg, s.group), s.name)
        out[s.env] = _render(value)
    return out


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
