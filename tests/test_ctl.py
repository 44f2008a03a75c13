"""``fleetd ctl`` through the real CLI, against the local DynamoDB and SQS servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import orjson
import pytest

from bench import procs
from fleetd import cli, dev, exits
from fleetd.aws import Outcome
from fleetd.clock import SystemClock
from fleetd.config import Config, UpstreamConfig, as_env
from fleetd.lease import STARTED, STOPPED, LeaseStore, SessionInfo
from fleetd.schema import HELD_BY_SESSION
from fleetd.validation import MAX_ID_BYTES, address_refusal, redact_url, validate_id, validate_url
from tests.helpers import arun, clients

# ----- helpers ------------------------------------------------------------------------------------------


@pytest.fixture
def ctl_env(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> Config:
    """Point the in-process CLI at ``cfg``'s tables through FLEETD_* variables only.

    Only the names are exported: ``allowed_schemes`` stays at its default (wss), so
    tests that need ws:// say so with a flag.
    """
    for name in list(os.environ):
        if name.startswith("FLEETD_"):
            monkeypatch.delenv(name)
    for name in ("FLEETD_CONNECTIONS_TABLE", "FLEETD_SESSIONS_TABLE", "FLEETD_MESSAGES_TABLE",
                 "FLEETD_HINTS_QUEUE"):
        monkeypatch.setenv(name, as_env(cfg)[name])
    return cfg


def fleetd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``fleetd ARGV`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    out = capsys.readouterr()
    code = exc.value.code
    assert isinstance(code, int)
    return code, out.out, out.err


def assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fleetd: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], err


def ddb_item(cfg: Config, cid: str) -> dict[str, Any] | None:
    async def main() -> dict[str, Any] | None:
        async with clients(cfg) as c:
            resp = await c.dynamodb.get_item(TableName=cfg.aws.connections_table, ConsistentRead=True,
                                             Key={"connection_id": {"S": cid}})
            item = resp.get("Item")
            return dict(item) if item else None

    return arun(main())


def receive_hints(cfg: Config) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        async with clients(cfg) as c:
            url = (await c.sqs.get_queue_url(QueueName=cfg.aws.hints_queue))["QueueUrl"]
            resp = await c.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
            return [orjson.loads(m["Body"]) for m in resp.get("Messages", [])]

    return arun(main())


def leases(c: Any, cfg: Config) -> LeaseStore:
    return LeaseStore(c.dynamodb, cfg.aws, cfg.lease, SystemClock())


def claim(cfg: Config, cid: str, session_id: str, last_seq: int | None = None) -> None:
    """Own ``cid`` as a live session would (and checkpoint ``last_seq``)."""
    async def main() -> None:
        async with clients(cfg) as c:
            store = leases(c, cfg)
            assert await store.create_session(SessionInfo(session_id, "task-1", 0, 700, pid=4242)) is Outcome.WON
            won = await store.claim(cid, session_id)
            assert won.outcome is Outcome.WON and won.item is not None
            if last_seq is not None:
                assert await store.checkpoint(cid, session_id, won.item.lease_epoch, last_seq) is Outcome.WON

    arun(main())


# ----- start ----------------------------------------------------------------------------------------------


def test_start_writes_a_free_item_that_the_sparse_index_shows(ctl_env: Config,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ctl_env
    code, out, err = fleetd(capsys, "ctl", "start", "conn-1", "wss://feed.example.com/stream?x=1")
    assert (code, err) == (exits.OK, "")
    assert "conn-1" in out
    item = ddb_item(cfg, "conn-1")
    assert item is not None
    assert item["desired_state"] == {"S": STARTED}
    assert item["ws_url"] == {"S": "wss://feed.example.com/stream?x=1"}
    # The acceptance point: without lease_expires_at_ms = 0 the by_state_expiry GSI never lists it.
    assert item["lease_expires_at_ms"] == {"N": "0"}
    assert item["lease_epoch"] == {"N": "0"}
    # Nothing written yet, so no resume point: the first connect sends no from_seq (SPEC §5, seq 0 kept).
    assert "last_seq" not in item
    assert item["created_at_ms"] == item["updated_at_ms"]
    assert "lease_owner" not in item

    async def free() -> list[str]:
        async with clients(cfg) as c:
            return await leases(c, cfg).free_items(100)

    assert arun(free()) == ["conn-1"]


def test_restart_of_an_item_with_a_checkpoint_keeps_it(ctl_env: Config,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """An item that did write keeps its own last_seq, 0 included: ``start`` never adds or resets one."""
    for cid, seq in (("zero", 0), ("many", 12345)):
        assert fleetd(capsys, "ctl", "start", cid, "wss://a.example.com/")[0] == exits.OK
        claim(ctl_env, cid, f"task-1/0/{cid}", last_seq=seq)
        assert fleetd(capsys, "ctl", "start", cid, "wss://a.example.com/")[0] == exits.OK
        item = ddb_item(ctl_env, cid)
        assert item is not None and item["last_seq"] == {"N": str(seq)}


def test_dev_and_bench_seeding_write_the_item_ctl_start_writes(ctl_env: Config,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Three writers of a new item (ctl, ``fleetd dev``, the benchmarks' seeding), one item."""
    assert fleetd(capsys, "ctl", "start", "by-ctl", "wss://feed.example.com/")[0] == exits.OK

    async def dev_start() -> None:
        async with clients(ctl_env) as c:
            await dev.upsert_started(c.dynamodb, ctl_env, "by-dev", "wss://feed.example.com/")

    arun(dev_start())
    procs.seed_items(ctl_env.aws.connections_table, {"by-bench": "wss://feed.example.com/"})
    times = {"connection_id", "created_at_ms", "updated_at_ms"}
    shapes = []
    for cid in ("by-ctl", "by-dev", "by-bench"):
        item = ddb_item(ctl_env, cid)
        assert item is not None
        assert "last_seq" not in item, f"{cid} was created with a resume point"
        shapes.append({k: v for k, v in item.items() if k not in times})
    assert shapes[0] == shapes[1] == shapes[2]


