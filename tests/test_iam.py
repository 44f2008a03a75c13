"""The task role grants exactly what fleetd calls: every (IAM action, resource) pair, none missing, none extra.

The pairs are derived from a real ``fleetd run`` (supervisor and two shards) whose DynamoDB, SQS and
CloudWatch endpoints are recording proxies in front of the local stack, taken through the life
cycle the task role serves: boot, claims of free items, messages written, a ``ctl start`` hint
consumed, a ``ctl stop`` honoured, a shard killed (its supervisor buries its session, its streams
are taken over, the dead session is forgotten after its grace), rebalance looks (and hand-overs
to the restarted shard, which boots empty), the orphan sweep, the desired-state sweep,
ActiveConnections through PutMetricData, and a SIGTERM that releases everything with START hints.
One fault is injected: the answer to the first claim is lost, so the consistent read that settles
an ambiguous claim is made too.

Operator commands (``fleetd init``, ``fleetd ctl``, the test's own seeding) talk to the stack
directly, never through the proxies: they are not the task role's business.

A pair is the IAM action (``dynamodb:Query``; an SQS ``…Batch`` call is authorized by its
single-message action) and the template's logical name of the resource it acts on
(``ConnectionsTable``, ``ConnectionsTable/index/by_owner``, ``HintsQueue``), or, for
``cloudwatch:PutMetricData`` (no resource-level permissions), the namespace condition
(``namespace:CloudWatchNamespace``).  Configured names are mapped to logical names through the
task definition's environment (``FLEETD_CONNECTIONS_TABLE: !Ref ConnectionsTable``).

A cheap static cross-check complements the run: every AWS operation called anywhere in the task's
code maps to a granted action, and every granted action is called somewhere.

The one conditional grant is not fleetd's: with ``Tracing=enabled`` the template adds a collector
container that sends fleetd's traces to X-Ray, and the task role (every container's) gains the one
call its exporter makes.  It is checked on its own (:func:`tracing_grants`), never mixed with
fleetd's: the run above is untraced, as the template's default is.
"""

from __future__ import annotations

import fnmatch
import importlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import botocore.session
import orjson
import pytest
from aiohttp import web
from botocore.parsers import RpcV2CBORParser

from bench.faults.proxy import FaultProxy, ProxyThread, Rule, operation_of
from fleetd import config, exits
from fleetd.config import Config
from fleetd.devstack import DevStack
from tests import fleet
from tests.fleet import FleetdProc, UpstreamProc, owners, scan_all, seed_items, wait_for

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "fleetd.yaml"
CONNECTIONS = 12
# PyYAML ships no type information (as in tests/test_dashboard.py).
yaml: Any = importlib.import_module("yaml")
Pair = tuple[str, str]  # (IAM action, logical resource)

# Granted, but not reached in every run: the calls and why the static check below covers them.
MAYBE_UNREACHED: dict[Pair, str] = {
    # A stopping shard requeues the hints its last poll brought (its own START hints, usually).  The
    # SIGTERM is sent while a poll is freshly open, so the run almost always makes this call; when
    # the poll happens to answer before the hints land, it does not.
    ("sqs:ChangeMessageVisibility", "HintsQueue"): "hints.py Hints.requeue (shard/inbox.py, stopping)",
}
# The task definition's variables that name a resource: their values in the run map to logical names.
RESOURCE_VARIABLES = ("FLEETD_CONNECTIONS_TABLE", "FLEETD_SESSIONS_TABLE", "FLEETD_MESSAGES_TABLE",
                      "FLEETD_HINTS_QUEUE", "FLEETD_CLOUDWATCH_NAMESPACE")
# Modules that only operators run, with their own credentials: `fleetd ctl`, `fleetd dev` (the local
# stack and its seeding), the CLI wiring.
OPERATOR_MODULES = ("fleetd/ctl.py", "fleetd/dev.py", "fleetd/devstack.py", "fleetd/cli.py")
# `fleetd init` (fleetd/schema.py, shared with the boot check that calls DescribeTable).
OPERATOR_OPERATIONS = {"dynamodb": {"CreateTable", "UpdateTimeToLive"}, "sqs": {"CreateQueue"}}


