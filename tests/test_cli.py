"""The ``fleetd`` command line: bad input is exit 2 and exactly one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetd import exits
from tests.helpers import run_cli


def fleetd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


@pytest.fixture(autouse=True)
def no_fleetd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here fails before any AWS call; keep a developer's FLEETD_* out of it."""
    for name in list(os.environ):
        if name.startswith("FLEETD_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("argv", "fragment"), [
    ([], "required: command"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["ctl"], "required: COMMAND"),
    (["ctl", "bogus"], "invalid choice: 'bogus'"),
    (["ctl", "start", "only-an-id"], "required: URL"),
    (["ctl", "stop"], "required: ID"),
    (["ctl", "show"], "required: ID"),
    (["ctl", "ls", "extra"], "unrecognized arguments: extra"),
    (["init", "--bogus"], "unrecognized arguments: --bogus"),
    (["init", "--lease-ttl-s"], "expected one argument"),
    (["init", "--lease-ttl-s", "soon"], "--lease-ttl-s: invalid lease_ttl_s"),
    (["ctl", "ls", "--lease-mode", "eager"], "invalid lease_mode"),
    (["shard", "--index", "x"], "invalid int value"),
])
def test_bad_command_lines_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                fragment: str) -> None:
    code, out, err = fleetd(capsys, *argv)
    assert (code, out) == (exits.USAGE, "")
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fleetd: error: ") and fragment in lines[0], err


def test_bad_command_line_in_a_real_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    proc = subprocess.run([sys.executable, "-m", "fleetd", "ctl", "start"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == exits.USAGE and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("fleetd: error: ")


def test_top_level_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "--help")
    assert (code, err) == (exits.OK, "")
    assert out.startswith("usage: fleetd") and "ctl" in out and "init" in out


@pytest.mark.parametrize("argv", [["init", "--help"], ["ctl", "--help"], ["ctl", "start", "--help"]])
def test_sub_command_help_exits_0(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = fleetd(capsys, *argv)
    assert (code, err) == (exits.OK, "")
    assert out.startswith("usage: fleetd")
    if argv[0] == "ctl":  # where config flags go is documented
        assert "before or after the command" in out
