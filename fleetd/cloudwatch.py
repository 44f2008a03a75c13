"""Publishing the task's metrics to CloudWatch: ActiveConnections, and counts worth an alarm.

Every task publishes the same metrics under the same dimensions (``ClusterName``,
``ServiceName``; no per-task dimension, which would create a billed metric per task
incarnation).  ``ActiveConnections`` is a gauge whose Average Application Auto Scaling
targets (NOTES.md).  The others are counts of what the task's shards counted since the
previous publication, so their Sum over the service's tasks is the fleet's count per period;
each is the growth of existing shard counters (:data:`COUNTS`):

* ``LeaseAcquisitionFailures`` — claims not won: ``lease_claims_total`` with result
  ``lost`` (a peer was first, or the item stopped), ``retryable`` or ``fatal``;
* ``SelfFences`` — ``self_fence_total``;
* ``Takeovers`` — streams won by the reconcile loop, ``reconcile_claims_total``: the
  streams of dead sessions (and of expired item leases), and free streams no hint announced;
* ``UpstreamReconnects`` — ``upstream_reconnects_total``.

A count is never negative and never counts an event twice: it is the growth of task-wide
totals that do not decrease across shard restarts (``FleetCollector.task_counters``), measured
from a mark that only a successful publication moves (a failed one leaves its counts to the next).

Modes (``cloudwatch_mode``):

* ``api`` — PutMetricData through a synchronous botocore client in a daemon thread;
  a failed call is logged and the next interval tries again, never fatal;
* ``emf`` — one CloudWatch Embedded Metric Format JSON line on stdout, which the
  awslogs driver ships and CloudWatch turns into the metrics (cheaper than the API);
* ``off`` — nothing.

The endpoint comes from the SDK's standard settings (``AWS_ENDPOINT_URL_CLOUDWATCH``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TextIO

import orjson

from fleetd.config import AwsConfig, RuntimeConfig
from fleetd.stats import Key

log = logging.getLogger("fleetd.cloudwatch")

METRIC_NAME = "ActiveConnections"
# Each count → the shard counters (``fleetd.stats`` keys: name, sorted labels) whose growth it is.
COUNTS: dict[str, tuple[Key, ...]] = {
    "LeaseAcquisitionFailures": tuple(("lease_claims_total", (("result", r),)) for r in ("lost", "retryable", "fatal")),
    "SelfFences": (("self_fence_total", ()),),
    "Takeovers": (("reconcile_claims_total", ()),),
    "UpstreamReconnects": (("upstream_reconnects_total", ()),),
}
METRIC_NAMES = (METRIC_NAME, *COUNTS)


class Source(Protocol):
    """What a publication reads: the supervisor's ``FleetCollector`` (thread-safe)."""

    def task_active_connections(self) -> float: ...

    def task_counters(self, keys: Iterable[Key]) -> dict[Key, float]: ...


def count_totals(source: Source) -> dict[str, float]:
    """Each count's task-wide total since the task started (never decreasing)."""
    by_key = source.task_counters(k for keys in COUNTS.values() for k in keys)
    return {name: sum(by_key.get(k, 0.0) for k in keys) for name, keys in COUNTS.items()}


class Counts:
    """Per-publication counts: how far the totals grew past the mark of the last successful one.

    The mark never goes down, so totals that dropped (they should not) count nothing until
    they pass it again: no count is ever negative, and no event is counted twice."""

    def __init__(self) -> None:
        self._mark = dict.fromkeys(COUNTS, 0.0)

    def since(self, totals: Mapping[str, float]) -> dict[str, float]:
        return {name: max(0.0, totals[name] - self._mark[name]) for name in COUNTS}

    def commit(self, totals: Mapping[str, float]) -> None:
        for name in COUNTS:
            self._mark[name] = max(self._mark[name], totals[name])


def dimensions(rt: RuntimeConfig) -> list[dict[str, str]]:
    return [{"Name": "ClusterName", "Value": rt.cluster_name}, {"Name": "ServiceName", "Value": rt.service_name}]


def _values(active: float, counts: Mapping[str, float] | None) -> dict[str, float]:
    """ActiveConnections first, then every count (0 when not given: an alarm sees data, not a gap)."""
    return {METRIC_NAME: float(active), **{name: float((counts or {}).get(name, 0.0)) for name in COUNTS}}


def put_metric_data_request(rt: RuntimeConfig, active: float,
                            counts: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The PutMetricData parameters of one publication."""
    dims = dimensions(rt)
    return {
        "Namespace": rt.cloudwatch_namespace,
        "MetricData": [{"MetricName": name, "Dimensions": dims, "Value": value, "Unit": "Count"}
                       for name, value in _values(active, counts).items()],
    }


def emf_line(rt: RuntimeConfig, active: float, counts: Mapping[str, float] | None = None,
             now_ms: int | None = None) -> str:
    """One Embedded Metric Format record (a JSON object on one line)."""
    values = _values(active, counts)
    record = {
        "_aws": {
            "Timestamp": int(time.time() * 1000) if now_ms is None else now_ms,
            "CloudWatchMetrics": [{
                "Namespace": rt.cloudwatch_namespace,
                "Dimensions": [["ClusterName", "ServiceName"]],
                "Metrics": [{"Name": name, "Unit": "Count"} for name in values],
            }],
        },
        "ClusterName": rt.cluster_name,
        "ServiceName": rt.service_name,
        **values,
    }
    return orjson.dumps(record).decode()


class Publisher:
    """Publishes the source's metrics every ``cloudwatch_s`` from a daemon thread until :meth:`stop`.

    The constructor is pure: the thread and, in ``api`` mode, the client are created by
    :meth:`start`.
    """

    def __init__(self, rt: RuntimeConfig, aws: AwsConfig, source: Source, out: TextIO | None = None) -> None:
        self.rt = rt
        self.aws = aws
        self.source = source
        self.out = out  # None: sys.stdout at publication time
        self.published = 0
        self.errors = 0
        self._counts = Counts()
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
            active = self.source.task_active_connections()
            totals = count_totals(self.source)
            counts = self._counts.since(totals)
            if self.rt.cloudwatch_mode == "emf":
                out = self.out or sys.stdout
                out.write(emf_line(self.rt, active, counts) + "\n")
                out.flush()
            elif self.rt.cloudwatch_mode == "api":
                self._api_client().put_metric_data(**put_metric_data_request(self.rt, active, counts))
        except Exception as e:
            self.errors += 1
            log.warning("CloudWatch publication failed", extra={"error": f"{type(e).__name__}: {e}",
                                                                  "mode": self.rt.cloudwatch_mode})
            return False
        self._counts.commit(totals)
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
