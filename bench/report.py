"""``report.md`` and PNG plots from a bench run's results (fleetd and the baseline side by side)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

Doc = dict[str, Any]


def write(out: Path, doc: Doc) -> None:
    res = doc["results"]
    sections: list[str] = [header(doc), targets(res)]
    makers: list[tuple[str, Callable[[Path, dict[str, Any]], str]]] = [
        ("density", density_section), ("throughput", throughput_section),
        ("failover", failover_section), ("cost", cost_section), ("cold_start", cold_start_section)]
    for name, make in makers:
        if name in res:
            sections.append(make(out, res[name]))
    (out / "report.md").write_text("\n\n".join(sections) + "\n")


def header(doc: Doc) -> str:
    m = doc["machine"]
    return (f"# fleetd vs the seed design — bench report\n\nProfile `{doc['profile']}`, {doc['date']}, "
            f"{m['cpus']} CPUs, {m['memory_gib']} GiB, Python {m['python']}. Local servers on loopback "
            "(dynalite for DynamoDB, moto for SQS); both systems read the same tables through the same "
            "metering proxy and stream from the same fake upstreams. Produced by `python -m bench.run`; "
            "raw numbers in `results.json`.\n\n"
            + "\n".join(f"* `{name}`: {r.get('duration_s', '?')} s, finished {r.get('finished', '?')}"
                         for name, r in doc["results"].items())
            + (f"\n\n**Conditions.** {doc['conditions']}" if doc.get("conditions") else ""))


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


# ----- targets ---------------------------------------------------------------------------------------

def targets(res: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    d = res.get("density", {}).get("points", [])
    f = [p for p in d if p["system"] == "fleetd"]
    b = [p for p in d if p["system"] == "baseline"]
    if f:
        held = max((p["connections"] for p in f if p["held"]), default=0)
        rows.append(["connections per shard", "≥ 5,000", held, held >= 5000])
        rss = max(p["rss_per_connection_bytes"] for p in f if p["held"]) / 1024 if held else None
        rows.append(["RSS per idle connection (KiB, worst point)", "≤ 40", rss, rss is not None and rss <= 40])
    if f and b:
        fb = {p["connections"]: p for p in f}
        same = [p for p in b if p["connections"] in fb and p["held"]]
        if same:
            p = same[0]
            r_cpu = ratio(p["cpu_ms_per_connection_minute"], fb[p["connections"]]["cpu_ms_per_connection_minute"])
            rows.append([f"CPU per connection-minute, baseline ÷ fleetd at {p['connections']}", "≥ 10×", r_cpu,
                         r_cpu is not None and r_cpu >= 10])
            r_calls = ratio(p["dynamodb_calls_per_connection_minute"],
                            fb[p["connections"]]["dynamodb_calls_per_connection_minute"])
            rows.append(["DynamoDB calls per connection-minute, baseline ÷ fleetd", "≥ 10×", r_calls,
                         r_calls is not None and r_calls >= 10])
        if same:
            # One CPU core sustains 60,000 / (CPU ms per connection-minute) connections at this load.
            p = same[-1]
            q = fb[p["connections"]]
            r = ratio(60_000 / q["cpu_ms_per_connection_minute"], 60_000 / p["cpu_ms_per_connection_minute"])
            rows.append([f"connections per CPU core at equal load ({p['connections']}), fleetd ÷ baseline", "≥ 10×",
                         r, r is not None and r >= 10])
        bmax = max((p["connections"] for p in b if p["held"]), default=0)
        fmax = max((p["connections"] for p in f if p["held"]), default=0)
        rows.append(["largest point held by one process, fleetd / baseline", "–", f"{fmax:,} / {bmax:,}", None])
    for lad in res.get("throughput", {}).get("ladders", []):
        if lad["system"] == "fleetd" and lad["sink"] == "discard":
            v = lad["max_ingest_msgs_s"]
            rows.append(["msgs/s per shard, discard sink", "≥ 150,000", v, v >= 150_000])
    fo = res.get("failover", {}).get("fleetd", {}).get("summary", {})
    for event, goal in (("sigterm_task", 2.0), ("sigkill_shard", 3.0), ("sigkill_task", 27.0)):
        if event in fo:
            v = fo[event]["p99_s"]
            rows.append([f"recovery p99, {event}", f"≤ {goal:g} s", v, v is not None and v <= goal])
    if fo:
        bad = sum(s["missing_seqs"] + s["double_streaming"] for s in fo.values())
        rows.append(["missing seqs + double streaming, all trials", "0", bad, bad == 0])
    rows += [[f"cold start: {name}", goal, v, met] for name, goal, v, met in cold_start_targets(res.get("cold_start"))]
    c = res.get("cost", {}).get("baseline_over_fleetd", {})
    if c:
        v = c.get("coordination_units")
        rows.append(["coordination request units per connection-hour, baseline ÷ fleetd", "≥ 20×", v,
                     v is not None and v >= 20])
    return "## Targets (fleetd)\n\n" + table(["figure", "target", "measured", "met"], rows)


def finish(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----- density ---------------------------------------------------------------------------------------

def density_section(out: Path, res: dict[str, Any]) -> str:
    pts = res["points"]
    rows = [[p["system"], p["connections"], p["held"], p["seconds_to_all_connected"],
             p["rss_per_connection_bytes"] / 1024, p["cpu_ms_per_connection_minute"],
             p["dynamodb_calls_per_connection_minute"], p["rss_bytes"] / 2**20] for p in pts]
    ops = sorted({op for p in pts for op in p["calls_per_connection_minute_by_op"]})
    op_rows = [[p["system"], p["connections"], *[p["calls_per_connection_minute_by_op"].get(o, 0.0) for o in ops]]
               for p in pts]
    plot_density(out, pts)
    return ("## Density (idle-ish: 1 msg / 10 s per connection, one shard / one baseline process)\n\n"
            + table(["system", "connections", "held all", "s to all connected", "RSS KiB / conn",
                     "CPU ms / conn-min", "DynamoDB calls / conn-min", "RSS MiB total"], rows)
            + "\n\nDynamoDB calls per connection-minute by operation:\n\n"
            + table(["system", "connections", *ops], op_rows)
            + "\n\n" + ratios_density(pts) + "\n\n![density](density.png)")


def ratios_density(pts: list[dict[str, Any]]) -> str:
    f = {p["connections"]: p for p in pts if p["system"] == "fleetd"}
    rows = []
    for p in pts:
        if p["system"] == "baseline" and p["connections"] in f:
            q = f[p["connections"]]
            rows.append([p["connections"], ratio(p["rss_per_connection_bytes"], q["rss_per_connection_bytes"]),
                         ratio(p["cpu_ms_per_connection_minute"], q["cpu_ms_per_connection_minute"]),
                         ratio(p["dynamodb_calls_per_connection_minute"], q["dynamodb_calls_per_connection_minute"])])
    return "Ratios, baseline ÷ fleetd:\n\n" + table(["connections", "RSS / conn", "CPU / conn-min",
                                                     "calls / conn-min"], rows)


def plot_density(out: Path, pts: list[dict[str, Any]]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("rss_per_connection_bytes", "RSS per connection (KiB)", 1 / 1024),
               ("cpu_ms_per_connection_minute", "CPU ms per connection-minute", 1.0),
               ("dynamodb_calls_per_connection_minute", "DynamoDB calls per connection-minute", 1.0))
    for ax, (key, title, scale) in zip(axes, metrics, strict=True):
        for system in ("fleetd", "baseline"):
            xs = [p["connections"] for p in pts if p["system"] == system]
            ys = [p[key] * scale for p in pts if p["system"] == system]
            ax.plot(xs, ys, marker="o", label=system)
        ax.set_xlabel("connections")
        ax.set_yscale("log")
        finish(ax, title)
    save(fig, out / "density.png")


# ----- throughput ------------------------------------------------------------------------------------

def throughput_section(out: Path, res: dict[str, Any]) -> str:
    rows = []
    for lad in res["ladders"]:
        for s in lad["steps"]:
            lag = s.get("upstream_to_receive_ms") or {}
            sink = s.get("sink_latency_s") or {}
            rows.append([lad["system"], lad["sink"], s["rate_per_connection"], s["offered_msgs_s"],
                         s["ingest_msgs_s"], f"{s['held_at_end']}/{s['connections']}", s["cpu_percent"],
                         lag.get("p50"), lag.get("p99"),
                         _ms(sink.get("p50")), _ms(sink.get("p99"))])
    best = {(lad["system"], lad["sink"]): lad["max_sustained_msgs_s"] for lad in res["ladders"]}
    summary = [[k[0], k[1], v] for k, v in best.items()]
    r = ratio(best.get(("fleetd", "dynamodb")), best.get(("baseline", "dynamodb")))
    plot_throughput(out, res)
    return (f"## Throughput ({res['connections']} connections, one shard / one baseline process)\n\n"
            + table(["system", "sink", "msgs/s/conn", "offered msgs/s", "ingest msgs/s", "streams held", "CPU %",
                     "upstream→receive p50 ms", "p99 ms", "receive→durable p50 ms (≤ bucket)", "p99 ms"], rows)
            + "\n\nHighest sustained rate (ingest ≥ 90 % of offered):\n\n"
            + table(["system", "sink", "msgs/s"], summary)
            + f"\n\nDynamoDB sink, fleetd ÷ baseline: {fmt(r)}×.\n\n![throughput](throughput.png)")


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def plot_throughput(out: Path, res: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    top = 1.0
    for lad in res["ladders"]:
        xs = [s["offered_msgs_s"] for s in lad["steps"]]
        ys = [s["ingest_msgs_s"] for s in lad["steps"]]
        top = max(top, *xs, *ys)
        ax.plot(xs, ys, marker="o", label=f"{lad['system']} / {lad['sink']}")
    ax.plot([1, top], [1, top], linestyle=":", color="grey", label="ingest = offered")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered msgs/s")
    ax.set_ylabel("ingested msgs/s")
    finish(ax, "Ingest vs offered load")
    save(fig, out / "throughput.png")


# ----- failover --------------------------------------------------------------------------------------

def failover_section(out: Path, res: dict[str, Any]) -> str:
    rows = []
    for system in ("fleetd", "baseline"):
        for event, s in res.get(system, {}).get("summary", {}).items():
            rows.append([system, event, s["trials"], s["streams"], s["unrecovered"], s["p50_s"], s["p99_s"],
                         s["max_s"], s["missing_seqs"], s["double_streaming"]])
    finals = [[system, res[system]["final_audit"]["missing_seqs"], res[system]["final_audit"]["double_streaming"],
               res[system]["final_audit"]["redelivered"], res[system]["final_audit"]["written"]]
              for system in ("fleetd", "baseline") if system in res]
    ratio_rows = []
    fs, bs = res.get("fleetd", {}).get("summary", {}), res.get("baseline", {}).get("summary", {})
    for event in ("sigterm_task", "sigkill_task"):
        if event in fs and event in bs:
            ratio_rows.append([event, fs[event]["p99_s"], bs[event]["p99_s"], ratio(bs[event]["p99_s"],
                                                                                  fs[event]["p99_s"])])
    plot_failover(out, res)
    note = (f"Run with the `{res['profile']}` profile ({res.get('note', '')}).\n\n" if res.get("profile") else "")
    made = [f"{system} trials finished {res[system]['finished']} at commit `{res[system]['commit']}`"
            for system in ("fleetd", "baseline") if "commit" in res.get(system, {})]
    note += ("; ".join(made) + ". " if made else "") + (
        "Before each trial the fleet settles: every stream attached again and, for fleetd, no task over "
        "1.2 × its share (fleetd rebalances, here every 5 s; the baseline cannot, so its victim, the "
        "task holding most, holds more).\n\n")
    return ("## Failover (three tasks sharing the connections)\n\n" + note
            + "Recovery = time from the event until a new socket is attached to the stream (it resumes with "
            "`from_seq`), per affected stream, polled every 0.1 s.\n\n"
            + table(["system", "event", "trials", "streams affected", "unrecovered", "p50 s", "p99 s", "max s",
                     "missing seqs", "double streaming"], rows)
            + "\n\nRecovery p99, fleetd vs baseline:\n\n" + table(["event", "fleetd s", "baseline s",
                                                                    "baseline ÷ fleetd"], ratio_rows)
            + "\n\nWhole messages table audited at the end (`bench.audit`):\n\n"
            + table(["system", "missing seqs", "double streaming", "redelivered frames", "items"], finals)
            + cpu_profile(res)
            + failover_hot_keys(res)
            + "\n\n![failover](failover.png)")


def cpu_profile(res: dict[str, Any]) -> str:
    """Where the CPU went while the affected streams recovered (the handover's profile)."""
    summaries = [(system, event, s["cpu_cores"]) for system in ("fleetd", "baseline")
                 for event, s in res.get(system, {}).get("summary", {}).items() if s.get("cpu_cores")]
    if not summaries:
        return ""
    groups = list(dict.fromkeys(g for _, _, cores in summaries for g in cores))
    rows = [[system, event, *(cores.get(g, 0.0) for g in groups), round(sum(cores.values()), 2)]
            for system, event, cores in summaries]
    return ("\n\nWhere the CPU went while the affected streams recovered: cores busy, from the event until "
            "the last stream had a socket again, mean over the trials (psutil; 1.0 = one core; the "
            "machine's cores are in the header):\n\n" + table(["system", "event", *groups, "total"], rows))


def hot_key(peak: dict[str, Any] | None) -> str:
    """``units/s (key)`` of a busiest second, ``–`` if the window had none."""
    return "–" if not peak else f"{fmt(peak['units_per_s'])} ({peak['key']})"


HOT_KEYS_NOTE = ("Per key value (a base table's partition key value, or a GSI's hash key value) and second, at "
                 "the metering proxy (`bench/meter.py`): a write that moves an item in a GSI charges the old and "
                 "the new index key value one unit each; a failed conditional write one unit to its key. "
                 "DynamoDB's limits per key value are 1,000 write and 3,000 read units/s.")


def failover_hot_keys(res: dict[str, Any]) -> str:
    """The hottest key's busiest second per event, when the run metered keys (``--meter-keys``)."""
    rows = [[system, event, hot_key(s["hot_keys"]["writes"]), hot_key(s["hot_keys"]["reads"]),
             s["hot_keys"]["throttled"] if res[system].get("throttle_keys") else "off",
             _writes_per_stream(s.get("writes_per_stream"))]
            for system in ("fleetd", "baseline") for event, s in res.get(system, {}).get("summary", {}).items()
            if "hot_keys" in s]
    if not rows:
        return ("\n\nHot keys: not measured in this run (`--meter-keys` puts the metering proxy in front of the "
                "systems, a Python hop on every request, so the recovery times above are measured without it).")
    return ("\n\nHottest key from the event until the last affected stream recovered, its busiest second over "
            "the trials (the systems talked to DynamoDB through the metering proxy in this run). "
            + HOT_KEYS_NOTE + "\n\n"
            + "Writes per stream moved: single-item writes on the connections table (done or failed their "
            "condition) per affected stream, from the event until the last affected stream recovered.\n\n"
            + table(["system", "event", "hottest key peak writes/s (key)", "hottest key peak reads/s (key)",
                     "throttled requests", "writes per stream moved (mean / max)"], rows))


def _writes_per_stream(w: dict[str, Any] | None) -> str:
    return "–" if not w else f"{fmt(w['mean'])} / {w['max']}"


def plot_failover(out: Path, res: dict[str, Any]) -> None:
    series = [(f"{system}\n{e}", [x for t in res[system]["trials"] if t["event"] == e for x in t["recovery_times_s"]])
              for system in ("fleetd", "baseline") if system in res
              for e in dict.fromkeys(t["event"] for t in res[system]["trials"])]
    series = [(label, xs) for label, xs in series if xs]
    fig, ax = plt.subplots(figsize=(10, 5))
    if series:
        ax.boxplot([xs for _, xs in series], whis=(0, 99))
        ax.set_xticks(range(1, len(series) + 1), [label for label, _ in series], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds until the stream has a socket again")
    ax.set_title("Recovery time per affected stream (whiskers: min / p99)")
    ax.grid(True, alpha=0.3)
    save(fig, out / "failover.png")


# ----- cost ------------------------------------------------------------------------------------------

def cost_section(out: Path, res: dict[str, Any]) -> str:
    rows = res["per_connection_hour"]
    keys = list(rows["fleetd"])
    table_rows = [[k, rows["fleetd"][k], rows["baseline"][k], res["baseline_over_fleetd"].get(k)] for k in keys]
    plot_cost(out, res)
    basis = res["price_basis"]
    return (f"## Cost (per connection-hour, measured at {res['connections']} connections)\n\n"
            f"Price basis: ${basis['usd_per_million_write_units']:.2f} per million write units, "
            f"${basis['usd_per_million_read_units']:.2f} per million read units. Base-table units as dynalite "
            "reports them, GSI writes modelled from each write's expression (see `bench/meter.py`).\n\n"
            + table(["per connection-hour", "fleetd", "baseline", "baseline ÷ fleetd"], table_rows)
            + "\n\n![cost](cost.png)")


def plot_cost(out: Path, res: dict[str, Any]) -> None:
    rows = res["per_connection_hour"]
    systems = ["fleetd", "baseline"]
    parts = [("coordination_write_units", "coordination writes (incl. GSI)"),
             ("coordination_read_units", "coordination reads"), ("message_write_units", "message writes")]
    fig, ax = plt.subplots(figsize=(7, 5))
    bottom = [0.0, 0.0]
    for key, label in parts:
        vals = [rows[s][key] for s in systems]
        ax.bar(systems, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("request units per connection-hour")
    finish(ax, "DynamoDB request units per connection-hour")
    save(fig, out / "cost.png")


# ----- cold start ------------------------------------------------------------------------------------

CASE_TITLES = {"three_tasks": "three tasks started together", "restart": "fleet restarted after SIGKILL of all",
               "burst": "burst of ctl starts into a running fleet"}


def _case_title(case: str) -> str:
    if case.startswith("one_shard_"):
        return "one shard"
    return CASE_TITLES.get(case, case)


def _cold_pairs(res: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(fleetd row, baseline row of the same case or None), in run order."""
    base = {r["case"]: r for r in res["cases"] if r["system"] == "baseline"}
    return [(r, base.get(r["case"])) for r in res["cases"] if r["system"] == "fleetd"]


def _cold_goal(row: dict[str, Any], res: dict[str, Any]) -> tuple[str, bool | None]:
    """Issue #18's target for a fleetd row (at the issue's sizes only) and whether it is met."""
    t = res.get("targets", {})
    secs = row["ready_to_all_s"]
    if row["case"].startswith("one_shard_"):
        goal = t.get("one_shard_s", {}).get(str(row["streams"]))
        if goal is None:
            return "–", None
        return f"≤ {goal:g} s", secs is not None and secs <= goal
    if row["case"] == "three_tasks" and row["streams"] == 1500:
        goal, pct = t.get("three_tasks_s", 4.0), t.get("share_pct", 15.0)
        ok = (secs is not None and secs <= goal and row["share_min_pct"] is not None
              and -pct <= row["share_min_pct"] and row["share_max_pct"] <= pct and row.get("moved_twice") == 0)
        return f"≤ {goal:g} s, shares ±{pct:g} %, none moved twice", ok
    return "–", None


def cold_start_targets(res: dict[str, Any] | None) -> list[tuple[str, str, Any, bool | None]]:
    if not res:
        return []
    out: list[tuple[str, str, Any, bool | None]] = []
    for f, b in _cold_pairs(res):
        goal, met = _cold_goal(f, res)
        name = f"{_case_title(f['case'])}, {f['streams']:,} streams, s ready → all connected"
        if met is not None:
            out.append((name, goal, f["ready_to_all_s"], met))
        r = ratio(f["ready_to_all_s"], b["ready_to_all_s"]) if b else None
        if b is not None:
            out.append((f"{_case_title(f['case'])}, {f['streams']:,}: fleetd ÷ baseline, ready → all", "≤ 1",
                        r, r is not None and r <= 1))
    return out


def cold_start_section(out: Path, res: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    for f, b in _cold_pairs(res):
        goal, met = _cold_goal(f, res)
        for r in (f, b):
            if r is None:
                continue
            mine = r is f
            rows.append([_case_title(r["case"]), r["streams"], r["tasks"], r["system"],
                         r["ready_to_all_s"] if r["connected"] else f"not all ({r['max_connected']:,})",
                         r["start_to_all_s"], r["start_to_ready_s"],
                         r["share_min_pct"], r["share_max_pct"], r.get("moved"), r.get("moved_twice"),
                         r.get("new_sockets_twice"),
                         ratio(f["ready_to_all_s"], b["ready_to_all_s"]) if mine and b else None,
                         ratio(f["start_to_all_s"], b["start_to_all_s"]) if mine and b else None,
                         goal if mine else "", met if mine else None])
    groups = list(dict.fromkeys(g for r in res["cases"] for g in r.get("cpu_cores", {})))
    cpu_rows = [[_case_title(r["case"]), r["streams"], r["system"], *(r["cpu_cores"].get(g) for g in groups)]
                for r in res["cases"] if r.get("cpu_cores")]
    bursts = [[r["system"], r["streams"], r.get("burst_send_s"), r.get("last_start_to_all_s"), r["ready_to_all_s"]]
              for r in res["cases"] if r["case"] == "burst"]
    plot_cold_start(out, res)
    return ("## Cold start (issue #18)\n\n"
            f"fleetd on {res['fleetd_timings']}; one shard per task; rebalance every {res['rebalance_s']:g} s. "
            "*Ready*: fleetd, every started task's `/readyz` answers 200; the baseline, the `ready` line its "
            "worker prints once its clients and tables are checked, just before its first reconcile (it has no "
            "other readiness signal). A stream is connected when the fake upstream has a client on it "
            "(after the restart, a new socket), polled every "
            f"{res['poll_s']:g} s. For the burst ({res['burst_concurrency']} `ctl start`s in flight from the "
            "harness: the item written as `ctl start` writes it, then one START hint) the clock starts at the "
            "first start, and *start → ready* is the fleet's boot before it. Shares: each task's streams at "
            "the all-connected moment (the connections table's `lease_owner`), smallest and largest relative "
            f"to the fair share. Moved: streams whose owner changed in the {2 * res['rebalance_s']:g} s "
            "(two rebalance periods) after all were connected (table scans every few seconds), those moved "
            "twice or more, and those the fake upstream saw open twice or more in that window. Both systems "
            "talk to dynalite directly (no metering proxy). Ratios: fleetd ÷ baseline (below 1: fleetd is "
            "faster).\n\n"
            + table(["case", "streams", "tasks", "system", "s ready → all", "s start → all", "s start → ready",
                     "share min %", "share max %", "moved", "moved ≥ 2", "new sockets ≥ 2", "ratio ready → all",
                     "ratio start → all", "target (fleetd)", "met"], rows)
            + "\n\nCPU while the streams connected (cores busy from process start, or the first `ctl start`, "
            "until all were connected; 1.0 = one core):\n\n"
            + table(["case", "streams", "system", *groups], cpu_rows)
            + "\n\nThe burst: how long the harness took to write the items and send their hints (one SQS "
            "SendMessage per start, as `ctl start` does), and how long after the last start all were connected:\n\n"
            + table(["system", "starts", "s first → last start", "s last start → all", "s first start → all"], bursts)
            + cold_start_hot_keys(res)
            + "\n\n![cold start](cold_start.png)")


def cold_start_hot_keys(res: dict[str, Any]) -> str:
    """The hottest key's busiest second per case, when the run metered keys (``--meter-keys``)."""
    rows = [[_case_title(r["case"]), r["streams"], r["system"], hot_key(r["hot_keys"]["writes"]),
             hot_key(r["hot_keys"]["reads"]), r["hot_keys"]["throttled"] if res.get("throttle_keys") else "off"]
            for r in res["cases"] if "hot_keys" in r]
    if not rows:
        return ""
    return ("\n\nHottest key over each connect window, its busiest second (this run went through the metering "
            "proxy). " + HOT_KEYS_NOTE + "\n\n"
            + table(["case", "streams", "system", "hottest key peak writes/s (key)",
                     "hottest key peak reads/s (key)", "throttled requests"], rows))


def plot_cold_start(out: Path, res: dict[str, Any]) -> None:
    pairs = _cold_pairs(res)
    labels = [f"{_case_title(f['case'])}\n{f['streams']:,}" for f, _ in pairs]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.4
    xs = list(range(len(pairs)))
    for off, system in enumerate(("fleetd", "baseline")):
        ys = [((f if system == "fleetd" else b) or {}).get("ready_to_all_s") or 0.0 for f, b in pairs]
        ax.bar([x + (off - 0.5) * width for x in xs], ys, width, label=system)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("seconds, ready → all connected")
    finish(ax, "Cold start: time to all connected")
    save(fig, out / "cold_start.png")
