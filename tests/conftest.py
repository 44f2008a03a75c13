"""Shared fixtures: one local AWS stack per test session, fresh tables per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetd import config
from fleetd.devstack import DevStack
from tests.helpers import fresh_config


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="fault suite: run >= 20 randomized trials per scenario instead of the CI few")


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under ``pytest --long``."""
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    """dynalite + moto server for the whole run; their env is exported to this process."""
    log_dir = Path(tmp_path_factory.mktemp("devstack"))
    with DevStack(log_dir=log_dir) as s:
        saved = {k: os.environ.get(k) for k in s.env()}
        s.apply_env()
        yield s
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def cfg(stack: DevStack) -> config.Config:
    """A config whose tables and queue are unique to this test, created with `init`."""
    return fresh_config("t")