# ----- the template ------------------------------------------------------------------------------------------


def _tagged(loader: Any, suffix: str, node: Any) -> dict[str, Any]:
    """A CloudFormation short tag kept as a one-key map: ``!Ref X`` → ``{"!Ref": "X"}``."""
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    return {"!" + suffix: value}


_CfnLoader: Any = type("_CfnLoader", (yaml.SafeLoader,), {})
_CfnLoader.add_multi_constructor("!", _tagged)


def template() -> dict[str, Any]:
    tpl: dict[str, Any] = yaml.load(TEMPLATE.read_text(encoding="utf-8"), Loader=_CfnLoader)
    return tpl


def _all_statements(tpl: dict[str, Any]) -> list[dict[str, Any]]:
    (task,) = [r for r in tpl["Resources"].values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    role_ref = task["Properties"]["TaskRoleArn"]["!GetAtt"]
    role = tpl["Resources"][role_ref.split(".")[0]]
    return [st for policy in role["Properties"]["Policies"] for st in policy["PolicyDocument"]["Statement"]]


def _conditional(st: dict[str, Any]) -> dict[str, Any] | None:
    """The statement behind ``!If [HasTracing, statement, !Ref AWS::NoValue]``; None if unconditional.
    Any other condition is refused: it would be a grant neither check below accounts for."""
    if "!If" not in st:
        return None
    condition, yes, no = st["!If"]
    assert condition == "HasTracing" and no == {"!Ref": "AWS::NoValue"}, f"unexpected conditional grant: {st}"
    return dict(yes)


def task_role_statements(tpl: dict[str, Any]) -> list[dict[str, Any]]:
    """What fleetd's own calls need: the unconditional statements."""
    return [st for st in _all_statements(tpl) if _conditional(st) is None]


def tracing_grants(tpl: dict[str, Any]) -> set[Pair]:
    """The tracing collector's grants (``Tracing=enabled`` only)."""
    out: set[Pair] = set()
    for st in _all_statements(tpl):
        if (yes := _conditional(st)) is not None:
            out |= {(a, logical_resource(r, yes.get("Condition"))) for a in _listed(yes["Action"])
                    for r in _listed(yes["Resource"])}
    return out


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def logical_resource(node: Any, condition: dict[str, Any] | None) -> str:
    """``!GetAtt X.Arn`` → ``X``; ``!Sub "${X.Arn}/index/i"`` → ``X/index/i``; ``"*"`` under a
    namespace condition → ``namespace:<parameter>``.  Anything else is refused (a wildcard index
    grants more than fleetd uses)."""
    if node == "*":
        namespace = ((condition or {}).get("StringEquals") or {}).get("cloudwatch:namespace")
        return f"namespace:{namespace['!Ref']}" if isinstance(namespace, dict) else "*"
    if isinstance(node, dict) and isinstance(node.get("!GetAtt"), str) and node["!GetAtt"].endswith(".Arn"):
        return str(node["!GetAtt"]).removesuffix(".Arn")
    if isinstance(node, dict) and isinstance(node.get("!Sub"), str):
        return re.sub(r"\$\{(\w+)\.Arn\}", r"\1", node["!Sub"])
    raise AssertionError(f"unsupported Resource form in the task role: {node!r}")


def granted(tpl: dict[str, Any]) -> set[Pair]:
    pairs: set[Pair] = set()
    for st in task_role_statements(tpl):
        assert st["Effect"] == "Allow" and "NotAction" not in st and "NotResource" not in st, st
        for action in _listed(st["Action"]):
            pairs |= {(action, logical_resource(r, st.get("Condition"))) for r in _listed(st["Resource"])}
    return pairs


def allows(grant: Pair, call: Pair) -> bool:
    """IAM's matching: ``*`` in a granted action or resource matches any run of characters."""
    return fnmatch.fnmatchcase(call[0], grant[0]) and fnmatch.fnmatchcase(call[1], grant[1])


def logical_names(tpl: dict[str, Any], cfg: Config) -> dict[str, str]:
    """The run's resource names (tables, queue, namespace) → the template's logical names, through
    the task definition's environment."""
    (task,) = [r for r in tpl["Resources"].values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    (container,) = [c for c in task["Properties"]["ContainerDefinitions"] if c.get("Name") == "fleetd"]
    env = {e["Name"]: e["Value"] for e in container["Environment"] if isinstance(e, dict) and "Name" in e}
    values = config.as_env(cfg)
    names: dict[str, str] = {}
    for var in RESOURCE_VARIABLES:
        ref = env[var]
        logical = ref["!Ref"] if "!Ref" in ref else str(ref["!GetAtt"]).split(".")[0]
        names[values[var]] = logical
    return names


# ----- recording proxies -----------------------------------------------------------------------------------


def _batch_free(action: str) -> str:
    """SQS batch calls are authorized by their single-message actions."""
    return action.removesuffix("Batch")


def dynamodb_resources(req: dict[str, Any]) -> list[str]:
    if "RequestItems" in req:
        return list(req["RequestItems"])
    table = str(req["TableName"])
    return [f"{table}/index/{req['IndexName']}" if "IndexName" in req else table]


def sqs_resources(req: dict[str, Any]) -> list[str]:
    return [str(req["QueueName"]) if "QueueName" in req else str(req["QueueUrl"]).rsplit("/", 1)[1]]


def decode(body: bytes) -> dict[str, Any]:
    """A request's parameters, in whichever protocol the client chose: JSON (DynamoDB, SQS, and
    CloudWatch given an endpoint), a query form, or CBOR (CloudWatch's rpc-v2, decoded by botocore)."""
    if not body:
        return {}
    if body.startswith(b"{"):
        return dict(orjson.loads(body))
    if body.startswith(b"Action=") or b"&Action=" in body:
        return {k: v[0] for k, v in parse_qs(body.decode()).items()}
    return dict(RpcV2CBORParser().parse_data_item(io.BytesIO(body)))


class RecordingProxy(FaultProxy):
    """Forwards every request unchanged and records the (IAM action, resource name) it needs.

    ``lose_claim_answers``: the answers to that many claims (the only connection-table UpdateItem
    asking for ALL_NEW) are lost after the write is applied, so the shard settles them by reading.
    """

    def __init__(self, upstream_url: str, service: str, lose_claim_answers: int = 0) -> None:
        super().__init__(upstream_url)
        self.service = service
        self.lose_claim_answers = lose_claim_answers
        self.lost_claim_answers = 0
        self.seen: set[Pair] = set()
        self.open_polls: dict[int, float] = {}  # ReceiveMessage in flight → when it arrived (monotonic)
        self._lock = threading.Lock()

    def pairs(self) -> set[Pair]:
        with self._lock:
            return set(self.seen)

    def fresh_poll(self, max_age_s: float) -> bool:
        """A long poll arrived less than ``max_age_s`` ago and is still open."""
        now = time.monotonic()
        with self._lock:
            return any(now - t < max_age_s for t in self.open_polls.values())

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        op = operation_of(request, body)
        req = decode(body)
        with self._lock:
            self.seen |= {(f"{self.service}:{_batch_free(op)}", r) for r in self._resources(req)}
        if self._is_claim(op, req) and self.lost_claim_answers < self.lose_claim_answers:
            self.lost_claim_answers += 1
            return await self._drop_response(request, body, Rule(op, "drop_response"))
        if op != "ReceiveMessage":
            return await super()._handle(request)
        with self._lock:
            self.open_polls[id(request)] = time.monotonic()
        try:
            return await super()._handle(request)
        finally:
            with self._lock:
                del self.open_polls[id(request)]

    def _resources(self, req: dict[str, Any]) -> list[str]:
        if self.service == "dynamodb":
            return dynamodb_resources(req)
        if self.service == "sqs":
            return sqs_resources(req)
        return [f"namespace:{req['Namespace']}"]

    @staticmethod
    def _is_claim(op: str, req: dict[str, Any]) -> bool:
        return op == "UpdateItem" and req.get("ReturnValues") == "ALL_NEW" and "lease_epoch" in str(
            req.get("UpdateExpression", ""))


@contextmanager
def recording(stack: DevStack) -> Iterator[dict[str, RecordingProxy]]:
    """One recording proxy per service, each on its own thread and listening (``.url``)."""
    upstreams = {"dynamodb": stack.dynamodb_url, "sqs": stack.moto_url, "cloudwatch": stack.moto_url}
    with ExitStack() as stack_of_threads:
        proxies = {}
        for service, url in upstreams.items():
            proxy = RecordingProxy(url, service, lose_claim_answers=1 if service == "dynamodb" else 0)
            stack_of_threads.enter_context(ProxyThread(url, proxy=proxy))  # sets proxy.url
            proxies[service] = proxy
        yield proxies


def derived(proxies: dict[str, RecordingProxy], names: dict[str, str]) -> set[Pair]:
    """What the run called, with resource names mapped to logical ones (``X/index/i`` keeps its index)."""
    out: set[Pair] = set()
    for proxy in proxies.values():
        for action, resource in proxy.pairs():
            kind, sep, name = resource.partition(":") if resource.startswith("namespace:") else ("", "", resource)
            table, slash, index = name.partition("/")
            logical = names.get(table, f"<not fleetd's: {table}>")
            out.add((action, f"{kind}{sep}{logical}{slash}{index}"))
    return out


# ----- the run -------------------------------------------------------------------------------------------


def ctl(cfg: Config, *args: str) -> None:
    """``fleetd ctl …`` as an operator runs it: straight to the stack, not through the proxies."""
    env = {**os.environ, **config.as_env(cfg), "FLEETD_ALLOWED_SCHEMES": "ws,wss"}
    res = subprocess.run([sys.executable, "-m", "fleetd", "ctl", *args], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == exits.OK, res.stderr


def shard_pids(run: FleetdProc) -> dict[int, int]:
    return {int(e["shard"]): int(e["pid"]) for e in run.logs()
            if e.get("event") == "shard started" and e.get("logger") == "fleetd.supervisor"}


def session_of(cfg: Config, pid: int) -> str:
    (sid,) = [s["session_id"]["S"] for s in scan_all(cfg.aws.sessions_table, ConsistentRead=True)
              if int(s["pid"]["N"]) == pid and "dead_at_ms" not in s]
    return str(sid)


def start_run(cfg: Config, proxies: dict[str, RecordingProxy], log_path: Path) -> FleetdProc:
    env = fleet.fleetd_env(
        cfg, FLEETD_TASK_ID="iam", FLEETD_SHARDS="2", FLEETD_ALLOWED_SCHEMES="ws,wss",
        FLEETD_CLOUDWATCH_MODE="api", FLEETD_CLOUDWATCH_S="1",
        FLEETD_ORPHAN_SWEEP_S="1", FLEETD_REBALANCE_S="1", FLEETD_DESIRED_SWEEP_S="1",
        FLEETD_DEAD_SESSION_GRACE_S="6",  # the least allowed: aws_timeout_s x aws_max_attempts (2 s x 3)
        FLEETD_HINT_WAIT_S="5",  # long polls, so that one is open when the SIGTERM comes (MAYBE_UNREACHED)
        AWS_ENDPOINT_URL_DYNAMODB=proxies["dynamodb"].url, AWS_ENDPOINT_URL_SQS=proxies["sqs"].url,
        AWS_ENDPOINT_URL_CLOUDWATCH=proxies["cloudwatch"].url)
    return FleetdProc([sys.executable, "-m", "fleetd", "run", "--metrics-addr", "127.0.0.1:0"], env, log_path)


def all_owned(cfg: Config, ids: list[str]) -> bool:
    held = owners(cfg)
    return all(held.get(cid) for cid in ids)


def life_cycle(cfg: Config, run: FleetdProc, upstream: UpstreamProc, proxies: dict[str, RecordingProxy],
               ids: list[str]) -> None:
    """Claims, messages, a hint, a stop, a shard killed and its session forgotten, then SIGTERM."""
    wait_for(lambda: all_owned(cfg, ids), 45, what="every seeded item claimed")
    wait_for(lambda: ("dynamodb:BatchWriteItem", cfg.aws.messages_table) in proxies["dynamodb"].pairs(), 15,
             what="messages written")
    ctl(cfg, "start", "hinted", upstream.url("hinted"))
    ctl(cfg, "stop", ids[0])
    running = [*ids[1:], "hinted"]
    wait_for(lambda: all_owned(cfg, running) and not owners(cfg)[ids[0]], 15, what="the hint taken, the stop done")

    pid = wait_for(lambda: shard_pids(run).get(1), 10, what="shard 1's pid")
    killed = session_of(cfg, pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(o and o != killed for o in (owners(cfg)[cid] for cid in running)), 30,
             what="the killed shard's streams taken over")
    wait_for(lambda: killed not in {s["session_id"]["S"] for s in scan_all(cfg.aws.sessions_table)}, 30,
             what="the dead session forgotten after its grace")

    wait_for(lambda: proxies["sqs"].fresh_poll(1.0), 15, interval_s=0.05, what="a freshly opened long poll")
    run.signal(signal.SIGTERM)
    assert run.wait(30) == exits.OK
    assert not any(owners(cfg).values()), "items still owned after SIGTERM"


def test_task_role_grants_exactly_what_a_run_calls(stack: DevStack, cfg: Config, tmp_path: Path) -> None:
    tpl = template()
    upstream = UpstreamProc(tmp_path, rate=5.0, size=120)
    ids = [f"conn-{i:02d}" for i in range(CONNECTIONS)]
    seed_items(cfg, {cid: upstream.url(cid) for cid in ids})
    with recording(stack) as proxies:
        run = start_run(cfg, proxies, tmp_path / "run.log")
        try:
            life_cycle(cfg, run, upstream, proxies, ids)
        finally:
            fleet.stop_all(run, upstream)
    assert proxies["dynamodb"].lost_claim_answers == 1, "no claim answer was lost: the ambiguous-claim read untested"

    calls = derived(proxies, logical_names(tpl, cfg))
    grants = granted(tpl)
    print("\nderived from the run:\n  " + "\n  ".join(f"{a} on {r}" for a, r in sorted(calls)))
    missing = {c for c in calls if not any(allows(g, c) for g in grants)}  # AccessDenied in production
    extra = grants - calls - set(MAYBE_UNREACHED)  # literally: a wildcard is extra even where it matches
    assert not missing and not extra, (
        f"the task role in {TEMPLATE.name} does not match what fleetd calls:\n"
        f"  missing (called, not granted): {sorted(missing)}\n  extra (granted, never called): {sorted(extra)}")


# ----- the static cross-check --------------------------------------------------------------------------------


def _operations(service: str) -> dict[str, str]:
    """snake_case method name → API operation name."""
    model = botocore.session.get_session().get_service_model(service)
    return {botocore.xform_name(op): op for op in model.operation_names}


def called_operations() -> set[tuple[str, str]]:
    """(service, operation) of every AWS call in the task's code: ``client.snake_name(`` and the
    lease store's ``_call("Operation"`` / ``_write("Operation"``."""
    by_snake = {snake: (service, op) for service in ("dynamodb", "sqs", "cloudwatch")
                for snake, op in _operations(service).items()}
    lease_ops = set(_operations("dynamodb").values())
    found: set[tuple[str, str]] = set()
    for path in sorted((ROOT / "fleetd").rglob("*.py")):
        if str(path.relative_to(ROOT)) in OPERATOR_MODULES:
            continue
        text = path.read_text(encoding="utf-8")
        found |= {by_snake[m] for m in re.findall(r"\.(\w+)\(", text) if m in by_snake}
        found |= {("dynamodb", m) for m in re.findall(r"_(?:call|write)\(\s*\"(\w+)\"", text) if m in lease_ops}
    return {(s, op) for s, op in found if op not in OPERATOR_OPERATIONS.get(s, set())}


def test_every_aws_call_in_the_task_code_is_granted_and_every_grant_is_called() -> None:
    code = {f"{service}:{_batch_free(op)}" for service, op in called_operations()}
    grants = {action for action, _ in granted(template())}
    assert code == grants, (f"called, not granted: {sorted(code - grants)}; "
                            f"granted, never called: {sorted(grants - code)}")
    for action, _ in MAYBE_UNREACHED:
        assert action in code, f"{action} is no longer called: drop it from MAYBE_UNREACHED"


def test_the_only_conditional_grant_is_x_ray_for_the_tracing_collector() -> None:
    """Granted exactly when the container that makes the call exists: the collector's awsxray exporter
    sends segments (PutTraceSegments, no resource-level permissions) and, with its telemetry off,
    nothing else.  fleetd itself only speaks OTLP to it on the task's loopback."""
    tpl = template()
    assert tracing_grants(tpl) == {("xray:PutTraceSegments", "*")}
    (task,) = [r for r in tpl["Resources"].values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    sidecars = [c["!If"] for c in task["Properties"]["ContainerDefinitions"] if "!If" in c]
    assert [(cond, c["Name"]) for cond, c, _ in sidecars] == [("HasTracing", "otel-collector")]
    config_text = sidecars[0][1]["Environment"][0]["Value"]["!Sub"]
    exporters = yaml.safe_load(config_text.replace("${AWS::Region}", "r"))["exporters"]
    assert set(exporters) == {"awsxray"} and "telemetry" not in exporters["awsxray"]
    assert not any(a.startswith("xray:") for a, _ in granted(tpl)), "fleetd's own grants exclude X-Ray"


@pytest.mark.parametrize(("node", "condition", "logical"), [
    ({"!GetAtt": "SessionsTable.Arn"}, None, "SessionsTable"),
    ({"!Sub": "${ConnectionsTable.Arn}/index/by_owner"}, None, "ConnectionsTable/index/by_owner"),
    ({"!Sub": "${ConnectionsTable.Arn}/index/*"}, None, "ConnectionsTable/index/*"),
    ("*", {"StringEquals": {"cloudwatch:namespace": {"!Ref": "CloudWatchNamespace"}}}, "namespace:CloudWatchNamespace"),
    ("*", None, "*"),
])
def test_template_resources_map_to_logical_names(node: Any, condition: dict[str, Any] | None, logical: str) -> None:
    assert logical_resource(node, condition) == logical


@pytest.mark.parametrize(("grant", "call", "allowed"), [
    (("dynamodb:Query", "ConnectionsTable/index/*"), ("dynamodb:Query", "ConnectionsTable/index/by_owner"), True),
    (("dynamodb:Query", "ConnectionsTable"), ("dynamodb:Query", "ConnectionsTable/index/by_owner"), False),
    (("dynamodb:GetItem", "SessionsTable"), ("dynamodb:GetItem", "ConnectionsTable"), False),
])
def test_a_grant_allows_what_iam_would(grant: Pair, call: Pair, allowed: bool) -> None:
    assert allows(grant, call) is allowed
