"""The Grafana dashboard and the Prometheus config against a real Prometheus scraping ``fleetd run``.

The static tests check the dashboard's shape and that it only names metrics fleetd
exports.  The integration test starts ``fleetd run`` with live upstream connections,
points a real Prometheus (Debian package ``prometheus``) at it with the example
config from ``grafana/prometheus.yml``, and evaluates every PromQL expression of
the dashboard through Prometheus' HTTP API: each must parse and return at least one
series.  The alerting rules must load and evaluate without error.

Prometheus and promtool are required: a missing binary is a failure, not a skip.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetd import metrics
from fleetd.config import Config
from fleetd.devstack import free_port, spawn, terminate
from tests.fleet import FleetdProc, UpstreamProc, fleetd_env, seed_items, stop_all, wait_for

# PyYAML has no type stubs in the dev environment; loaded untyped on purpose.
yaml: Any = importlib.import_module("yaml")

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "fleetd.json"
PROM_CONFIG = ROOT / "grafana" / "prometheus.yml"
ALERTS = ROOT / "grafana" / "alerts.yml"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = ROOT / "grafana" / "provisioning" / "dashboards" / "fleetd.yml"

CONNECTIONS = 12
SHARDS = 2

# What the issue asks the dashboard to show; each must be queried by some panel.
REQUIRED_METRICS = (
    "fleetd_active_connections",
    "fleetd_lease_claims_total",
    "fleetd_lease_renewals_total",
    "fleetd_lease_lost_total",
    "fleetd_self_fence_total",
    "fleetd_messages_total",
    "fleetd_sink_batch_seconds_bucket",
    "fleetd_sink_buffer_messages",
    "fleetd_upstream_reconnects_total",
    "fleetd_upstream_frames_rejected_total",
    "fleetd_dynamodb_requests_total",
    "fleetd_event_loop_lag_seconds_bucket",
    "fleetd_shard_restarts_total",
)

# Grafana's built-in interval variables, and what the test substitutes for them.
BUILTIN_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_METRIC = re.compile(r"\bfleetd_[a-z0-9_]+\b")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)\s*$")


# ----- helpers ------------------------------------------------------------------------------------------


def tool(name: str) -> str:
    """Absolute path of a required binary, or a test failure saying how to install it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        pytest.fail(f"{name} not found: install the Debian package `prometheus` "
                    f"(apt-get install -y prometheus; .ci/run does this)")
    return found


def load_dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text(encoding="utf-8")))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def expressions(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) of every query target of the dashboard."""
    out = []
    for panel in all_panels(dash["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((f"{panel['title']} / {target['refId']}", str(target["expr"])))
    return out


def variable_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append((str(var["name"]), str(query["query"] if isinstance(query, dict) else query)))
    return out


def substitute(expr: str) -> str:
    """Replace Grafana variables: intervals by durations, dashboard variables by a match-all regex."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return BUILTIN_INTERVALS.get(name, ".*")

    return _VARIABLE.sub(one, expr)


def exported_metric_names() -> set[str]:
    """Every sample name ``fleetd run`` exposes (fleetd.metrics' families, with their suffixes)."""
    names = {"fleetd_shard_restarts_total", "fleetd_task_active_connections", "fleetd_shards_running"}
    for fam in metrics.REQUIRED:
        base = metrics.PREFIX + fam.name
        if fam.kind == "histogram":
            names |= {base + "_bucket", base + "_count", base + "_sum"}
        else:
            names.add(base)
    return names


