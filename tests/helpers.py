"""Small helpers for tests that drive async code against the local stack."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import pytest
import uvloop

from fleetd import cli, config, schema
from fleetd.aws import Clients, open_clients
from fleetd.config import Config

T = TypeVar("T")


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh uvloop event loop (as a shard does)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


@asynccontextmanager
async def clients(cfg: Config) -> AsyncIterator[Clients]:
    async with AsyncExitStack() as stack:
        yield await open_clients(stack, cfg.aws)


def fresh_config(letter: str = "t") -> Config:
    """A config whose tables and queue are unique (``<letter><10 hex>-…``), created with `init`."""
    prefix = f"{letter}{uuid.uuid4().hex[:10]}"
    c = config.replace(
        config.load(env={}),
        connections_table=f"{prefix}-connections",
        sessions_table=f"{prefix}-sessions",
        messages_table=f"{prefix}-messages",
        hints_queue=f"{prefix}-hints",
        allowed_schemes=("ws", "wss"),
        allowed_networks=config.LOOPBACK_NETWORKS,  # the fake upstreams listen on loopback
    )
    arun(init_tables(c))
    return c


async def init_tables(cfg: Config) -> list[str]:
    async with clients(cfg) as c:
        return await schema.init(c.dynamodb, c.sqs, cfg.aws)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``fleetd ARGV`` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    out = capsys.readouterr()
    assert isinstance(exc.value.code, int)
    return exc.value.code, out.out, out.err
