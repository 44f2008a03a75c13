"""CloudWatch publication: PutMetricData read back from moto, and the EMF line on stdout.

The source is the supervisor's real ``FleetCollector``, fed shard snapshots built with
``fleetd.stats.Stats`` under the counter names the shards increment.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import time
import uuid
from typing import Any

import boto3
import pytest

from fleetd import cloudwatch
from fleetd.config import Config, RuntimeConfig, replace
from fleetd.devstack import DevStack
from fleetd.metrics import FleetCollector
from fleetd.stats import Stats
from tests.test_ops import Resolver, plain, resources_of, task_env, template

COUNT_NAMES = ("LeaseAcquisitionFailures", "SelfFences", "Takeovers", "UpstreamReconnects")


class Shard:
    """One shard incarnation's counters, reported to the collector as the child does (absolute snapshots)."""

    def __init__(self, collector: FleetCollector, index: int, pid: int, restart: bool = False) -> None:
        self.collector, self.index = collector, index
        self.stats = Stats()
        collector.shard_started(index, pid, restart=restart)

    def report(self, active: int = 0, *, claims_won: int = 0, claims_lost: int = 0, claims_retryable: int = 0,
               claims_fatal: int = 0, self_fences: int = 0, takeovers: int = 0, reconnects: int = 0) -> None:
        """Count these events (on top of what this incarnation counted before), then send a snapshot."""
        s = self.stats
        for result, n in (("won", claims_won), ("lost", claims_lost), ("retryable", claims_retryable),
                          ("fatal", claims_fatal)):
            if n:
                s.inc("lease_claims_total", n, result=result)
        if self_fences:
            s.inc("self_fence_total", self_fences)
        if takeovers:
            s.inc("reconcile_claims_total", takeovers)
        if reconnects:
            s.inc("upstream_reconnects_total", reconnects)
        s.inc("hint_claims_total", 50)  # counted by the shards, published by none of the metrics
        s.set("active_connections", active)
        self.collector.update(self.index, s.snapshot())

    def die(self) -> None:
        self.collector.shard_exited(self.index)


def one_shard(active: int = 0, **counts: int) -> FleetCollector:
    c = FleetCollector(1)
    Shard(c, 0, pid=100).report(active, **counts)
    return c


def unique(cfg: Config, **changes: Any) -> Config:
    # Unique dimensions: the moto server is shared by every test of the run.
    return replace(cfg, cluster_name=f"c-{uuid.uuid4().hex[:8]}", service_name="svc", **changes)


def statistics(cfg: Config, metric: str = "ActiveConnections") -> list[dict[str, Any]]:
    cw = boto3.client("cloudwatch")  # the stack's AWS_ENDPOINT_URL_CLOUDWATCH is in the environment
    now = dt.datetime.now(dt.UTC)
    resp = cw.get_metric_statistics(
        Namespace=cfg.runtime.cloudwatch_namespace, MetricName=metric,
        Dimensions=cloudwatch.dimensions(cfg.runtime), StartTime=now - dt.timedelta(minutes=5),
        EndTime=now + dt.timedelta(minutes=5), Period=3600, Statistics=["Maximum", "Minimum", "Sum", "SampleCount"])
    return list(resp["Datapoints"])


def published(cfg: Config, metric: str) -> tuple[float, float, float, float]:
    """(SampleCount, Sum, Minimum, Maximum) of everything published under the test's dimensions."""
    (point,) = statistics(cfg, metric)
    return point["SampleCount"], point["Sum"], point["Minimum"], point["Maximum"]


def test_api_mode_publishes_to_cloudwatch(stack: DevStack, cfg: Config) -> None:
    cfg = unique(cfg, cloudwatch_mode="api")
    source = one_shard(137, claims_won=9, claims_lost=3, claims_retryable=2, claims_fatal=1, self_fences=4,
                       takeovers=6, reconnects=11)
    assert cloudwatch.Publisher(cfg.runtime, cfg.aws, source).publish_once()
    assert published(cfg, "ActiveConnections") == (1, 137.0, 137.0, 137.0)
    assert published(cfg, "LeaseAcquisitionFailures") == (1, 6.0, 6.0, 6.0)  # lost + retryable + fatal, not won
    assert published(cfg, "SelfFences") == (1, 4.0, 4.0, 4.0)
    assert published(cfg, "Takeovers") == (1, 6.0, 6.0, 6.0)
    assert published(cfg, "UpstreamReconnects") == (1, 11.0, 11.0, 11.0)


