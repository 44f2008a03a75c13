# syntax=docker/dockerfile:1
# fleetd: one supervisor process per ECS task, with one shard process per usable CPU.
#
#   docker build -t fleetd .
#   docker run --rm -p 9108:9108 -e AWS_REGION=eu-west-1 fleetd          # = fleetd run
#   docker run --rm fleetd init --check                                   # any sub-command
#
# Stage 1 builds fleetd's wheel and the wheels of all its dependencies (pinned with hashes in
# requirements.lock); stage 2 installs them offline into a fresh slim image, so no compiler,
# pip cache or source tree ends up in the runtime image. The base image is a build argument:
# pin it by digest in production (--build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:…).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# The dependencies first, exactly as pinned (with hashes) in requirements.lock: a layer that stays
# cached until the lock changes. uvloop, picows and orjson ship manylinux wheels for linux/amd64 and
# linux/arm64, so no compiler is needed; `pip wheel` fails loudly if that ever stops being true.
COPY requirements.lock ./
RUN pip wheel --require-hashes --wheel-dir /wheels -r requirements.lock
# Then what fleetd's own wheel is made of (see .dockerignore); its dependencies are already there.
COPY pyproject.toml README.md ./
COPY fleetd ./fleetd
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="fleetd" \
      org.opencontainers.image.description="Long-lived outbound WebSocket streams leased through DynamoDB" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# Offline install from stage 1's wheels only (--no-index): the runtime image never talks to PyPI.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "$(echo /wheels/fleetd-*.whl)[otel]" \
    && groupadd --system --gid 10001 fleetd \
    && useradd --system --uid 10001 --gid fleetd --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin fleetd

# Inside a task Prometheus scrapes the task's ENI address, so the endpoint must listen on
# every interface here (the package default is loopback only: binding wide is a deliberate,
# explicit choice of this image). Logs are JSON lines on stdout for the awslogs driver.
ENV FLEETD_METRICS_ADDR=0.0.0.0:9108 \
    FLEETD_LOG_FORMAT=json

# Numeric, so the runtime (and runAsNonRoot-style checks) can verify it is not root.
USER 10001:10001
EXPOSE 9108

# No tini: `fleetd run` is a proper PID 1. The supervisor installs its own SIGTERM/SIGINT/SIGCHLD
# handlers (PID 1 gets no default signal dispositions), forwards SIGTERM to its shards, SIGKILLs
# stragglers after the shutdown budget, and reaps orphaned children re-parented to it
# (fleetd.supervisor.reap_orphans). An init in front of it would only add a process to signal.
STOPSIGNAL SIGTERM

# The image has no curl: a Python one-liner asks the supervisor's /healthz on the port of
# FLEETD_METRICS_ADDR (so a container run with another address stays healthy). ECS ignores this
# instruction and uses the task definition's healthCheck (deploy/fleetd.yaml), which runs the same command.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('FLEETD_METRICS_ADDR', ':9108').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=3)"]

ENTRYPOINT ["fleetd"]
CMD ["run"]
