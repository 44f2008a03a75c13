"""Trial results of the fault suite, appended as JSON lines for ``docs/reliability.md``.

Set ``FLEETD_FAULTS_RESULTS=PATH`` to collect them; ``python -m tools.gen_reliability
PATH`` renders the table.  Without the variable, :func:`record` does nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from bench.audit import Verdict

RESULTS_ENV = "FLEETD_FAULTS_RESULTS"


def record(scenario: str, trial: int, verdict: Verdict | None, recovery_s: float | None, **extra: Any) -> None:
    """Append one trial: its invariant verdict, worst recovery time (s) and anything scenario-specific."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    row = {
        "scenario": scenario,
        "trial": trial,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "violations": 0 if verdict is None else verdict.missing_seqs + verdict.double_streaming,
        "verdict": None if verdict is None else verdict.summary(),
        "recovery_s": recovery_s,
        **extra,
    }
    with open(path, "ab") as f:
        f.write(orjson.dumps(row) + b"\n")
