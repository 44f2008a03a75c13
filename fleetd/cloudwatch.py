"""Publishing the task's ActiveConnections to CloudWatch for ECS target tracking.

Every task publishes the same metric under the same dimensions (``ClusterName``,
``ServiceName``; no per-task dimension, which would create a billed metric per task
incarnation), and Application Auto Scaling targets the Average (NOTES.md).

Modes (``cloudwatch_mode``):

* ``api`` — PutMetricData through a synchronous botocore client in a daemon thread;
  a failed call is logged and the next interval tries again, never fatal;
* ``emf`` — one CloudWatch Embedded Metric Format JSON line on stdout, which the
  awslogs driver ships and CloudWatch turns into the metric (cheaper than the API);
* ``off`` — nothing.

The endpoint comes from the SDK's standard settings (``AWS_ENDPOINT_URL_CLOUDWATCH``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import orjson

from fleetd.config import AwsConfig, RuntimeConfig

log = logging.getLogger("fleetd.cloudwatch")

METRIC_NAME = "ActiveConnections"


def dimensions(rt: RuntimeConfig) -> list[dict[str, str]]:
    return [{"Name": "ClusterName", "Value": rt.cluster_name}, {"Name": "ServiceName", "Value": rt.service_name}]


def put_metric_data_request(rt: RuntimeConfig, value: float) -> dict[str, Any]:
    """The PutMetricData parameters of one publication."""
    return {
        "Namespace": rt.cloudwatch_namespace,
        "MetricData": [{"MetricName": METRIC_NAME, "Dimensions": dimensions(rt), "Value": float(value),
                        "Unit": "Count"}],
    }


def emf_line(rt: RuntimeConfig, value: float, now_ms: int | None = None) -> str:
    """One Embedded Metric Format record (a JSON object on one line)."""
    record = {
        "_aws": {
            "Timestamp": int(time.time() * 1000) if now_ms is None else now_ms,
            "CloudWatchMetrics": [{
                "Namespace": rt.cloudwatch_namespace,
                "Dimensions": [["ClusterName", "ServiceName"]],
                "Metrics": [{"Name": METRIC_NAME, "Unit": "Count"}],
            }],
        },
        "ClusterName": rt.cluster_name,
        "ServiceName": rt.service_name,
        METRIC_NAME: float(value),
    }
    return orjson.dumps(record).decode()


class Publisher:
    """Publishes ``value()`` every ``cloudwatch_s`` from a daemon thread until :meth:`stop`.

    ``value`` must be thread-safe (the supervisor passes
    ``FleetCollector.task_active_connections``).  The constructor is pure: the thread
    and, in ``api`` mode, the client are created by :meth:`start`.
    """

    def __init__(self, rt: RuntimeConfig, aws: AwsConfig, value: Callable[[], float],
                 out: TextIO | None = None) -> None:
        self.rt = rt
        self.aws = aws
        self.value = value
        self.out = out  # None: sys.stdout at publication time
        self.published = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None

    def start(self) -> None:
        if self.rt.cloudwatch_mode == "off":
            return
        self._thread = threading.Thread(target=self._loop, name="cloudwatch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        # First publication after one interval: shards need that long to report their connections.
        while not self._stop.wait(self.rt.cloudwatch_s):
            self.publish_once()

    def publish_once(self) -> bool:
        """One publication; errors are logged and counted, never raised."""
        try:
            value = self.value()
            if self.rt.cloudwatch_mode == "emf":
                out = self.out or sys.stdout
                out.write(emf_line(self.rt, value) + "\n")
                out.flush()
            elif self.rt.cloudwatch_mode == "api":
                self._api_client().put_metric_data(**put_metric_data_request(self.rt, value))
        except Exception as e:
            self.errors += 1
            log.warning("CloudWatch publication failed", extra={"error": f"{type(e).__name__}: {e}",
                                                                  "mode": self.rt.cloudwatch_mode})
            return False
        self.published += 1
        return True

    def _api_client(self) -> Any:
        if self._client is None:
            # Synchronous botocore: this thread has no event loop, and one call per interval needs none.
            import botocore.config
            import botocore.session

            from fleetd.aws import region_of

            session = botocore.session.get_session()
            self._client = session.create_client(
                "cloudwatch", region_name=region_of(self.aws),
                config=botocore.config.Config(connect_timeout=self.aws.aws_timeout_s,
                                              read_timeout=self.aws.aws_timeout_s,
                                              retries={"mode": "standard", "max_attempts": self.aws.aws_max_attempts}),
            )
        return self._client