def test_api_mode_publishes_counts_per_interval_across_a_shard_restart(stack: DevStack, cfg: Config) -> None:
    cfg = unique(cfg, cloudwatch_mode="api")
    c = FleetCollector(2)
    first, other = Shard(c, 0, pid=100), Shard(c, 1, pid=101)
    first.report(self_fences=5, reconnects=20)
    other.report(reconnects=1)
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, c)
    assert pub.publish_once()  # self-fences 5, reconnects 21
    first.report(self_fences=3, reconnects=2)  # its final snapshot: 8 and 22 since it started
    first.die()
    second = Shard(c, 0, pid=102, restart=True)  # counts from 0 again
    second.report(self_fences=1, reconnects=1)
    assert pub.publish_once()  # the dead one's last 3 and 2, the new one's 1 and 1
    assert pub.publish_once()  # nothing happened
    assert published(cfg, "SelfFences") == (3, 9.0, 0.0, 5.0)
    assert published(cfg, "UpstreamReconnects") == (3, 24.0, 0.0, 21.0)
    assert published(cfg, "Takeovers") == (3, 0.0, 0.0, 0.0)  # published at 0: an alarm sees data


def test_emf_counts_never_go_negative_or_double_across_restarts(cfg: Config) -> None:
    cfg = replace(cfg, cloudwatch_mode="emf")
    out = io.StringIO()
    c = FleetCollector(2)
    shard0, shard1 = Shard(c, 0, pid=100), Shard(c, 1, pid=101)
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, c, out=out)
    shard0.report(10, claims_lost=4, self_fences=2, takeovers=7, reconnects=3)
    shard1.report(5, takeovers=1)
    assert pub.publish_once()
    shard0.report(10, claims_lost=1, takeovers=2)
    shard0.die()  # folded: its counts stay in the task's totals
    assert pub.publish_once()
    shard0 = Shard(c, 0, pid=102, restart=True)  # started, not reported yet
    assert pub.publish_once()
    shard0.report(3, claims_lost=2, self_fences=1, takeovers=3, reconnects=1)  # below the dead one's totals
    shard1.report(5, reconnects=2)
    assert pub.publish_once()
    shard0.die()
    shard0 = Shard(c, 0, pid=103, restart=True)
    shard0.report(0)  # a crash loop: a new incarnation with nothing counted
    assert pub.publish_once()
    counts = [{name: rec[name] for name in COUNT_NAMES} for rec in map(json.loads, out.getvalue().splitlines())]
    assert counts == [
        {"LeaseAcquisitionFailures": 4.0, "SelfFences": 2.0, "Takeovers": 8.0, "UpstreamReconnects": 3.0},
        {"LeaseAcquisitionFailures": 1.0, "SelfFences": 0.0, "Takeovers": 2.0, "UpstreamReconnects": 0.0},
        {"LeaseAcquisitionFailures": 0.0, "SelfFences": 0.0, "Takeovers": 0.0, "UpstreamReconnects": 0.0},
        {"LeaseAcquisitionFailures": 2.0, "SelfFences": 1.0, "Takeovers": 3.0, "UpstreamReconnects": 3.0},
        {"LeaseAcquisitionFailures": 0.0, "SelfFences": 0.0, "Takeovers": 0.0, "UpstreamReconnects": 0.0},
    ]
    totals = cloudwatch.count_totals(c)
    for name in COUNT_NAMES:  # every event counted exactly once
        assert sum(n[name] for n in counts) == totals[name]


def test_counts_never_negative_nor_twice_if_totals_drop() -> None:
    counts = cloudwatch.Counts()
    zero = dict.fromkeys(COUNT_NAMES, 0.0)
    high = {**zero, "SelfFences": 10.0}
    counts.commit(high)
    assert counts.since({**zero, "SelfFences": 7.0})["SelfFences"] == 0.0  # never negative
    counts.commit({**zero, "SelfFences": 7.0})
    assert counts.since({**zero, "SelfFences": 12.0})["SelfFences"] == 2.0  # 8..10 were published already


class Flaky(FleetCollector):
    """The collector, whose first reading fails."""

    def __init__(self) -> None:
        super().__init__(1)
        self.calls = 0

    def task_active_connections(self) -> float:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("collector broke")
        return super().task_active_connections()


def test_api_mode_runs_on_its_interval_and_survives_errors(stack: DevStack, cfg: Config) -> None:
    cfg = unique(cfg, cloudwatch_mode="api", cloudwatch_s=0.2)
    source = Flaky()
    Shard(source, 0, pid=100).report(5, self_fences=3)
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, source)
    pub.start()
    try:
        deadline = time.monotonic() + 10
        while pub.published < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pub.stop()
    assert pub.errors == 1 and pub.published >= 2
    assert statistics(cfg)[0]["Maximum"] == 5.0
    samples, total, _, _ = published(cfg, "SelfFences")
    assert samples == pub.published and total == 3.0  # the failed interval's counts went out with the next


