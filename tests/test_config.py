"""Configuration: defaults, precedence (flags > env > TOML), parsing and validation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd import config, exits
from fleetd.config import Config, ConfigError


def write(tmp_path: Path, text: str, name: str = "fleetd.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("source", "expected"), [
    ({"FLEETD_LEASE_MODE": "item"}, (20.0, 5.0)),
    ({"FLEETD_LEASE_MODE": "item", "FLEETD_LEASE_TTL_S": "8", "FLEETD_HEARTBEAT_S": "2"}, (8.0, 2.0)),
    ({"FLEETD_LEASE_MODE": "session", "FLEETD_LEASE_TTL_S": "0"}, (6.0, 1.5)),
])
def test_lease_timings_default_by_mode(source: dict[str, str], expected: tuple[float, float]) -> None:
    """0 (the default) means the mode's own: session 6 s / 1.5 s, item the seed's 20 s / 5 s."""
    lease = config.load(env=source).lease
    assert (lease.lease_ttl_s, lease.heartbeat_s) == expected


def test_a_mode_change_carries_the_mode_default_timings_along() -> None:
    """``replace`` switching modes re-resolves timings left at the old mode's defaults, keeps explicit ones."""
    assert config.replace(Config(), lease_mode="item").lease.lease_ttl_s == 20.0
    assert config.replace(Config(), lease_mode="item", lease_ttl_s=8.0).lease.lease_ttl_s == 8.0
    item = config.replace(Config(), lease_mode="item")
    assert config.replace(item, lease_mode="session").lease.heartbeat_s == 1.5


def test_defaults() -> None:
    cfg = config.load(env={})
    assert cfg == Config()
    assert cfg.lease.lease_mode == "session"
    assert (cfg.lease.lease_ttl_s, cfg.lease.heartbeat_s, cfg.lease.safety_margin_s) == (6.0, 1.5, 2.0)
    assert (cfg.lease.reconcile_s, cfg.lease.reconcile_jitter, cfg.lease.desired_state_s) == (5.0, 0.2, 10.0)
    assert cfg.lease.checkpoint_s == 30.0
    assert cfg.aws.connections_table == "fleetd-connections"
    assert cfg.aws.sessions_table == "fleetd-sessions"
    assert cfg.aws.messages_table == "fleetd-messages"
    assert cfg.aws.hints_queue == "fleetd-hints"
    assert cfg.aws.hint_wait_s == 20
    assert cfg.upstream.allowed_schemes == ("wss",)
    assert cfg.upstream.allowed_hosts == ()
    assert cfg.runtime.max_connections_per_shard == 700
    assert cfg.runtime.shutdown_budget_s == 20.0
    assert cfg.runtime.cloudwatch_namespace == "WsFleet"


def test_every_setting_has_a_doc_a_flag_and_an_env_name() -> None:
    names = [s.name for s in config.settings()]
    assert len(names) == len(set(names)), "setting names must be unique across the tree"
    for s in config.settings():
        assert s.doc
        assert s.env == "FLEETD_" + s.name.upper()
        assert s.flag == "--" + s.name.replace("_", "-")


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "lease_ttl_s = 30\nheartbeat_s = 4\nreconcile_s = 7\nsessions_table = 'from-file'\n")
    env = {"FLEETD_HEARTBEAT_S": "3", "FLEETD_RECONCILE_S": "8"}
    cfg = config.load({"heartbeat_s": "2"}, env=env, config_file=path)
    assert cfg.lease.heartbeat_s == 2.0  # flag beats env and file
    assert cfg.lease.reconcile_s == 8.0  # env beats file
    assert cfg.lease.lease_ttl_s == 30.0  # file beats default
    assert cfg.aws.sessions_table == "from-file"
    assert cfg.lease.safety_margin_s == 2.0  # default


def test_flag_none_means_not_given(tmp_path: Path) -> None:
    cfg = config.load({"heartbeat_s": None}, env={"FLEETD_HEARTBEAT_S": "3"})
    assert cfg.lease.heartbeat_s == 3.0


