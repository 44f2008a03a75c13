"""The local AWS stack for tests, benchmarks and ``fleetd dev`` (SPEC §8).

Starts dynalite (DynamoDB, from ``node_modules``) and moto's server (SQS and
CloudWatch) as child processes on free loopback ports, waits until they answer,
and describes them as the AWS SDK's standard environment variables.  Children die
with us: each is in its own process group, gets SIGTERM through
``PR_SET_PDEATHSIG`` if this process dies, and is stopped by :meth:`DevStack.stop`
(also registered with :mod:`atexit`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

_PR_SET_PDEATHSIG = 1


class DevStackError(RuntimeError):
    """A local server could not be found or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_dynalite(start: Path | None = None) -> Path:
    """``node_modules/dynalite/cli.js`` in the current directory or above, or in the source tree."""
    explicit = os.environ.get("FLEETD_DYNALITE")
    if explicit:
        return Path(explicit)
    bases = [start or Path.cwd(), Path(__file__).resolve().parent]
    for base in bases:
        for d in (base, *base.parents):
            cli = d / "node_modules" / "dynalite" / "cli.js"
            if cli.exists():
                return cli
    raise DevStackError("dynalite not found: run `npm ci` in the fleetd checkout (see README)")


def spawn(argv: list[str], log_path: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a child that cannot outlive us (own process group, parent-death signal)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed by the child's exit
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        env=env,
    )


def terminate(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM the child's process group, SIGKILL it if it lingers, reap it."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(5.0)


def _answers(url: str, body: bytes | None, headers: dict[str, str]) -> bool:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # an HTTP error status is still an answer
    except (OSError, urllib.error.URLError):
        return False


def wait_until_answers(url: str, proc: subprocess.Popen[bytes], name: str, timeout_s: float = 30.0,
                       body: bytes | None = None, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DevStackError(f"{name} exited with code {proc.returncode} before answering")
        if _answers(url, body, headers or {}):
            return
        time.sleep(0.05)
    raise DevStackError(f"{name} did not answer at {url} within {timeout_s:.0f} s")


class DevStack:
    """dynalite + moto server on loopback.  Use as a context manager or start()/stop()."""

    def __init__(self, log_dir: Path | None = None, region: str = "us-east-1") -> None:
        self.log_dir = log_dir
        self.region = region
        self.dynamodb_url = ""
        self.moto_url = ""
        self._dynalite: subprocess.Popen[bytes] | None = None
        self._moto: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DevStack:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def pids(self) -> dict[str, int]:
        """The running servers' pids, by name (``dynalite``, ``moto``): the bench measures their CPU."""
        procs = {"dynalite": self._dynalite, "moto": self._moto}
        return {name: p.pid for name, p in procs.items() if p is not None and p.poll() is None}

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{name}.log"

    def start(self) -> dict[str, str]:
        atexit.register(self.stop)
        self._start_dynalite()
        self._start_moto()
        return self.env()

    def _start_dynalite(self) -> None:
        port = free_port()
        argv = ["node", str(find_dynalite()), "--host", "127.0.0.1", "--port", str(port),
                "--createTableMs", "0", "--deleteTableMs", "0", "--updateTableMs", "0"]
        self._dynalite = spawn(argv, self._log("dynalite"))
        self.dynamodb_url = f"http://127.0.0.1:{port}"
        wait_until_answers(self.dynamodb_url, self._dynalite, "dynalite", body=b"{}",
                           headers={"X-Amz-Target": "DynamoDB_20120810.ListTables"})

    def _start_moto(self) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        self._moto = spawn(argv, self._log("moto"))
        self.moto_url = f"http://127.0.0.1:{port}"
        wait_until_answers(self.moto_url + "/moto-api/", self._moto, "moto server")

    def env(self) -> dict[str, str]:
        """The environment that points any AWS SDK at this stack."""
        return {
            "AWS_ENDPOINT_URL_DYNAMODB": self.dynamodb_url,
            "AWS_ENDPOINT_URL_SQS": self.moto_url,
            "AWS_ENDPOINT_URL_CLOUDWATCH": self.moto_url,
            "AWS_ACCESS_KEY_ID": "fleetd-local",
            "AWS_SECRET_ACCESS_KEY": "fleetd-local",
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def apply_env(self) -> None:
        os.environ.update(self.env())

    def pause_dynamodb(self) -> None:
        """Freeze dynalite (SIGSTOP): requests hang, as with a network partition."""
        if self._dynalite is not None:
            os.killpg(self._dynalite.pid, signal.SIGSTOP)

    def resume_dynamodb(self) -> None:
        if self._dynalite is not None:
            os.killpg(self._dynalite.pid, signal.SIGCONT)

    def stop(self) -> None:
        for proc in (self._moto, self._dynalite):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                terminate(proc)
        self._moto = self._dynalite = None


def main() -> None:
    """``python -m fleetd.devstack``: run the stack in the foreground, print its env."""
    with DevStack() as stack:
        for k, v in stack.env().items():
            print(f"export {k}={v}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    main()
