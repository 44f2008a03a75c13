"""The container image: built from the Dockerfile with podman, smoke-run against the local stack.

``tools.image`` builds it the way this machine allows (a stand-in base, runc, ulimits).
The container shares the host's network, so it reaches dynalite, moto and the fake
upstream on loopback exactly as a task reaches AWS: through the SDK's standard settings.
Without podman the test is skipped, except under ``CI=true``, where it must run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.procs import UpstreamProc, scan_all, seed_items, wait_for
from bench.profile import fast
from fleetd import config
from fleetd.config import Config
from fleetd.devstack import DevStack
from tools import image

STREAMS = 6
NAME = "fleetd-image-test"


def _podman_or_skip() -> None:
    if shutil.which("podman") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("podman is missing under CI=true (.ci/run installs it)")
        pytest.skip("podman is not installed (.ci/run installs podman, runc and mmdebstrap)")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _podman_or_skip()
    log = tmp_path_factory.mktemp("image") / "build.log"
    try:
        took = image.build(image.IMAGE_TAG, log)
    except subprocess.CalledProcessError as exc:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        pytest.fail(f"image build failed ({exc}):\n{tail}")
    print(f"\nimage built in {took:.1f} s (log {log})")
    yield image.IMAGE_TAG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def container_env(stack: DevStack, cfg: Config, metrics_port: int) -> list[str]:
    """``-e`` options: the stack's endpoints and credentials, the test's tables, fast timings."""
    env = {**stack.env(), **config.as_env(fast(cfg)),
           "FLEETD_METRICS_ADDR": f"127.0.0.1:{metrics_port}", "FLEETD_SHARDS": "2"}
    return [opt for k, v in sorted(env.items()) for opt in ("-e", f"{k}={v}")]


def podman_run(built: str, env: list[str], *args: str, detach: bool = False) -> subprocess.CompletedProcess[str]:
    opts = ["run", "--network", "host", *image.podman_run_options(), *env]
    opts += ["-d", "--name", NAME] if detach else ["--rm"]
    return image.podman(*opts, built, *args, check=False, capture=True, timeout=120)


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def owners(cfg: Config) -> dict[str, str]:
    return {i["connection_id"]["S"]: i.get("lease_owner", {}).get("S", "")
            for i in scan_all(cfg.aws.connections_table, ConsistentRead=True)}


def test_the_image_builds_streams_as_non_root_and_stops_cleanly(
        built: str, stack: DevStack, cfg: Config, tmp_path: Path) -> None:
    port = free_port()
    env = container_env(stack, cfg, port)
    check = podman_run(built, env, "init", "--check")
    assert check.returncode == 0, f"init --check in the image: {check.stdout}{check.stderr}"
    # The tracing extra is in the image (deploy/fleetd.yaml's Tracing=enabled needs nothing more).
    otel = image.podman("run", "--rm", "--entrypoint", "python", *image.podman_run_options(), built, "-c",
                        "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        check=False, capture=True, timeout=120)
    assert otel.returncode == 0, f"fleetd[otel] in the image: {otel.stdout}{otel.stderr}"

    up = UpstreamProc(tmp_path, rate=4.0, size=120)
    image.podman("rm", "-f", NAME, check=False, capture=True)
    try:
        ids = [f"img-{i}" for i in range(STREAMS)]
        seed_items(cfg.aws.connections_table, {cid: up.url(cid) for cid in ids})
        started = podman_run(built, env, "run", detach=True)
        assert started.returncode == 0, started.stderr

        wait_for(lambda: http_status(port, "/readyz") == 200, 60, 0.5, "/readyz 200 from the container")
        wait_for(lambda: all(owners(cfg).values()), 30, 0.5, "every stream leased by the container")
        wait_for(lambda: all(up.stats().get(cid, {}).get("sent", 0) > 0 for cid in ids), 30, 0.5,
                 "every stream streaming")

        health = image.podman("healthcheck", "run", NAME, check=False, capture=True)
        assert health.returncode == 0, f"HEALTHCHECK: {health.stdout}{health.stderr}"

        top = image.podman("top", NAME, "user", "pid", "args", capture=True).stdout.splitlines()
        procs = [line.split(None, 2) for line in top[1:] if line.strip()]
        assert len(procs) >= 3, top  # the supervisor and its two shards
        assert all(user != "root" and user != "0" for user, _, _ in procs), top

        stopped = image.podman("stop", "-t", "30", NAME, check=False, capture=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        state = json.loads(image.podman("inspect", NAME, "--format", "{{json .State}}", capture=True).stdout)
        assert state["ExitCode"] == 0, state
        assert not any(owners(cfg).values()), f"leases left after podman stop: {owners(cfg)}"
    finally:
        logs = image.podman("logs", NAME, check=False, capture=True)
        (tmp_path / "container.log").write_text(logs.stdout + logs.stderr)
        image.podman("rm", "-f", NAME, check=False, capture=True)
        up.stop()