def test_config_file_from_env_and_explicit_file_wins(tmp_path: Path) -> None:
    from_env = write(tmp_path, "reconcile_s = 6\n", "env.toml")
    explicit = write(tmp_path, "reconcile_s = 9\n", "explicit.toml")
    assert config.load(env={"FLEETD_CONFIG": from_env}).lease.reconcile_s == 6.0
    assert config.load(env={"FLEETD_CONFIG": from_env}, config_file=explicit).lease.reconcile_s == 9.0


@pytest.mark.parametrize(("raw", "expected"), [
    ("ws,wss", ("ws", "wss")),
    (" ws , wss ", ("ws", "wss")),
    ("wss,", ("wss",)),
    ("wss", ("wss",)),
])
def test_env_lists_are_comma_separated(raw: str, expected: tuple[str, ...]) -> None:
    assert config.load(env={"FLEETD_ALLOWED_SCHEMES": raw}).upstream.allowed_schemes == expected


def test_list_values_in_toml_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'allowed_schemes = ["ws", "wss"]\nallowed_hosts = ["a.example", "b.example"]\n')
    cfg = config.load(env={}, config_file=path)
    assert cfg.upstream.allowed_schemes == ("ws", "wss")
    assert cfg.upstream.allowed_hosts == ("a.example", "b.example")
    assert config.load({"allowed_hosts": "x.example,y.example"}, env={}).upstream.allowed_hosts == (
        "x.example", "y.example")
    assert config.load({"allowed_hosts": ""}, env={"FLEETD_ALLOWED_HOSTS": "z"}).upstream.allowed_hosts == ()


def test_toml_flat_and_in_sections(tmp_path: Path) -> None:
    flat = write(tmp_path, "lease_ttl_s = 25\nhint_wait_s = 10\nresume = false\nsink = 'discard'\n", "flat.toml")
    sections = write(tmp_path, "[lease]\nlease_ttl_s = 25\n[aws]\nhint_wait_s = 10\n"
                               "[upstream]\nresume = false\n[sink]\nsink = 'discard'\n", "sections.toml")
    mixed = write(tmp_path, "lease_ttl_s = 25\nresume = false\n[aws]\nhint_wait_s = 10\n"
                            "[sink]\nsink = 'discard'\n", "mixed.toml")
    loaded = [config.load(env={}, config_file=p) for p in (flat, sections, mixed)]
    assert loaded[0] == loaded[1] == loaded[2]
    cfg = loaded[0]
    assert (cfg.lease.lease_ttl_s, cfg.aws.hint_wait_s, cfg.upstream.resume, cfg.sink.sink) == (
        25.0, 10, False, "discard")


@pytest.mark.parametrize(("raw", "expected"), [
    ("true", True), ("1", True), ("YES", True), ("on", True),
    ("false", False), ("0", False), ("no", False), ("Off", False),
])
def test_booleans(raw: str, expected: bool) -> None:
    assert config.load(env={"FLEETD_RESUME": raw}).upstream.resume is expected


def test_integer_settings_accept_integral_toml_floats(tmp_path: Path) -> None:
    path = write(tmp_path, "shards = 4.0\nmax_connections_per_shard = 5000\n")
    cfg = config.load(env={}, config_file=path)
    assert (cfg.runtime.shards, cfg.runtime.max_connections_per_shard) == (4, 5000)


