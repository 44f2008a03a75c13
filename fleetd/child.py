"""The shard's side of the process boundary: everything that runs in a shard process around ``fleetd.shard``.

A shard must never outlive its supervisor, must never block its event loop on the
supervisor, and must tell the supervisor why it cannot boot.  ``shard_entry`` is the
``multiprocessing`` target that sets this up and then runs ``fleetd.shard.main``:

* its own process group, and SIGTERM back to the default disposition (the forkserver
  ignores it, see ``fleetd.supervisor.shard_context``);
* a parent watch: when the supervisor is gone, a graceful stop, then a hard exit;
* a ``ReportRelay`` for the once-a-second stats snapshots;
* a ``BootErrorCapture`` whose reason goes to the supervisor as the last report.

Nothing here imports the supervisor: the forkserver preloads this module and
``fleetd.shard``, and a shard pays for nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from fleetd import exits
from fleetd.config import Config


class ReportRelay:
    """The shard's event loop never blocks on the report pipe: a latest-wins mailbox and a sender thread.

    If the supervisor is slow to read, the pipe fills and the thread blocks; newer
    snapshots then replace the unsent one (dropping is fine: snapshots are absolute).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="report-relay", daemon=True)
        self._thread.start()

    def offer(self, snapshot: dict[str, Any]) -> None:
        with self._cond:
            self._pending = snapshot
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                msg, self._pending = self._pending, None
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except OSError:
                return  # the supervisor is gone; the parent watch ends us

    def close(self, final: dict[str, Any] | None = None, timeout_s: float = 1.0) -> None:
        """Flush what is pending, then send ``final`` (unless the pipe is stuck)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if final is not None and not self._thread.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(final)


class BootErrorCapture(logging.Handler):
    """A task that cannot boot halts with the shard's own reason: keeps the ``reason`` of its "cannot boot" record."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.reason = ""

    def emit(self, record: logging.LogRecord) -> None:
        reason = getattr(record, "reason", None)
        if reason:
            self.reason = str(reason)


def _exit_with_parent(grace_s: float) -> None:
    """A shard never outlives its supervisor: when it dies, stop gracefully (our leases are released),
    and hard-exit after ``grace_s``.

    PR_SET_PDEATHSIG would watch the forkserver, not the supervisor; the parent
    sentinel that multiprocessing hands us is the supervisor's end of a pipe.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(exits.FAILURE)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def shard_entry(cfg: Config, index: int, predecessor: str | None, reports: Connection, orphan_grace_s: float) -> None:
    """The child process: run ``fleetd.shard.main`` and exit with its code.

    ``orphan_grace_s`` is the supervisor's own kill budget: a shard whose supervisor
    died hard-exits after it, as the supervisor would have killed it.
    """
    # Own process group: a terminal's Ctrl-C reaches only the supervisor, which forwards one
    # SIGTERM; a shard hit by both would take the second as "exit now".
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # inherited as ignored from the forkserver
    _exit_with_parent(orphan_grace_s)
    relay = ReportRelay(reports)
    capture = BootErrorCapture()
    logging.getLogger("fleetd.shard").addHandler(capture)
    from fleetd import shard

    code = shard.main(cfg, index, reporter=relay.offer, predecessor=predecessor)
    relay.close({"boot_error": capture.reason} if code == exits.BOOT_ERROR else None)
    sys.exit(code)