def test_api_mode_error_is_logged_not_raised_and_keeps_the_counts(cfg: Config, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH", "http://127.0.0.1:9")  # nothing listens on port 9
    cfg = replace(cfg, cloudwatch_mode="api", aws_timeout_s=0.5, aws_max_attempts=1)
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, one_shard(1, takeovers=2))
    assert not pub.publish_once()
    assert pub.errors == 1
    assert any("CloudWatch publication failed" in r.getMessage() for r in caplog.records)
    pub.rt, pub.out = replace(cfg, cloudwatch_mode="emf").runtime, io.StringIO()
    assert pub.publish_once()
    assert json.loads(pub.out.getvalue())["Takeovers"] == 2.0


def test_emf_mode_prints_one_valid_line(cfg: Config, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = replace(cfg, cloudwatch_mode="emf", cluster_name="prod", service_name="streams")
    source = one_shard(42, claims_won=1, claims_fatal=2, self_fences=1, takeovers=3, reconnects=4)
    assert cloudwatch.Publisher(cfg.runtime, cfg.aws, source).publish_once()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    check_emf(json.loads(lines[0]), "prod", "streams", {
        "ActiveConnections": 42.0, "LeaseAcquisitionFailures": 2.0, "SelfFences": 1.0, "Takeovers": 3.0,
        "UpstreamReconnects": 4.0})


def check_emf(record: dict[str, Any], cluster: str, service: str, values: dict[str, float]) -> None:
    meta = record["_aws"]
    assert isinstance(meta["Timestamp"], int) and abs(meta["Timestamp"] - time.time() * 1000) < 60_000
    (directive,) = meta["CloudWatchMetrics"]
    assert directive["Namespace"] == "WsFleet"
    assert directive["Dimensions"] == [["ClusterName", "ServiceName"]]
    assert directive["Metrics"] == [{"Name": name, "Unit": "Count"} for name in values]
    assert record["ClusterName"] == cluster and record["ServiceName"] == service
    assert {name: record[name] for name in values} == values
    assert set(record) == {"_aws", "ClusterName", "ServiceName", *values}


def test_off_mode_starts_no_thread(cfg: Config) -> None:
    out = io.StringIO()
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, one_shard(1), out=out)
    pub.start()
    pub.stop()
    assert cfg.runtime.cloudwatch_mode == "off"
    assert pub.published == 0 and out.getvalue() == ""


def test_put_metric_data_request_has_no_per_task_dimension(cfg: Config) -> None:
    req = cloudwatch.put_metric_data_request(cfg.runtime, 3, {"SelfFences": 1})
    assert req["Namespace"] == "WsFleet"
    assert [m["MetricName"] for m in req["MetricData"]] == ["ActiveConnections", *COUNT_NAMES]
    for metric in req["MetricData"]:
        assert {d["Name"] for d in metric["Dimensions"]} == {"ClusterName", "ServiceName"}


def test_template_alarms_watch_the_counts_fleetd_publishes() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    env = task_env(tpl, resolve)
    rt = RuntimeConfig(cluster_name=env["FLEETD_CLUSTER_NAME"], service_name=env["FLEETD_SERVICE_NAME"],
                       cloudwatch_namespace=env["FLEETD_CLOUDWATCH_NAMESPACE"])
    req = cloudwatch.put_metric_data_request(rt, 1.0)
    alarms = resources_of(tpl, "AWS::CloudWatch::Alarm")
    watched = set()
    for name, alarm in alarms.items():
        assert alarm["Condition"] == "HasAlarms", f"{name} is not optional"
        props = plain(resolve(alarm["Properties"]))
        stats = [m["MetricStat"] for m in props["Metrics"] if "MetricStat" in m] if "Metrics" in props else [
            {"Metric": {k: props[k] for k in ("Namespace", "MetricName", "Dimensions")},
             "Stat": props["Statistic"], "Unit": props["Unit"]}]
        for stat in stats:
            metric = stat["Metric"]
            assert metric["Namespace"] == req["Namespace"]
            assert metric["MetricName"] in cloudwatch.COUNTS
            assert sorted(metric["Dimensions"], key=lambda d: d["Name"]) == cloudwatch.dimensions(rt)
            assert (stat["Stat"], stat["Unit"]) == ("Sum", "Count")  # the service's count per period
            watched.add(metric["MetricName"])
    assert watched == {"SelfFences", "LeaseAcquisitionFailures", "Takeovers"}
    assert not resolve.condition("HasAlarms")  # off unless asked for