@pytest.mark.parametrize(("env", "message"), [
    ({"FLEETD_HEARTBEAT_S": "20"}, "heartbeat_s (20.0) must be below lease_ttl_s"),
    ({"FLEETD_HEARTBEAT_S": "30", "FLEETD_LEASE_TTL_S": "20"}, "must be below lease_ttl_s"),
    ({"FLEETD_HEARTBEAT_S": "4", "FLEETD_SAFETY_MARGIN_S": "3"}, "would self-fence"),
    ({"FLEETD_LEASE_TTL_S": "-1"}, "lease_ttl_s must be > 0"),
    ({"FLEETD_HEARTBEAT_S": "-1"}, "heartbeat_s must be > 0"),
    ({"FLEETD_SAFETY_MARGIN_S": "-0.5"}, "safety_margin_s must be >= 0"),
    ({"FLEETD_SHARDS": "-2"}, "shards must be >= 0"),
    ({"FLEETD_MAX_CONNECTIONS_PER_SHARD": "0"}, "max_connections_per_shard"),
    ({"FLEETD_HINT_WAIT_S": "21"}, "hint_wait_s must be in 0..20"),
    ({"FLEETD_RECONCILE_JITTER": "1"}, "reconcile_jitter"),
    ({"FLEETD_LEASE_MODE": "lazy"}, "FLEETD_LEASE_MODE: invalid lease_mode: 'lazy' is not one of session, item"),
    ({"FLEETD_LOG_LEVEL": "debug"}, "invalid log_level"),
    ({"FLEETD_LEASE_TTL_S": "twenty"}, "FLEETD_LEASE_TTL_S: invalid lease_ttl_s"),
    ({"FLEETD_SHARDS": "1.5"}, "invalid shards"),
    ({"FLEETD_RESUME": "maybe"}, "invalid resume"),
    ({"FLEETD_ALLOWED_SCHEMES": "wss,http"}, "allowed_schemes may contain only ws and wss (got http)"),
    ({"FLEETD_ALLOWED_SCHEMES": ""}, "allowed_schemes must not be empty"),
    ({"FLEETD_CONNECTIONS_TABLE": "ab"}, "connections_table must be 3-255 characters"),
    ({"FLEETD_METRICS_ADDR": "9108"}, "metrics_addr must be host:port"),
    ({"FLEETD_SINK_LOW_WATERMARK": "30000"}, "sink_low_watermark"),
    ({"FLEETD_BACKOFF_MIN_S": "40"}, "backoff_min_s"),
    ({"FLEETD_ALLOWED_NETWORKS": "127.0.0.0/8,loopback"}, "allowed_networks must be CIDR networks"),
    ({"FLEETD_ALLOWED_NETWORKS": "10.0.0.0/33"}, "(got 10.0.0.0/33)"),
    ({"FLEETD_ALLOWED_HOST": "feed.example.com"},
     "unknown environment variable FLEETD_ALLOWED_HOST: not a fleetd setting (did you mean FLEETD_ALLOWED_HOSTS?)"),
    ({"FLEETD_NOPE": "1"}, "unknown environment variable FLEETD_NOPE: not a fleetd setting"),
])
def test_invalid_values_raise_config_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(env=env)


def test_invalid_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--lease-ttl-s: invalid lease_ttl_s"):
        config.load({"lease_ttl_s": "abc"}, env={})


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.toml"):
        config.load(env={}, config_file=str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(env={}, config_file=str(tmp_path))  # a directory
    if os.geteuid() != 0:  # root reads anything
        path = write(tmp_path, "lease_ttl_s = 20\n", "private.toml")
        os.chmod(path, 0)
        with pytest.raises(ConfigError, match="cannot read config file"):
            config.load(env={}, config_file=path)


def test_bad_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "lease_ttl_s = = 20\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        config.load(env={}, config_file=path)


def test_non_utf8_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"cluster_name = 'caf\xe9'\n")
    with pytest.raises(ConfigError):
        config.load(env={}, config_file=str(path))


@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_infinite_numbers_are_rejected(value: str) -> None:
    with pytest.raises(ConfigError):
        config.load(env={"FLEETD_LEASE_TTL_S": value})


@pytest.mark.parametrize("text", ["lease_tll_s = 20\n", "[lease]\nlease_tll_s = 20\n", "[nonsense]\nx = 1\n"])
def test_unknown_key_in_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="unknown setting"):
        config.load(env={}, config_file=path)


@pytest.mark.parametrize("text", ["lease_ttl_s = 'soon'\n", "shards = true\n", "connections_table = 5\n",
                                  "lease_ttl_s = [1, 2]\n", "lease_mode = 'both'\n"])
def test_wrong_types_in_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path}: invalid")):
        config.load(env={}, config_file=path)


