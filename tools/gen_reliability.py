"""Render ``docs/reliability.md`` from the fault suite's trial records.

Every trial of ``tests/faults`` appends one JSON line through
:func:`tests.faults.record.record` when ``FLEETD_FAULTS_RESULTS`` is set; this script
groups them by their ``scenario`` field (whatever file recorded them) and renders one
summary table and a section per scenario::

    FLEETD_FAULTS_RESULTS=/tmp/faults.jsonl .venv/bin/pytest tests/faults --long
    python -m tools.gen_reliability /tmp/faults.jsonl [more.jsonl ...] > docs/reliability.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

COMMAND = "python -m tools.gen_reliability"
RUN = "FLEETD_FAULTS_RESULTS=/tmp/faults.jsonl .venv/bin/pytest tests/faults --long"

# What the scenarios of tests/faults/test_aws.py do; a record may bring its own ``description``.
DESCRIPTIONS = {
    "dynamodb_blackhole": (
        "Every DynamoDB call of all shards, or of one shard (a partition), hangs unanswered (some "
        "trials reset a share of them instead) for lease TTL + 1–3 s. The cut-off shards must close "
        "their upstream sockets before their leases can expire (checked during the fault), then open "
        "new sessions and reclaim; peers of a partitioned shard take its streams over. Recovery is "
        "counted from the end of the blackhole."),
    "throttling": (
        "30 % of all DynamoDB calls (claims, renewals, queries, sink writes) are answered with "
        "`ProvisionedThroughputExceededException` or `ThrottlingException` (a random mix) for 60 s "
        "(15 s in CI); in most trials the busiest shard is SIGTERMed or SIGKILLed midway, sometimes "
        "replaced by a shard that boots under throttling. Recovery is counted from the end of the "
        "throttling; `after_stop_s` from the stop."),
    "ambiguous_writes": (
        "20–40 % of UpdateItem calls (claims, releases, checkpoints, item renewals and session "
        "heartbeats), and in half the trials the PutItem that creates a session, are applied by "
        "DynamoDB but their answer is lost (a 500 or a reset connection), while shards are SIGTERMed "
        "or SIGKILLed and replaced 2–3 times, in both lease modes. Recovery is counted from the end "
        "of the fault (TTL + 2–4 s after the last stop); `after_stop_s` from the last stop."),
    "sqs_down": (
        "SQS is blackholed or answers 500 for the whole trial, boot included. The busiest shard is "
        "SIGTERMed: its streams must reach peers through their reconcile scans (no hints can be "
        "delivered) with the default 20 s lease TTL, so a takeover through lease expiry would show "
        "as ≥ 20 s. Recovery is counted from the SIGTERM."),
    "one_second_latency": (
        "At the product's session timings (TTL 6 s, heartbeat 1.5 s, margin 2 s, 5 s AWS timeout), every "
        "DynamoDB call of every shard is answered 1 s late. No shard may give its session up (a second "
        "session, a self-fence or a lost session fails the trial)."),
    "lost_answers": (
        "At the product's session timings, 30 % of all DynamoDB calls are applied and their answers lost "
        "(half a 500, half a reset connection). No shard may give its session up."),
    "stalls": (
        "At the product's session timings, DynamoDB stalls for 2 s at a time (every request held, then "
        "applied and answered), 1–3 s apart. No shard may give its session up."),
}
GENERIC = "Recorded by the fault suite in `tests/faults` (see the recording test's docstring)."
# What the duration fields (``…_s``) of the records measure; unknown ones are listed without a note.
MEASURES = {
    "recovery_s": "end of the fault → every connection streaming again",
    "back_after_start_s": "start of the fault → every connection streaming again",
    "after_stop_s": "the scenario's (last) shard stop or kill → every connection of that shard streaming again",
    "fence_s": "start of the blackhole → the cut-off shards' sockets all closed (must stay below the lease TTL)",
    "live_after_s": "end of the fault → the harness's poll saw every connection streaming (coarser)",
    "duration_s": "how long the fault lasted",
}


@dataclass
class Summary:
    """The trials of one scenario, folded."""

    scenario: str
    trials: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    missing_seqs: int = 0
    double_streaming: int = 0
    recoveries: list[float] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)  # other measured durations (…_s)
    modes: dict[str, int] = field(default_factory=dict)
    dates: list[str] = field(default_factory=list)
    description: str = ""


def read_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every JSON line of every file, in order; a malformed line names its file and line."""
    rows = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(row, dict) or "scenario" not in row:
                raise ValueError(f"{path}:{n}: not a trial record (no scenario)")
            rows.append(row)
    return rows


