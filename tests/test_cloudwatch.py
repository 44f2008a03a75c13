"""ActiveConnections publication: PutMetricData against moto, and the EMF line on stdout."""

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
from fleetd.config import Config, replace
from fleetd.devstack import DevStack


def statistics(cfg: Config) -> list[dict[str, Any]]:
    cw = boto3.client("cloudwatch")  # the stack's AWS_ENDPOINT_URL_CLOUDWATCH is in the environment
    now = dt.datetime.now(dt.UTC)
    resp = cw.get_metric_statistics(
        Namespace=cfg.runtime.cloudwatch_namespace, MetricName="ActiveConnections",
        Dimensions=cloudwatch.dimensions(cfg.runtime), StartTime=now - dt.timedelta(minutes=5),
        EndTime=now + dt.timedelta(minutes=5), Period=60, Statistics=["Maximum", "SampleCount"])
    return list(resp["Datapoints"])


def test_api_mode_publishes_to_cloudwatch(stack: DevStack, cfg: Config) -> None:
    # Unique dimensions: the moto server is shared by every test of the run.
    cfg = replace(cfg, cloudwatch_mode="api", cluster_name=f"c-{uuid.uuid4().hex[:8]}", service_name="svc")
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, lambda: 137.0)
    assert pub.publish_once()
    points = statistics(cfg)
    assert len(points) == 1
    assert points[0]["Maximum"] == 137.0 and points[0]["SampleCount"] == 1


def test_api_mode_runs_on_its_interval_and_survives_errors(stack: DevStack, cfg: Config) -> None:
    cfg = replace(cfg, cloudwatch_mode="api", cloudwatch_s=0.2, cluster_name=f"c-{uuid.uuid4().hex[:8]}")
    calls = 0

    def value() -> float:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("collector broke")
        return 5.0

    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, value)
    pub.start()
    try:
        deadline = time.monotonic() + 10
        while pub.published < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pub.stop()
    assert pub.errors == 1 and pub.published >= 2
    assert statistics(cfg)[0]["Maximum"] == 5.0


def test_api_mode_error_is_logged_not_raised(cfg: Config, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH", "http://127.0.0.1:9")  # nothing listens on port 9
    cfg = replace(cfg, cloudwatch_mode="api", aws_timeout_s=0.5, aws_max_attempts=1)
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, lambda: 1.0)
    assert not pub.publish_once()
    assert pub.errors == 1
    assert any("CloudWatch publication failed" in r.getMessage() for r in caplog.records)


def test_emf_mode_prints_one_valid_line(cfg: Config, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = replace(cfg, cloudwatch_mode="emf", cluster_name="prod", service_name="streams")
    assert cloudwatch.Publisher(cfg.runtime, cfg.aws, lambda: 42.0).publish_once()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    check_emf(json.loads(lines[0]), "prod", "streams", 42.0)


def check_emf(record: dict[str, Any], cluster: str, service: str, value: float) -> None:
    meta = record["_aws"]
    assert isinstance(meta["Timestamp"], int) and abs(meta["Timestamp"] - time.time() * 1000) < 60_000
    directive = meta["CloudWatchMetrics"][0]
    assert directive["Namespace"] == "WsFleet"
    assert directive["Dimensions"] == [["ClusterName", "ServiceName"]]
    assert directive["Metrics"] == [{"Name": "ActiveConnections", "Unit": "Count"}]
    assert record["ClusterName"] == cluster and record["ServiceName"] == service
    assert record["ActiveConnections"] == value


def test_off_mode_starts_no_thread(cfg: Config) -> None:
    out = io.StringIO()
    pub = cloudwatch.Publisher(cfg.runtime, cfg.aws, lambda: 1.0, out=out)
    pub.start()
    pub.stop()
    assert cfg.runtime.cloudwatch_mode == "off"
    assert pub.published == 0 and out.getvalue() == ""


def test_put_metric_data_request_has_no_per_task_dimension(cfg: Config) -> None:
    req = cloudwatch.put_metric_data_request(cfg.runtime, 3)
    assert req["Namespace"] == "WsFleet"
    assert {d["Name"] for d in req["MetricData"][0]["Dimensions"]} == {"ClusterName", "ServiceName"}