def test_replace_and_as_env_round_trip() -> None:
    cfg = config.replace(config.load(env={}), lease_ttl_s=30.0, allowed_schemes=("ws", "wss"), resume=False)
    assert config.load(env=config.as_env(cfg)) == cfg
    with pytest.raises(ConfigError, match="unknown setting nope"):
        config.replace(cfg, nope=1)
    with pytest.raises(ConfigError, match="heartbeat_s"):
        config.replace(cfg, heartbeat_s=31.0)


def test_cli_reports_invalid_config_in_one_line() -> None:
    """A real process: exit 2, one line on stderr, no traceback, before any AWS call."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    env.update({"FLEETD_HEARTBEAT_S": "30", "FLEETD_LEASE_TTL_S": "20",
                # nothing listens here: reaching AWS would be a failure of the test, not a hang
                "AWS_ENDPOINT_URL_DYNAMODB": "http://127.0.0.1:9", "AWS_ENDPOINT_URL_SQS": "http://127.0.0.1:9"})
    proc = subprocess.run([sys.executable, "-m", "fleetd", "init"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == exits.USAGE
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fleetd: error: ") and "heartbeat_s" in lines[0] and "lease_ttl_s" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_reports_a_bad_config_file_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "lease_ttl_s = \n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    proc = subprocess.run([sys.executable, "-m", "fleetd", "ctl", "--config", path, "ls"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == exits.USAGE
    assert len(proc.stderr.splitlines()) == 1 and "not valid TOML" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_allowed_networks_is_a_cidr_list_and_empty_by_default() -> None:
    assert config.load(env={}).upstream.allowed_networks == ()
    cfg = config.load(env={"FLEETD_ALLOWED_NETWORKS": "127.0.0.0/8, ::1/128,10.1.2.3"})
    assert cfg.upstream.allowed_networks == ("127.0.0.0/8", "::1/128", "10.1.2.3")  # a bare address is a /32


def test_the_fleetd_variables_that_are_not_settings_are_accepted() -> None:
    env = {name: "x" for name in config.ENV_NOT_SETTINGS if name != "FLEETD_CONFIG"}
    assert config.load(env=env) == Config()


def test_every_fleetd_variable_the_repo_names_is_a_setting_or_a_listed_exception() -> None:
    """Tests, benchmarks, tools and docs must not set a FLEETD_* variable fleetd would now refuse."""
    root = Path(__file__).resolve().parent.parent
    known = {s.env for s in config.settings()} | set(config.ENV_NOT_SETTINGS)
    known |= {"FLEETD_BENCH_ENV"}  # a Python name in bench/sut.py, not a variable
    known |= {"FLEETD_ALLOWED_HOST", "FLEETD_NOPE"}  # the typos these tests make on purpose
    seen: dict[str, str] = {}
    for top in ("fleetd", "bench", "tests", "tools", "docs", "deploy"):
        for path in sorted((root / top).rglob("*")):
            if path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".sh") or "results" in path.parts:
                continue
            for name in re.findall(r"\bFLEETD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")):
                seen.setdefault(name, str(path.relative_to(root)))
    unknown = {name: where for name, where in seen.items() if name not in known}
    assert not unknown, f"FLEETD_* variables that are no setting (fleetd exits 2 on them): {unknown}"


def test_cli_names_an_unknown_fleetd_variable_in_one_line() -> None:
    """A typo must not silently mean the default (FLEETD_ALLOWED_HOST left allowed_hosts empty: every host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    env.update({"FLEETD_ALLOWED_HOST": "feed.example.com",
                "AWS_ENDPOINT_URL_DYNAMODB": "http://127.0.0.1:9", "AWS_ENDPOINT_URL_SQS": "http://127.0.0.1:9"})
    proc = subprocess.run([sys.executable, "-m", "fleetd", "run"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == exits.USAGE
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "fleetd: error: unknown environment variable FLEETD_ALLOWED_HOST: not a fleetd setting "
        "(did you mean FLEETD_ALLOWED_HOSTS?)"], proc.stderr