class PrometheusProc:
    """A Prometheus server on a free loopback port with a throwaway TSDB."""

    def __init__(self, config_file: Path, data_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn([tool("prometheus"), f"--config.file={config_file}",
                           f"--storage.tsdb.path={data_dir}", f"--web.listen-address=127.0.0.1:{self.port}",
                           "--storage.tsdb.retention.time=1h", "--log.level=warn"], log_path)
        self.log_path = log_path
        wait_for(self._ready, 30, 0.2, "Prometheus to be ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log_path.read_text(errors='replace')}"
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET an /api/v1 endpoint; a 4xx (bad query) is returned as its error body, not raised."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read()))

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def stop(self) -> None:
        terminate(self.proc, timeout_s=10)


def scrape_config(tmp_path: Path, target: str) -> Path:
    """grafana/prometheus.yml with a 1 s interval, its fleetd job aimed at ``target``, rules made absolute."""
    doc = yaml.safe_load(PROM_CONFIG.read_text(encoding="utf-8"))
    doc["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"})
    jobs = [job for job in doc["scrape_configs"] if job["job_name"] == "fleetd"]
    assert len(jobs) == 1, "grafana/prometheus.yml must have exactly one job named fleetd"
    jobs[0]["static_configs"] = [{"targets": [target]}]
    doc["scrape_configs"] = jobs
    doc["rule_files"] = [str((PROM_CONFIG.parent / f).resolve()) for f in doc.get("rule_files", [])]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def promtool_check_config(path: Path) -> None:
    res = subprocess.run([tool("promtool"), "check", "config", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, f"promtool check config {path} failed:\n{res.stdout}{res.stderr}"


# ----- static checks -----------------------------------------------------------------------------------


def test_dashboard_uses_the_datasource_variable_everywhere() -> None:
    dash = load_dashboard()
    assert dash["uid"] == "fleetd" and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = []
    for panel in all_panels(dash["panels"]):
        ids.append(panel["id"])
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    for name, var in variables.items():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", name
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_shows_every_required_metric_and_only_exported_ones() -> None:
    dash = load_dashboard()
    exprs = [e for _, e in expressions(dash)] + [q for _, q in variable_queries(dash)]
    used = {m for e in exprs for m in _METRIC.findall(e)}
    assert not set(REQUIRED_METRICS) - used, f"dashboard does not show {sorted(set(REQUIRED_METRICS) - used)}"
    unknown = used - exported_metric_names()
    assert not unknown, f"dashboard queries metrics fleetd does not export: {sorted(unknown)}"
    joined = "\n".join(exprs)
    for quantile in ("0.5", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(fleetd_sink_batch_seconds_bucket" in joined
    assert "histogram_quantile(0.99, sum by (le, instance, shard) (rate(fleetd_event_loop_lag_seconds_bucket" in joined
    for by in ("(result)", "(reason)", "(op, outcome)", "(instance, shard)", "(instance)"):
        assert f"by {by}" in joined, f"no panel aggregates by {by}"


def test_alert_rules_only_use_exported_metrics() -> None:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert rules
    used = {m for r in rules for m in _METRIC.findall(r["expr"])}
    assert used and not used - exported_metric_names(), sorted(used - exported_metric_names())


def test_grafana_provisioning_files() -> None:
    ds = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))
    assert ds["apiVersion"] == 1
    assert [d["type"] for d in ds["datasources"]] == ["prometheus"]
    providers = yaml.safe_load(PROVIDERS.read_text(encoding="utf-8"))
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_substitute_replaces_grafana_variables() -> None:
    assert substitute('rate(x{a=~"$task", b=~"${shard}", c=~"[[shard]]"}[$__rate_interval])') == \
        'rate(x{a=~".*", b=~".*", c=~".*"}[1m])'


def test_promtool_accepts_the_example_config() -> None:
    promtool_check_config(PROM_CONFIG)  # also checks the rule files it names
    res = subprocess.run([tool("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def lag_series(shard: str, per_minute: dict[str, int]) -> list[dict[str, str]]:
    """promtool input series: a shard's lag buckets, growing by ``per_minute[le]`` samples a minute."""
    return [{"series": f'fleetd_event_loop_lag_seconds_bucket{{instance="t", shard="{shard}", le="{le}"}}',
             "values": f"0+{n}x30"} for le, n in per_minute.items()]


def test_event_loop_lag_alert_fires_when_over_1_percent_of_samples_are_100_ms_late(tmp_path: Path) -> None:
    """240 samples a minute (the probe's 0.25 s): 5 % late on shard 0 fires after 10 min, 0.4 % on shard 1 never."""
    slow = lag_series("0", {"0.1": 228, "0.25": 240, "+Inf": 240})
    fine = lag_series("1", {"0.1": 239, "0.25": 240, "+Inf": 240})
    rule = next(r for g in yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"] for r in g["rules"]
                if r["alert"] == "FleetdEventLoopLag")
    fired = {"exp_labels": {"severity": "warn", "instance": "t", "shard": "0"},
             "exp_annotations": {"summary": "shard 0 of t: event-loop lag p99 220ms",  # 0.1 + 0.15 × 9.6/12
                                 "description": rule["annotations"]["description"]}}
    doc = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": slow + fine, "alert_rule_test": [
               {"eval_time": "10m", "alertname": "FleetdEventLoopLag", "exp_alerts": []},  # pending: `for: 10m`
               {"eval_time": "20m", "alertname": "FleetdEventLoopLag", "exp_alerts": [fired]}]}]}
    path = tmp_path / "lag_test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    res = subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


# ----- against a live fleetd ------------------------------------------------------------------------------


def test_every_dashboard_query_returns_series_from_a_live_fleetd(cfg: Config, tmp_path: Path) -> None:
    tool("prometheus")  # fail before starting anything if it is missing
    up = UpstreamProc(tmp_path, rate=5.0, size=120)
    metrics_port = free_port()
    run: FleetdProc | None = None
    prom: PrometheusProc | None = None
    try:
        seed_items(cfg, {f"dash-{i:03d}": up.url(f"dash-{i:03d}") for i in range(CONNECTIONS)})
        env = fleetd_env(cfg, FLEETD_ALLOWED_SCHEMES="ws,wss")
        run = FleetdProc([sys.executable, "-m", "fleetd", "run", "--shards", str(SHARDS),
                          "--metrics-addr", f"127.0.0.1:{metrics_port}"], env, tmp_path / "fleetd-run.log")
        fleetd_url = f"http://127.0.0.1:{metrics_port}"
        wait_for(lambda: _held(run, fleetd_url) == CONNECTIONS, 60, 0.25,
                 f"fleetd run to hold {CONNECTIONS} connections")

        config_file = scrape_config(tmp_path, f"127.0.0.1:{metrics_port}")
        promtool_check_config(config_file)
        prom = PrometheusProc(config_file, tmp_path / "tsdb", tmp_path / "prometheus.log")
        # Several scrapes, so rate() over counters sitting at 0 has two samples to work with.
        wait_for(lambda: _scrapes(prom) >= 5, 60, 0.5, "five scrapes of fleetd")

        dash = load_dashboard()
        check_expressions(prom, expressions(dash))
        check_variables(prom, variable_queries(dash))
        check_rules(prom)
    finally:
        stop_all(*(p for p in (run, up) if p is not None))
        if prom is not None:
            prom.stop()


def _held(run: FleetdProc, url: str) -> float:
    assert run.proc.poll() is None, f"fleetd run exited with {run.proc.returncode}:\n" + \
        run.log_path.read_text(errors="replace")[-4000:]
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return -1.0
    return sum(v for name, _, v in metrics.scrape(text) if name == "fleetd_active_connections")


def _scrapes(prom: PrometheusProc) -> int:
    result = prom.query('count_over_time(up{job="fleetd"}[1m])')["data"]["result"]
    up = prom.query('up{job="fleetd"}')["data"]["result"]
    healthy = bool(up) and all(s["value"][1] == "1" for s in up)
    return int(float(result[0]["value"][1])) if result and healthy else 0


def check_expressions(prom: PrometheusProc, exprs: list[tuple[str, str]]) -> None:
    """Every expression parses at once; every one returns a series within a few more scrapes."""
    assert exprs
    for where, expr in exprs:
        resp = prom.query(substitute(expr))
        assert resp["status"] == "success", f"{where}: {substitute(expr)!r}: {resp.get('error')}"

    def empty() -> list[str]:
        return [f"{where}: {substitute(expr)}" for where, expr in exprs
                if not prom.query(substitute(expr))["data"]["result"]]

    missing: list[str] = []

    def none_empty() -> bool:
        missing[:] = empty()
        return not missing

    try:
        wait_for(none_empty, 20, 1.0, "every dashboard query to return a series")
    except AssertionError:
        raise AssertionError("dashboard queries without a series:\n  " + "\n  ".join(missing)) from None


def check_variables(prom: PrometheusProc, queries: list[tuple[str, str]]) -> None:
    """``label_values(selector, label)`` variables must list at least one value."""
    assert queries
    for name, query in queries:
        m = _LABEL_VALUES.match(query)
        assert m, f"variable {name}: unsupported query {query!r}"
        params = {"match[]": substitute(m["selector"])} if m["selector"] else {}
        resp = prom.api(f"label/{m['label']}/values", **params)
        assert resp["status"] == "success" and resp["data"], f"variable {name}: {query!r} lists nothing: {resp}"


def check_rules(prom: PrometheusProc) -> None:
    """The alerting rules are loaded and evaluate without error against real series."""
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    expected = {r["alert"] for g in doc["groups"] for r in g["rules"]}

    def evaluated() -> dict[str, Any] | None:
        groups = prom.api("rules")["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        never = "0001-01-01"  # lastEvaluation of a rule not evaluated yet
        done = set(rules) == expected and all(not r.get("lastEvaluation", never).startswith(never)
                                              for r in rules.values())
        return rules if done else None

    rules = wait_for(evaluated, 20, 0.5, "the alerting rules to be loaded and evaluated")
    bad = {name: r.get("lastError") for name, r in rules.items() if r["health"] != "ok"}
    assert not bad, f"alerting rules failing to evaluate: {bad}"