def is_failed(row: dict[str, Any]) -> bool:
    """A trial failed if it violated an invariant, broke off (no verdict) or left errors in its logs."""
    return (row.get("verdict") is None or int(row.get("violations") or 0) > 0 or bool(row.get("failure"))
            or int(row.get("log_problems") or 0) > 0)


def fold(rows: Iterable[dict[str, Any]]) -> list[Summary]:
    """One :class:`Summary` per scenario, in order of first appearance."""
    by_name: dict[str, Summary] = {}
    for row in rows:
        name = str(row["scenario"])
        s = by_name.setdefault(name, Summary(name, description=DESCRIPTIONS.get(name, "")))
        add(s, row)
    return list(by_name.values())


def add(s: Summary, row: dict[str, Any]) -> None:
    s.trials += 1
    verdict = row.get("verdict") or {}
    s.missing_seqs += int(verdict.get("missing_seqs", 0))
    s.double_streaming += int(verdict.get("double_streaming", 0))
    if is_failed(row):
        s.failed.append(row)
    if isinstance(row.get("recovery_s"), (int, float)):
        s.recoveries.append(float(row["recovery_s"]))
    for key, value in row.items():
        if key.endswith("_s") and key != "recovery_s" and isinstance(value, (int, float)):
            s.extras.setdefault(key, []).append(float(value))
    if row.get("mode"):
        s.modes[str(row["mode"])] = s.modes.get(str(row["mode"]), 0) + 1
    if row.get("at"):
        s.dates.append(str(row["at"])[:10])
    if not s.description and row.get("description"):
        s.description = str(row["description"])


def seconds(values: Sequence[float], how: str) -> str:
    if not values:
        return "–"
    value = max(values) if how == "max" else statistics.median(values)
    return f"{value:.2f}"


def date_range(dates: Sequence[str]) -> str:
    if not dates:
        return "–"
    first, last = min(dates), max(dates)
    return first if first == last else f"{first} – {last}"