def test_start_sends_a_start_hint(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = fleetd(capsys, "ctl", "start", "conn-h", "wss://feed.example.com/")
    assert code == exits.OK
    assert receive_hints(ctl_env) == [{"type": "START", "connection_id": "conn-h"}]


def test_start_json_reports_creation_and_normalized_url(ctl_env: Config,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = fleetd(capsys, "ctl", "start", "j", "  WSS://Feed.Example.COM  ", "--json")
    assert code == exits.OK
    assert orjson.loads(out) == {"connection_id": "j", "desired_state": STARTED,
                                 "ws_url": "wss://feed.example.com/", "created": True,
                                 "previous_state": None, "hint_sent": True}


def test_restart_of_an_owned_item_keeps_owner_epoch_and_last_seq(ctl_env: Config,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ctl_env
    assert fleetd(capsys, "ctl", "start", "owned", "wss://a.example.com/")[0] == exits.OK
    before = ddb_item(cfg, "owned")
    claim(cfg, "owned", "task-1/0/boot", last_seq=42)
    assert fleetd(capsys, "ctl", "stop", "owned")[0] == exits.OK

    code, out, _ = fleetd(capsys, "ctl", "start", "owned", "wss://b.example.com/", "--json")
    assert code == exits.OK
    assert orjson.loads(out)["created"] is False and orjson.loads(out)["previous_state"] == STOPPED
    after = ddb_item(cfg, "owned")
    assert before is not None and after is not None
    assert after["desired_state"] == {"S": STARTED}
    assert after["ws_url"] == {"S": "wss://b.example.com/"}
    assert after["lease_owner"] == {"S": "task-1/0/boot"}
    assert after["lease_epoch"] == {"N": "1"}
    assert after["last_seq"] == {"N": "42"}
    assert after["lease_expires_at_ms"] == {"N": str(HELD_BY_SESSION)}
    assert after["created_at_ms"] == before["created_at_ms"]


def test_start_rejects_ws_when_only_wss_is_allowed(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "start", "plain", "ws://feed.example.com/")
    assert (code, out) == (exits.USAGE, "")
    assert_one_error_line(err, "'ws'", "--allowed-schemes")
    assert ddb_item(ctl_env, "plain") is None
    assert receive_hints(ctl_env) == []


def test_config_flags_work_before_and_after_the_command(ctl_env: Config,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    flag = ["--allowed-schemes", "ws,wss"]
    for cid, argv in (("before", ["ctl", *flag, "start", "before", "ws://127.0.0.1:9000/x"]),
                      ("after", ["ctl", "start", "after", "ws://127.0.0.1:9000/x", *flag])):
        code, _, err = fleetd(capsys, *argv)
        assert (code, err) == (exits.OK, ""), argv
        item = ddb_item(ctl_env, cid)
        assert item is not None and item["ws_url"] == {"S": "ws://127.0.0.1:9000/x"}
    # Given on both sides, the one after the command wins (argparse order).
    code, _, err = fleetd(capsys, "ctl", *flag, "start", "late", "ws://127.0.0.1:9000/x", "--allowed-schemes", "wss")
    assert code == exits.USAGE
    assert_one_error_line(err, "'ws' is not allowed")


def test_start_rejects_a_host_outside_the_allow_list(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "--allowed-hosts", "good.example.com", "start", "h",
                            "wss://evil.example.com/")
    assert (code, out) == (exits.USAGE, "")
    assert_one_error_line(err, "evil.example.com", "allowed_hosts")
    assert ddb_item(ctl_env, "h") is None
    code, _, _ = fleetd(capsys, "ctl", "--allowed-hosts", "good.example.com", "start", "h",
                        "wss://GOOD.example.com/")
    assert code == exits.OK


def test_start_rejects_garbage_urls(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    for url in ("not a url", "garbage", "wss://", "wss:///path", "wss://host:99999/", "wss://h/\x7f"):
        code, out, err = fleetd(capsys, "ctl", "start", "g", url)
        assert (code, out) == (exits.USAGE, ""), url
        assert_one_error_line(err, "invalid URL")
    assert ddb_item(ctl_env, "g") is None


def test_start_errors_redact_url_credentials_and_query(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    """A query string may carry a token: the one error line must not echo it (nor a password)."""
    for url in ("wss://feed.example.com/p?token=SECRET x", "wss://me:SECRET@feed.example.com:99999/p?t=SECRET"):
        code, out, err = fleetd(capsys, "ctl", "start", "r", url)
        assert (code, out) == (exits.USAGE, ""), url
        assert_one_error_line(err, "invalid URL", "feed.example.com")
        assert "SECRET" not in err, err
    assert ddb_item(ctl_env, "r") is None


def test_start_rejects_invalid_ids(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    for cid in ("", "bad\x01id", "tab\tid", "x" * (MAX_ID_BYTES + 1), "é" * 513):
        code, out, err = fleetd(capsys, "ctl", "start", cid, "wss://feed.example.com/")
        assert (code, out) == (exits.USAGE, ""), cid
        assert_one_error_line(err, "invalid connection id")
    assert receive_hints(ctl_env) == []


def test_start_without_the_hint_queue_still_writes_and_warns(ctl_env: Config,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "start", "nq", "wss://feed.example.com/", "--json",
                            "--hints-queue", "no-such-queue-here")
    assert code == exits.OK
    assert orjson.loads(out)["hint_sent"] is False
    assert err.count("\n") == 1 and err.startswith("fleetd: warning: ") and "no-such-queue-here" in err
    assert ddb_item(ctl_env, "nq") is not None


# ----- stop -----------------------------------------------------------------------------------------------


def test_stop_unknown_id_is_a_usage_error(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "stop", "nobody")
    assert (code, out) == (exits.USAGE, "")
    assert_one_error_line(err, "unknown connection", "nobody")
    assert ddb_item(ctl_env, "nobody") is None  # the condition kept a typo from creating an item


def test_stop_sets_stopped_and_keeps_the_rest(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleetd(capsys, "ctl", "start", "s", "wss://feed.example.com/")[0] == exits.OK
    code, out, err = fleetd(capsys, "ctl", "stop", "s", "--json")
    assert (code, err) == (exits.OK, "")
    assert orjson.loads(out) == {"connection_id": "s", "desired_state": STOPPED, "previous_state": STARTED,
                                 "lease_owner": None}
    item = ddb_item(ctl_env, "s")
    assert item is not None
    assert item["desired_state"] == {"S": STOPPED}
    assert item["ws_url"] == {"S": "wss://feed.example.com/"}
    assert item["lease_expires_at_ms"] == {"N": "0"}


# ----- ls / show / sessions -------------------------------------------------------------------------------


def test_ls_shows_lease_state_and_ownership(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    for cid in ("b-free", "a-owned"):
        assert fleetd(capsys, "ctl", "start", cid, f"wss://feed.example.com/{cid}")[0] == exits.OK
    claim(ctl_env, "a-owned", "task-1/0/n1", last_seq=7)

    code, out, _ = fleetd(capsys, "ctl", "ls", "--json")
    assert code == exits.OK
    rows = orjson.loads(out)
    assert [r["connection_id"] for r in rows] == ["a-owned", "b-free"]
    owned, free = rows
    assert owned["lease_owner"] == "task-1/0/n1" and owned["lease"] == "session"
    assert (owned["lease_epoch"], owned["last_seq"]) == (1, 7)
    assert owned["lease_expires_at_ms"] == HELD_BY_SESSION
    assert free["lease_owner"] is None and free["lease"] == "free" and free["lease_expires_at_ms"] == 0
    assert free["ws_url"] == "wss://feed.example.com/b-free"
    assert free["last_seq"] is None, "no checkpoint yet"

    code, out, _ = fleetd(capsys, "ctl", "ls")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STATE", "OWNER", "EXPIRES", "EPOCH", "LAST_SEQ"]
    assert lines[1].split() == ["a-owned", STARTED, "task-1/0/n1", "session", "1", "7"]
    assert lines[2].split() == ["b-free", STARTED, "-", "-", "0", "-"]


def test_ls_pages_through_the_whole_table(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ctl_env
    blob = "x" * 20_000  # ~1 MB of items: more than one Scan page

    async def fill() -> None:
        async with clients(cfg) as c:
            for i in range(60):
                await c.dynamodb.put_item(TableName=cfg.aws.connections_table, Item={
                    "connection_id": {"S": f"c{i:03}"}, "desired_state": {"S": STARTED},
                    "ws_url": {"S": "wss://feed.example.com/"}, "lease_expires_at_ms": {"N": "0"},
                    "padding": {"S": blob}})

    arun(fill())
    code, out, _ = fleetd(capsys, "ctl", "ls", "--json")
    assert code == exits.OK
    assert [r["connection_id"] for r in orjson.loads(out)] == [f"c{i:03}" for i in range(60)]


def test_show_prints_every_attribute(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleetd(capsys, "ctl", "start", "sh", "wss://feed.example.com/")[0] == exits.OK
    claim(ctl_env, "sh", "task-1/0/n2")
    code, out, _ = fleetd(capsys, "ctl", "show", "sh", "--json")
    assert code == exits.OK
    item = orjson.loads(out)
    assert item["connection_id"] == "sh" and item["desired_state"] == STARTED
    assert item["lease_owner"] == "task-1/0/n2" and item["lease_epoch"] == 1
    assert item["lease_expires_at_ms"] == HELD_BY_SESSION
    assert {"ws_url", "created_at_ms", "updated_at_ms"} <= set(item)

    code, out, _ = fleetd(capsys, "ctl", "show", "sh")
    assert code == exits.OK
    assert "held by session" in out and "task-1/0/n2" in out


def test_show_unknown_id_is_a_usage_error(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "show", "ghost", "--json")
    assert (code, out) == (exits.USAGE, "")
    assert_one_error_line(err, "ghost")


def test_sessions_lists_live_and_expired_with_owned_counts(ctl_env: Config,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ctl_env
    for cid in ("x1", "x2", "x3"):
        assert fleetd(capsys, "ctl", "start", cid, "wss://feed.example.com/")[0] == exits.OK
    claim(cfg, "x1", "task-1/0/live")

    async def dead_session_owning_two() -> None:
        async with clients(cfg) as c:
            store = leases(c, cfg)
            await store.create_session(SessionInfo("task-2/1/dead", "task-2", 1, 500, host="h2", pid=7))
            for cid in ("x2", "x3"):
                assert (await store.claim(cid, "task-2/1/dead")).outcome is Outcome.WON
            assert await store.expire_session("task-2/1/dead") is Outcome.WON

    arun(dead_session_owning_two())
    code, out, _ = fleetd(capsys, "ctl", "sessions", "--json")
    assert code == exits.OK
    rows = {r["session_id"]: r for r in orjson.loads(out)}
    assert list(rows) == ["task-1/0/live", "task-2/1/dead"]  # live first
    live, dead = rows["task-1/0/live"], rows["task-2/1/dead"]
    assert live["live"] is True and live["items_owned"] == 1 and live["expires_in_s"] > 0
    assert (live["task_id"], live["shard"], live["pid"], live["capacity"]) == ("task-1", 0, 4242, 700)
    assert live["draining"] is False and live["held"] == 0
    assert dead["live"] is False and dead["items_owned"] == 2 and dead["host"] == "h2"

    code, out, _ = fleetd(capsys, "ctl", "sessions")
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["SESSION", "TASK"]
    assert lines[1].split()[0] == "task-1/0/live"
    assert lines[2].split()[0] == "task-2/1/dead" and "expired" in lines[2].split()
    assert lines[2].split()[-1] == "2"


# ----- release ----------------------------------------------------------------------------------------------


def test_release_refuses_a_live_owner_and_frees_a_dead_or_missing_one_only_with_force(
        ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ctl_env
    for cid in ("r1", "r2", "r3"):
        assert fleetd(capsys, "ctl", "start", cid, "wss://feed.example.com/")[0] == exits.OK
    receive_hints(cfg)  # the start hints
    claim(cfg, "r1", "task-1/0/live")

    async def dead_and_forgotten() -> None:
        async with clients(cfg) as c:
            store = leases(c, cfg)
            await store.create_session(SessionInfo("task-2/0/dead", "task-2", 0, 500))
            assert (await store.claim("r2", "task-2/0/dead")).outcome is Outcome.WON
            assert await store.expire_session("task-2/0/dead") is Outcome.WON
            # A session that no longer exists: its claim landed after it was forgotten.
            assert (await store.claim("r3", "task-3/0/gone")).outcome is Outcome.WON

    arun(dead_and_forgotten())
    code, _, err = fleetd(capsys, "ctl", "release", "r1", "--force")
    assert code == exits.USAGE
    assert_one_error_line(err, "live session", "task-1/0/live")
    assert (ddb_item(cfg, "r1") or {})["lease_owner"]["S"] == "task-1/0/live"

    code, out, _ = fleetd(capsys, "ctl", "release", "r3", "--json")
    assert code == exits.OK and orjson.loads(out)["result"].startswith("not released")
    assert (ddb_item(cfg, "r3") or {})["lease_owner"]["S"] == "task-3/0/gone"

    for cid, state in (("r2", "dead"), ("r3", "gone")):
        code, out, _ = fleetd(capsys, "ctl", "release", cid, "--force", "--json")
        assert code == exits.OK, out
        assert orjson.loads(out) == {"connection_id": cid, "lease_owner": f"task-{cid[1]}/0/{state}",
                                     "owner_state": state, "result": "released and a START hint sent"}
        item = ddb_item(cfg, cid) or {}
        assert "lease_owner" not in item and item["lease_expires_at_ms"] == {"N": "0"}
    assert {h["connection_id"] for h in receive_hints(cfg)} == {"r2", "r3"}
    code, out, _ = fleetd(capsys, "ctl", "release", "r2")
    assert code == exits.OK and "nothing to release" in out


# ----- failures of the deployment -------------------------------------------------------------------------


def test_missing_table_says_run_init(ctl_env: Config, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fleetd(capsys, "ctl", "ls", "--connections-table", "no-such-table")
    assert (code, out) == (exits.USAGE, "")
    assert_one_error_line(err, "table no-such-table not found", "fleetd init")


def test_unreachable_dynamodb_is_a_runtime_failure(ctl_env: Config, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", f"http://127.0.0.1:{port}")
    code, out, err = fleetd(capsys, "ctl", "show", "x", "--aws-max-attempts", "1", "--aws-timeout-s", "1")
    assert (code, out) == (exits.FAILURE, "")
    assert_one_error_line(err, "GetItem failed")
    assert "Traceback" not in err


# ----- a real process ----------------------------------------------------------------------------------------


def test_ctl_in_a_subprocess(ctl_env: Config) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    env.update({k: v for k, v in as_env(ctl_env).items() if k.endswith(("_TABLE", "_QUEUE"))})

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetd", "ctl", *argv], env=env, capture_output=True,
                              text=True, timeout=60, check=False)

    started = run("start", "sub-1", "wss://feed.example.com/sub")
    assert started.returncode == exits.OK, started.stderr
    listed = run("ls", "--json")
    assert listed.returncode == exits.OK, listed.stderr
    assert [r["connection_id"] for r in orjson.loads(listed.stdout)] == ["sub-1"]
    bad = run("start", "sub-2", "ws://feed.example.com/sub")
    assert bad.returncode == exits.USAGE and bad.stdout == ""
    assert_one_error_line(bad.stderr, "invalid URL")


# ----- validation units (shards reuse them on items written by any client) ----------------------------------


WSS_ONLY = UpstreamConfig()
BOTH = UpstreamConfig(allowed_schemes=("ws", "wss"))


@pytest.mark.parametrize(("url", "normalized"), [
    ("wss://feed.example.com/a?b=1", "wss://feed.example.com/a?b=1"),
    ("  WSS://Feed.Example.COM  ", "wss://feed.example.com/"),
    ("wss://feed.example.com.:8443", "wss://feed.example.com:8443/"),
    ("wss://[::1]:9000/x", "wss://[::1]:9000/x"),
    ("wss://10.0.0.7/x", "wss://10.0.0.7/x"),
    ("wss://bücher.example/", "wss://xn--bcher-kva.example/"),
    ("wss://a.example.com/p%20q?x=%C3%A9", "wss://a.example.com/p%20q?x=%C3%A9"),
])
def test_validate_url_normalizes(url: str, normalized: str) -> None:
    assert validate_url(url, WSS_ONLY) == normalized


@pytest.mark.parametrize(("url", "reason"), [
    ("", "empty"),
    ("ws://feed.example.com/", "'ws' is not allowed"),
    ("https://feed.example.com/", "non-WebSocket scheme"),
    ("feed.example.com/x", "no scheme"),
    ("wss://", "no host"),
    ("wss:feed.example.com", "no host"),
    ("wss://exa mple.com/", "whitespace"),
    ("wss://feed.example.com/a\nb", "whitespace"),
    ("wss://feed.example.com/x\x00", "control"),
    ("wss://feed.example.com:99999/", "malformed"),
    ("wss://feed.example.com:0/", "port"),
    ("wss://feed.example.com:abc/", "malformed"),
    ("wss://[::1/", "malformed"),
    ("wss://user:secret@feed.example.com/", "credentials"),
    ("wss://feed.example.com/#frag", "fragment"),
    ("wss://-bad-.example.com/", "invalid host"),
    ("wss://a..b/", "invalid host"),
    ("wss://300.1.1.1/", "invalid host"),
    ("wss://under%20score/", "invalid host"),
    ("wss://feed.example.com/é", "percent-encoded"),
    ("wss://feed.example.com/" + "a" * 9000, "longer than"),
])
def test_validate_url_rejects(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        validate_url(url, WSS_ONLY)


def test_validate_url_scheme_and_host_lists() -> None:
    assert validate_url("ws://127.0.0.1:8000/s", BOTH) == "ws://127.0.0.1:8000/s"
    only = UpstreamConfig(allowed_hosts=("Feed.Example.com.",))
    assert validate_url("wss://FEED.example.com/", only) == "wss://feed.example.com/"
    with pytest.raises(ValueError, match="allowed_hosts"):
        validate_url("wss://other.example.com/", only)


def test_validate_id() -> None:
    assert validate_id("tenant-7/stream 1") == "tenant-7/stream 1"
    assert validate_id("é" * 512) == "é" * 512  # 1024 bytes exactly
    for bad in ("", "a\nb", "\udcff", "x" * 1025):
        with pytest.raises(ValueError):
            validate_id(bad)


@pytest.mark.parametrize(("address", "reason"), [
    ("8.8.8.8", None),
    ("2606:4700:4700::1111", None),
    ("64:ff9b::808:808", None),  # NAT64 of a global address
    ("127.0.0.1", "loopback"),
    ("127.9.9.9", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped IPv6
    ("10.0.0.7", "private"),
    ("172.16.5.4", "private"),
    ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"),
    ("::ffff:10.0.0.1", "private"),
    ("169.254.169.254", "link_local"),
    ("fe80::1", "link_local"),
    ("fe80::1%1", "link_local"),
    ("64:ff9b::a9fe:a9fe", "link_local"),  # NAT64 of 169.254.169.254
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("ff0e::1", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("100.64.0.1", "non_global"),  # shared address space (carrier-grade NAT)
    ("192.0.2.1", "non_global"),  # documentation
    ("240.0.0.1", "non_global"),  # reserved
    ("0.1.2.3", "non_global"),
    ("fec0::1", "non_global"),  # deprecated site-local
])
def test_address_refusal(address: str, reason: str | None) -> None:
    assert address_refusal(address) == reason


def test_allowed_networks_lift_a_refusal_for_their_addresses_only() -> None:
    loopback = ("127.0.0.0/8", "::1/128")
    assert address_refusal("127.0.0.1", loopback) is None
    assert address_refusal("::ffff:127.0.0.1", loopback) is None  # the IPv4 address it reaches is allowed
    assert address_refusal("::1", loopback) is None
    assert address_refusal("169.254.169.254", loopback) == "link_local"
    assert address_refusal("10.0.0.7", ("10.0.0.0/24",)) is None
    assert address_refusal("10.0.1.7", ("10.0.0.0/24",)) == "private"


@pytest.mark.parametrize(("url", "redacted"), [
    ("wss://feed.example.com/s", "wss://feed.example.com/s"),
    ("wss://feed.example.com:8443/s?token=abc&x=1", "wss://feed.example.com:8443/s?\u2026"),
    ("wss://user:pw@feed.example.com/s", "wss://\u2026@feed.example.com/s"),
    ("ws://h?from_seq=5", "ws://h?\u2026"),
    ("wss://h/p#frag", "wss://h/p#\u2026"),
    ("wss://[::1]:9000/x?k=v", "wss://[::1]:9000/x?\u2026"),
    ("not a url?secret", "not a url?\u2026"),
])
def test_redact_url(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted
