"""The control plane: ``fleetd ctl start|stop|ls|show|sessions`` (SPEC §7).

``start`` validates the id and URL, upserts the connection item with UpdateItem and
sends a START hint; ``stop`` flips ``desired_state``; ``ls``, ``show`` and
``sessions`` read the tables.  Every command takes ``--json``.  Configuration flags
(``--allowed-schemes``, ``--connections-table``, ...) may be given before or after
the command: ``fleetd ctl --allowed-schemes ws,wss start ID URL`` and
``fleetd ctl start ID URL --allowed-schemes ws,wss`` mean the same.

Exit codes (``fleetd.exits``), one ``fleetd: error: ...`` line on stderr otherwise:

* 0 — done (``start`` also when only the hint failed: the item is written and the
  shards' reconcile finds it; a warning line says so);
* 1 — AWS runtime failure: unreachable endpoint, throttling, credentials, a missing index;
* 2 — input the operator must fix: invalid id or URL, unknown connection id, a table
  or queue that does not exist (wrong name, or ``fleetd init`` not run).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from botocore.exceptions import BotoCoreError, ClientError

from fleetd import config, exits, items
from fleetd.aws import Clients, Outcome, error_code, missing, open_clients
from fleetd.clock import Clock, SystemClock
from fleetd.config import Config
from fleetd.lease import STARTED, STOPPED, BadItem, ConnItem, Fate, LeaseStore
from fleetd.schema import HELD_BY_SESSION
from fleetd.validation import validate_id, validate_url

OWNER_QUERY_CONCURRENCY = 16  # `sessions`: by_owner queries in flight at once

# SDK failures that become one line; anything else is a bug and keeps its traceback.
_AWS_ERRORS: tuple[type[BaseException], ...] = (ClientError, BotoCoreError, OSError)


class CtlError(Exception):
    """A one-line message for the operator and the exit code it maps to."""

    def __init__(self, message: str, code: int = exits.FAILURE) -> None:
        super().__init__(message)
        self.code = code


def _usage(message: str) -> CtlError:
    return CtlError(message, exits.USAGE)


# ----- argument parsing -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Command:
    name: str
    help: str
    args: tuple[tuple[str, str, str], ...]  # (dest, metavar, help)
    force: str = ""  # help of a --force flag, if the command has one


_ID_ARG = ("connection_id", "ID", "connection id (printable, at most 1024 bytes)")
_COMMANDS = (
    _Command("start", "create or re-start a connection and send a START hint",
             (_ID_ARG, ("url", "URL", "upstream WebSocket URL (wss:// unless --allowed-schemes says otherwise)"))),
    _Command("stop", "set a connection's desired state to STOPPED (its owner closes it)", (_ID_ARG,)),
    _Command("ls", "list connections with their lease state", ()),
    _Command("show", "print every attribute of one connection item", (_ID_ARG,)),
    _Command("sessions", "list live and expired shard sessions and the items each owns", ()),
    _Command("release", "free a connection whose owner session is dead or no longer exists (says what it "
             "would do; --force does it)", (_ID_ARG,),
             force="free it; refused while the owner session is alive"),
)

_EPILOG = """\
Configuration flags may be given before or after the command; after wins:
  fleetd ctl --allowed-schemes ws,wss start ID URL
  fleetd ctl start ID URL --allowed-schemes ws,wss
exit codes: 0 done, 1 AWS failure, 2 bad input / unknown id / missing table or queue
"""


def _config_dests() -> list[str]:
    """Namespace attributes that ``config.add_flags`` creates (read off a scratch parser)."""
    probe = argparse.ArgumentParser(add_help=False)
    config.add_flags(probe)
    return list(vars(probe.parse_args([])))


_P = TypeVar("_P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[_P]) -> None:
    """Add ``ctl`` and its commands to the ``fleetd`` sub-parsers."""
    ctl = sub.add_parser("ctl", help="control connections: start, stop, ls, show, sessions, release",
                         usage="fleetd ctl [-h] [config flags] COMMAND [--json] [config flags] ...",
                         description="Control the fleet's connections (SPEC §7).", epilog=_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_flags(ctl)
    commands = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND", title="commands")
    config_dests = set(_config_dests())
    for cmd in _COMMANDS:
        # The generated usage would list all ~50 configuration flags and hide the arguments.
        usage = " ".join(["fleetd ctl", cmd.name, "[-h] [--json] [config flags]", *(a[1] for a in cmd.args)])
        p = commands.add_parser(cmd.name, help=cmd.help, usage=usage, description=cmd.help, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        for dest, metavar, help_text in cmd.args:
            p.add_argument(dest, metavar=metavar, help=help_text)
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        if cmd.force:
            p.add_argument("--force", action="store_true", help=cmd.force)
        config.add_flags(p)
        _suppress_defaults(p, config_dests)


def _suppress_defaults(parser: argparse.ArgumentParser, dests: set[str]) -> None:
    """Make ``dests`` absent from the namespace unless given on ``parser``'s command line.

    argparse copies every sub-command default over the parent's namespace, so a None
    default here would erase the same flag given before the command.  ``set_defaults``
    cannot do this (it would store the SUPPRESS marker itself), hence the action list.
    """
    for action in parser._actions:
        if action.dest in dests:
            action.default = argparse.SUPPRESS


# ----- running ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ctx:
    cfg: Config
    clients: Clients
    store: LeaseStore
    clock: Clock
    as_json: bool


def run(args: argparse.Namespace, cfg: Config) -> int:
    """Run one ``ctl`` command; returns its exit code (errors as one line on stderr)."""
    try:
        return asyncio.run(_main(args, cfg))
    except CtlError as e:
        print(f"fleetd: error: {_one_line(str(e))}", file=sys.stderr)
        return e.code


async def _main(args: argparse.Namespace, cfg: Config) -> int:
    handler = _HANDLERS[args.ctl_command]
    clock = SystemClock(cfg.lease.clock_offset_ms)
    async with AsyncExitStack() as stack:
        clients = await open_clients(stack, cfg.aws)
        store = LeaseStore(clients.dynamodb, cfg.aws, cfg.lease, clock)
        return await handler(_Ctx(cfg, clients, store, clock, bool(args.json)), args)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _warn(message: str) -> None:
    print(f"fleetd: warning: {_one_line(message)}", file=sys.stderr)


@contextmanager
def _aws_errors(action: str, resource: str, condition_failed: str = "") -> Iterator[None]:
    """Turn an SDK failure of ``action`` on ``resource`` (e.g. "table X") into a CtlError.

    ``condition_failed`` is the operator's message (exit 2) for a failed ConditionExpression.
    """
    try:
        yield
    except _AWS_ERRORS as e:
        if condition_failed and error_code(e) == "ConditionalCheckFailedException":
            raise _usage(condition_failed) from None
        raise _translate(e, action, resource) from None


def _translate(exc: BaseException, action: str, resource: str) -> CtlError:
    code = error_code(exc)
    if missing(exc):
        return _usage(f"{resource} not found (run `fleetd init`)")
    if not code:  # no HTTP answer: endpoint unreachable, timeout, no credentials
        return CtlError(f"{action} failed: {exc}")
    message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", ""))
    if code == "ValidationException" and "index" in message.lower():
        return CtlError(f"{resource}: {message} (run `fleetd init --check`)")
    return CtlError(f"{action} on {resource} failed: {code}: {message}")


def _print_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def _n(value: int) -> dict[str, str]:
    return {"N": str(value)}


def _s(value: str) -> dict[str, str]:
    return {"S": value}


# ----- start / stop -----------------------------------------------------------------------------------


def _checked(fn: Callable[..., str], what: str, *args: Any) -> str:
    try:
        return fn(*args)
    except ValueError as e:
        raise _usage(f"invalid {what}: {e}") from None


async def _start(ctx: _Ctx, args: argparse.Namespace) -> int:
    cid = _checked(validate_id, "connection id", args.connection_id)
    url = _checked(validate_url, "URL", args.url, ctx.cfg.upstream)
    old = await _upsert_started(ctx, cid, url)
    hint_sent = await _try_hint(ctx, cid)
    if ctx.as_json:
        _print_json({"connection_id": cid, "desired_state": STARTED, "ws_url": url, "created": old is None,
                     "previous_state": None if old is None else _plain(old.get("desired_state")),
                     "hint_sent": hint_sent})
    else:
        print(f"started {cid} {url} ({'new' if old is None else 'existing item, lease kept'})")
    return exits.OK


async def _upsert_started(ctx: _Ctx, cid: str, url: str) -> dict[str, Any] | None:
    """Write STARTED and the URL (:func:`fleetd.items.start_update`); returns the item before, if any."""
    table = ctx.cfg.aws.connections_table
    with _aws_errors("UpdateItem", f"table {table}"):
        resp = await ctx.clients.dynamodb.update_item(
            **items.start_update(table, cid, url, ctx.clock.now_ms()), ReturnValues="ALL_OLD")
    old = resp.get("Attributes")
    return dict(old) if old else None


async def _try_hint(ctx: _Ctx, cid: str) -> bool:
    """Send the START hint; a failure only delays pick-up until the next reconcile, so warn."""
    try:
        await _send_hint(ctx, cid)
    except CtlError as e:
        _warn(f"{cid} is started, but no START hint was sent ({e}); "
              f"a shard still picks it up within reconcile_s")
        return False
    return True


async def _send_hint(ctx: _Ctx, cid: str) -> None:
    queue = ctx.cfg.aws.hints_queue
    body = orjson.dumps({"type": "START", "connection_id": cid}).decode()
    with _aws_errors("sending the START hint", f"queue {queue}"):
        queue_url = (await ctx.clients.sqs.get_queue_url(QueueName=queue))["QueueUrl"]
        await ctx.clients.sqs.send_message(QueueUrl=queue_url, MessageBody=body)


async def _stop(ctx: _Ctx, args: argparse.Namespace) -> int:
    cid = _checked(validate_id, "connection id", args.connection_id)
    table = ctx.cfg.aws.connections_table
    # The condition keeps a typo from creating a STOPPED item nobody asked for.
    with _aws_errors("UpdateItem", f"table {table}", condition_failed=f"unknown connection {cid!r} in table {table}"):
        resp = await ctx.clients.dynamodb.update_item(
            TableName=table,
            Key={"connection_id": _s(cid)},
            UpdateExpression="SET desired_state = :stopped, updated_at_ms = :now",
            ConditionExpression="attribute_exists(connection_id)",
            ExpressionAttributeValues={":stopped": _s(STOPPED), ":now": _n(ctx.clock.now_ms())},
            ReturnValues="ALL_OLD",
        )
    old = _plain_item(resp.get("Attributes", {}))
    _report_stop(ctx, cid, old)
    return exits.OK


def _report_stop(ctx: _Ctx, cid: str, old: dict[str, Any]) -> None:
    owner = old.get("lease_owner") or None
    if ctx.as_json:
        _print_json({"connection_id": cid, "desired_state": STOPPED,
                     "previous_state": old.get("desired_state"), "lease_owner": owner})
        return
    tail = f"; owner {owner} closes it within {ctx.cfg.lease.desired_state_s:g} s" if owner else ""
    print(f"stopped {cid} (was {old.get('desired_state', '?')}){tail}")


# ----- ls / show --------------------------------------------------------------------------------------


async def _scan(ctx: _Ctx, table: str) -> list[dict[str, Any]]:
    """Every item of ``table`` over all Scan pages (consistent: shows what was just written)."""
    items: list[dict[str, Any]] = []
    start: dict[str, Any] | None = None
    with _aws_errors("Scan", f"table {table}"):
        while True:
            kwargs: dict[str, Any] = {"TableName": table, "ConsistentRead": True}
            if start:
                kwargs["ExclusiveStartKey"] = start
            resp = await ctx.clients.dynamodb.scan(**kwargs)
            items += resp.get("Items", [])
            start = resp.get("LastEvaluatedKey")
            if not start:
                return items


def _lease_view(owner: str, expires_at_ms: int, now_ms: int) -> tuple[str, float | None]:
    """The lease as ('free' | 'session' | 'item' | 'expired', seconds left or None)."""
    if not owner:
        return "free", None
    if expires_at_ms == HELD_BY_SESSION:
        return "session", None
    left = round((expires_at_ms - now_ms) / 1000, 3)
    return ("item" if left >= 0 else "expired"), left


def _ls_row(item: ConnItem, now_ms: int) -> dict[str, Any]:
    lease, left = _lease_view(item.lease_owner, item.lease_expires_at_ms, now_ms)
    return {"connection_id": item.connection_id, "desired_state": item.desired_state, "ws_url": item.ws_url,
            "lease_owner": item.lease_owner or None, "lease": lease, "expires_in_s": left,
            "lease_expires_at_ms": item.lease_expires_at_ms, "lease_epoch": item.lease_epoch,
            "last_seq": item.last_seq if item.last_seq >= 0 else None}  # None: nothing written yet


def _expires_cell(row: dict[str, Any]) -> str:
    lease = row["lease"]
    if lease == "free":
        return "-"
    if lease == "item":
        return f"{row['expires_in_s']:.1f}s"
    return str(lease)  # "session" or "expired"


async def _ls(ctx: _Ctx, args: argparse.Namespace) -> int:
    now = ctx.clock.now_ms()
    rows = []
    for raw in await _scan(ctx, ctx.cfg.aws.connections_table):
        try:
            rows.append(_ls_row(ConnItem.parse(raw), now))
        except BadItem as e:  # written by some other client: report it, list the rest
            _warn(f"skipping unreadable item: {e}")
    rows.sort(key=lambda r: str(r["connection_id"]))
    if ctx.as_json:
        _print_json(rows)
        return exits.OK
    print(_table(("ID", "STATE", "OWNER", "EXPIRES", "EPOCH", "LAST_SEQ"),
                 [(r["connection_id"], r["desired_state"], r["lease_owner"] or "-", _expires_cell(r),
                   r["lease_epoch"], r["last_seq"]) for r in rows]))
    return exits.OK


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart, "-" for a missing value; the last column is not padded."""
    cells = [list(headers), *[["-" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in cells
    )


async def _read_item(ctx: _Ctx, cid: str) -> dict[str, Any]:
    """The connection item (consistent read); an unknown id is a usage error."""
    table = ctx.cfg.aws.connections_table
    with _aws_errors("GetItem", f"table {table}"):
        resp = await ctx.clients.dynamodb.get_item(TableName=table, Key={"connection_id": _s(cid)},
                                                   ConsistentRead=True)
    if "Item" not in resp:
        raise _usage(f"unknown connection {cid!r} in table {table}")
    return dict(resp["Item"])


async def _show(ctx: _Ctx, args: argparse.Namespace) -> int:
    cid = _checked(validate_id, "connection id", args.connection_id)
    raw = _plain_item(await _read_item(ctx, cid))
    item = {name: raw[name] for name in _show_names(raw)}
    if ctx.as_json:
        _print_json(item)
    else:
        print(_show_text(item, ctx.clock.now_ms()))
    return exits.OK


async def _release(ctx: _Ctx, args: argparse.Namespace) -> int:
    """The operator's escape hatch for an item the fleet does not take over by itself: never for a live
    owner (it may be streaming), and only with --force; the write is conditioned on owner and epoch."""
    cid = _checked(validate_id, "connection id", args.connection_id)
    item = ConnItem.parse(await _read_item(ctx, cid))
    if not item.lease_owner:
        return _report_release(ctx, cid, "", "free", "nothing to release: it has no owner")
    fate = (await ctx.store.fate(item.lease_owner)).fate
    if fate is Fate.UNKNOWN:
        raise CtlError(f"could not read the session {item.lease_owner!r} of {cid!r}; nothing was changed")
    if fate is Fate.ALIVE:
        raise _usage(f"{cid!r} is owned by the live session {item.lease_owner!r}, which may be streaming it; "
                     f"use `fleetd ctl stop`, or wait for the session to end")
    state = "dead" if fate is Fate.DEAD else "gone"
    if not args.force:
        return _report_release(ctx, cid, item.lease_owner, state, "not released (pass --force to free it)")
    outcome = await ctx.store.disown(cid, item.lease_owner, epoch=item.lease_epoch)
    if outcome is not Outcome.WON:
        raise CtlError(f"{cid!r} changed while being released ({outcome.value}); run `fleetd ctl show {cid}`")
    hinted = await _try_hint(ctx, cid)
    return _report_release(ctx, cid, item.lease_owner, state,
                           "released" + (" and a START hint sent" if hinted else ""))


def _report_release(ctx: _Ctx, cid: str, owner: str, owner_state: str, what: str) -> int:
    if ctx.as_json:
        _print_json({"connection_id": cid, "lease_owner": owner or None, "owner_state": owner_state,
                     "result": what})
    else:
        print(f"{cid}: owner {owner or '-'} ({owner_state}): {what}")
    return exits.OK


_SHOW_ORDER = ("connection_id", "desired_state", "ws_url", "lease_owner", "lease_expires_at_ms", "lease_epoch",
               "last_seq", "created_at_ms", "updated_at_ms", "last_error", "attempts")


def _show_names(item: dict[str, Any]) -> list[str]:
    """The SPEC §2 attributes in table order, then whatever else other clients wrote."""
    return [n for n in _SHOW_ORDER if n in item] + sorted(set(item) - set(_SHOW_ORDER))


def _show_text(item: dict[str, Any], now_ms: int) -> str:
    width = max(len(n) for n in item)
    lines = []
    for name in item:
        value = item[name]
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        note = _annotation(name, value, item, now_ms)
        lines.append(f"{name.ljust(width)}  {text}{f'  ({note})' if note else ''}")
    return "\n".join(lines)


def _annotation(name: str, value: Any, item: dict[str, Any], now_ms: int) -> str:
    """A human reading of lease expiries and timestamps ('' when there is nothing to add)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return ""
    if name == "lease_expires_at_ms":
        lease, left = _lease_view(str(item.get("lease_owner") or ""), value, now_ms)
        if left is None:
            return {"free": "free", "session": "held by session"}[lease]
        return f"in {left:.1f} s" if left >= 0 else f"expired {-left:.1f} s ago"
    if name.endswith("_at_ms") and 0 < value < HELD_BY_SESSION:
        return datetime.fromtimestamp(value / 1000, UTC).isoformat(timespec="milliseconds")
    return ""


def _plain_item(item: dict[str, Any]) -> dict[str, Any]:
    return {name: _plain(av) for name, av in item.items()}


def _plain(av: Any) -> Any:
    """A DynamoDB attribute value as plain JSON-able data (binary as base64)."""
    if not isinstance(av, dict) or len(av) != 1:
        return av
    kind, value = next(iter(av.items()))
    converters: dict[str, Callable[[Any], Any]] = {
        "S": str, "N": _number, "BOOL": bool, "NULL": lambda _: None, "B": _b64,
        "M": _plain_item, "L": lambda v: [_plain(x) for x in v],
        "SS": sorted, "NS": lambda v: sorted((_number(x) for x in v), key=float), "BS": lambda v: [_b64(x) for x in v],
    }
    return converters[kind](value) if kind in converters else av


def _number(text: str) -> int | float | str:
    try:
        value = int(text)
    except ValueError:
        return float(text)
    # Beyond 64 bits JSON readers lose precision (orjson refuses); keep DynamoDB's digits.
    return value if -(2**63) <= value < 2**63 else text


def _b64(raw: bytes | str) -> str:
    return base64.b64encode(raw if isinstance(raw, bytes) else raw.encode()).decode()


# ----- sessions ---------------------------------------------------------------------------------------


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _session_row(raw: dict[str, Any], now_ms: int) -> dict[str, Any]:
    item = _plain_item(raw)
    expires = _int(item.get("expires_at_ms"))
    return {"session_id": str(item.get("session_id", "")), "task_id": item.get("task_id"),
            "shard": item.get("shard"), "host": item.get("host"), "pid": item.get("pid"),
            "live": expires >= now_ms, "expires_in_s": round((expires - now_ms) / 1000, 3),
            "expires_at_ms": expires, "started_at_ms": item.get("started_at_ms"),
            "held": item.get("held"), "capacity": item.get("capacity"),
            "draining": bool(item.get("draining", False)), "items_owned": 0}


async def _sessions(ctx: _Ctx, args: argparse.Namespace) -> int:
    now = ctx.clock.now_ms()
    with _aws_errors("Scan", f"table {ctx.cfg.aws.sessions_table}"):
        raw = await ctx.store.list_sessions()
    rows = sorted((_session_row(r, now) for r in raw), key=lambda r: (not r["live"], r["session_id"]))
    counts = await _owned_counts(ctx, [r["session_id"] for r in rows])
    for row in rows:
        row["items_owned"] = counts[row["session_id"]]
    if ctx.as_json:
        _print_json(rows)
        return exits.OK
    print(_table(("SESSION", "TASK", "SHARD", "HOST", "PID", "EXPIRES", "HELD", "CAPACITY", "DRAINING", "ITEMS"),
                 [(r["session_id"], r["task_id"], r["shard"], r["host"], r["pid"],
                   f"{r['expires_in_s']:.1f}s" if r["live"] else "expired", r["held"], r["capacity"],
                   "yes" if r["draining"] else "no", r["items_owned"]) for r in rows]))
    return exits.OK


async def _owned_counts(ctx: _Ctx, session_ids: list[str]) -> dict[str, int]:
    """Connection items per session through ``by_owner`` (a dead session's are orphans)."""
    limit = asyncio.Semaphore(OWNER_QUERY_CONCURRENCY)
    table = ctx.cfg.aws.connections_table

    async def count(session_id: str) -> int:
        async with limit:
            with _aws_errors("Query by_owner", f"table {table}"):
                return len(await ctx.store.items_of(session_id))

    try:
        async with asyncio.TaskGroup() as tg:  # the first failure cancels the other queries
            tasks = {sid: tg.create_task(count(sid)) for sid in session_ids}
    except* CtlError as group:
        raise group.exceptions[0] from None
    return {sid: task.result() for sid, task in tasks.items()}


_HANDLERS: dict[str, Callable[[_Ctx, argparse.Namespace], Awaitable[int]]] = {
    "start": _start, "stop": _stop, "ls": _ls, "show": _show, "sessions": _sessions, "release": _release,
}