def summary_table(summaries: Sequence[Summary]) -> list[str]:
    lines = ["| scenario | trials | failed | missing seqs | double streaming | worst recovery (s) "
             "| p50 recovery (s) | date |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in summaries:
        lines.append(f"| [{s.scenario}](#{s.scenario}) | {s.trials} | {len(s.failed)} | {s.missing_seqs} "
                     f"| {s.double_streaming} | {seconds(s.recoveries, 'max')} | {seconds(s.recoveries, 'p50')} "
                     f"| {date_range(s.dates)} |")
    return lines


def section(s: Summary) -> list[str]:
    lines = [f"## {s.scenario}", "", s.description or GENERIC, ""]
    if s.modes:
        lines += ["Lease modes: " + ", ".join(f"{mode} {n}" for mode, n in sorted(s.modes.items())) + ".", ""]
    measures = [("recovery_s", s.recoveries), *sorted(s.extras.items())]
    lines += ["| measure (s) | worst | p50 | from → to |", "|---|---:|---:|---|"]
    lines += [f"| {key} | {seconds(v, 'max')} | {seconds(v, 'p50')} | {MEASURES.get(key, '')} |"
              for key, v in measures]
    lines.append("")
    if s.failed:
        lines += ["Failed trials:", ""] + [f"* {failure_line(row)}" for row in s.failed] + [""]
    return lines


def failure_line(row: dict[str, Any]) -> str:
    why = row.get("failure") or row.get("verdict") or f"{row.get('log_problems')} error lines in shard logs"
    return f"trial {row.get('trial')} (seed {row.get('seed', '?')}, {row.get('at', '?')}): {str(why)[:300]}"


INTRO = f"""\
<!-- Generated by `{COMMAND}` from the fault suite's trial records. Do not edit by hand. -->
# Reliability

fleetd exists to survive failures. The fault suite (`tests/faults`) runs real `fleetd shard`
processes against the local stack (dynalite, moto) and a fake upstream that replays from
`from_seq`, injects one randomized fault per trial (AWS faults go through an HTTP fault proxy in
front of DynamoDB and SQS), and judges every trial by program:

* **missing seqs** — a seq the upstream produced that never reached the messages table (SPEC §6.2);
* **double streaming** — two sessions whose write windows for one connection overlap by more than the
  safety margin, or two sockets attached to one upstream stream at once (SPEC §6.1);
* a trial also **fails** if the fleet does not stream every connection again after the fault (liveness),
  a shard dies on its own or misses its shutdown budget, or a shard logs an error or a traceback.

**Recovery** is the time from the end of the fault (per scenario below) until the last connection was
streaming again, read from the reception times of the messages themselves (0 = no connection was silent
for more than 0.6 s). Other `…_s` measures are explained with their scenario.

CI runs a few trials of every scenario (`.venv/bin/pytest tests/faults`); this page comes from a long run
of at least 20 trials each:

    {RUN}
    {COMMAND} /tmp/faults.jsonl > docs/reliability.md

Each trial prints and records its seed; `FLEETD_FAULTS_SEED=N` replays a run's choices (fault timing
still depends on the machine).
"""


SIMULATION = """\
## Simulation

Randomized process-level trials sample the schedules a machine happens to produce; they rarely reach
the interleavings that matter (an answer arriving just after a deadline, a write applied whose answer
is lost and whose SDK retry lands seconds later). `python -m bench.sim` runs fleetd's own shard code —
`Shard.run()` with its lease store, sink, hints and upstream listener — against simulated DynamoDB
(`bench/sim/dynamo.py`: real expression semantics, checked against moto by a differential test, GSIs
with per-write lag), SQS and upstreams, in virtual time, one event loop per simulated process, all
driven by one seed. A failing seed replays exactly (`python -m bench.sim --seed N --trace`).

**Fault model** (per seed: calm, moderate or brutal, with bursts). Every SDK attempt is applied at its
arrival time whatever the caller does meanwhile, and may be delayed past any deadline, applied with its
answer lost (the SDK retries the very same request), applied twice, throttled, answered 5xx or
blackholed; the clients retry as botocore's standard mode does. Processes are SIGKILLed at any await,
SIGTERMed at any moment, SIGSTOPped past their TTL and resumed, whole tasks killed (their supervisor
expires a crashed shard's session and restarts it); clocks are skewed within the margin; items are
started and stopped; upstreams replay from `from_seq`, number from 0 or 1, close, stall and refuse.

**Invariants**, checked on the simulation's true timeline (`bench/sim/invariants.py` states each bound):
`one_streamer_socket` (never two open upstream sockets for one connection among running processes),
`stale_write` (no message write sent for a stream after a peer may have claimed it), `checkpoint_ahead`
(a `last_seq` written only over seqs already durable), `lost_seq` (every produced seq in the messages
table), `not_streamed` and `orphan` (once faults stop, every STARTED connection streamed again and no
item left to a session that does not exist or is dead), `stopped_streaming` (a STOPPED connection
closed in time) and `busy_loop` (no process spins without time passing).
"""


def simulation_section(summary: dict[str, Any] | None, regressions: Sequence[dict[str, Any]]) -> list[str]:
    lines = [SIMULATION]
    if summary:
        lines += [f"**Last run** ({summary.get('provenance', 'provenance not recorded')}): "
                  f"{summary['seeds']:,} seeds, {summary['violations']} violations, "
                  f"{summary['simulated_shard_minutes']:,.0f} simulated shard-minutes in "
                  f"{summary['wall_s']:,.0f} s of wall time.", ""]
    if regressions:
        lines += ["**Regression seeds** (`bench/sim/regressions.json`, run by `tests/sim/test_sim.py`): each "
                  "reproduced a defect on the code named, and runs clean since its fix.", "",
                  "| seed | defect | what it reproduced |", "|---:|---|---|"]
        lines += [f"| {r['seed']} | {r['defect']} | {str(r['note']).replace('|', '/')} |" for r in regressions]
        lines.append("")
    return lines


def render(rows: Sequence[dict[str, Any]], simulation: list[str] | None = None) -> str:
    summaries = fold(rows)
    lines = [INTRO, "## Summary", "", *summary_table(summaries), ""]
    for s in summaries:
        lines += section(s)
    lines += simulation or []
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=(__doc__ or "").splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="JSON-lines files written via FLEETD_FAULTS_RESULTS")
    p.add_argument("--provenance", default="", help="a paragraph on where the records come from (code, machine)")
    p.add_argument("--simulation", type=Path, help="the summary JSON of a `python -m bench.sim` run")
    p.add_argument("--regressions", type=Path, default=Path("bench/sim/regressions.json"))
    args = p.parse_args(argv)
    try:
        rows = read_rows(args.results)
        summary = orjson.loads(args.simulation.read_bytes()) if args.simulation else None
        regressions = orjson.loads(args.regressions.read_bytes()) if args.regressions.exists() else []
    except (OSError, ValueError) as e:
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 1
    page = render(rows, simulation_section(summary, regressions))
    if args.provenance:
        page = page.replace("\n## Summary\n", f"\n**Provenance.** {args.provenance}\n\n## Summary\n", 1)
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
