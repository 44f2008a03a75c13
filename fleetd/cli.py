"""The ``fleetd`` command: ``init``, ``ctl``, ``shard``, ``run`` and ``dev``.

Every sub-command builds its :class:`~fleetd.config.Config` here, in one place; a
bad setting or argument prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import NoReturn

from botocore.exceptions import BotoCoreError, ClientError

from fleetd import config, exits
from fleetd.aws import Clients


class UsageError(Exception):
    """Bad command-line input (exit 2, one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints usage plus the message; we keep the one-line contract.
        raise UsageError(f"{self.prog.removeprefix('fleetd ') if self.prog != 'fleetd' else 'fleetd'}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fleetd", description="Long-lived WebSocket streams leased through DynamoDB.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    init = sub.add_parser("init", help="create the tables, indexes, TTL and queue (idempotent)")
    init.add_argument("--check", action="store_true", help="only compare the deployment with the schema")
    config.add_flags(init)

    from fleetd import ctl

    ctl.add_parser(sub)
    _add_runtime_parsers(sub)
    return p


def _add_runtime_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    shard = sub.add_parser("shard", help="run one shard in the foreground (tests, debugging)")
    shard.add_argument("--index", type=int, default=0, help="shard number within the task")
    config.add_flags(shard)
    run = sub.add_parser("run", help="run the supervisor and its shards (what an ECS task runs)")
    config.add_flags(run)
    dev = sub.add_parser("dev", help="demo fleet on a local stack")
    dev.add_argument("--connections", type=int, default=200, help="demo connections to start")
    dev.add_argument("--rate", type=float, default=1.0, help="messages per second per demo stream")
    dev.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = Ctrl-C)")
    dev.add_argument("--plain", action="store_true", help="print status lines instead of a refreshing view")
    config.add_flags(dev)


def load_config(args: argparse.Namespace) -> config.Config:
    return config.load(config.flags_from_namespace(args), config_file=getattr(args, "config", None))


async def _init(cfg: config.Config, check_only: bool) -> int:
    from fleetd.aws import open_clients

    try:
        async with AsyncExitStack() as stack:
            clients = await open_clients(stack, cfg.aws)
            return await _init_with(clients, cfg, check_only)
    except (BotoCoreError, ClientError) as e:
        print(f"fleetd: error: init failed: {e}", file=sys.stderr)
        return exits.FAILURE


async def _init_with(clients: Clients, cfg: config.Config, check_only: bool) -> int:
    from fleetd import schema

    if not check_only:
        for line in await schema.init(clients.dynamodb, clients.sqs, cfg.aws):
            print(line)
        return exits.OK
    problems = await schema.check(clients.dynamodb, clients.sqs, cfg.aws)
    for line in problems:
        print(line)
    if not problems:
        print("schema OK")
    return exits.FAILURE if problems else exits.OK


def _dispatch(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    handlers: dict[str, Callable[[], int]] = {
        "init": lambda: asyncio.run(_init(cfg, args.check)),
        "ctl": lambda: _ctl(args, cfg),
        "shard": lambda: _shard(args, cfg),
        "run": lambda: _run(cfg),
        "dev": lambda: _dev(args, cfg),
    }
    return handlers[args.command]()


def _ctl(args: argparse.Namespace, cfg: config.Config) -> int:
    from fleetd import ctl

    return ctl.run(args, cfg)


def _shard(args: argparse.Namespace, cfg: config.Config) -> int:
    from fleetd import shard

    return shard.main(cfg, args.index)


def _run(cfg: config.Config) -> int:
    from fleetd import supervisor

    return supervisor.main(cfg)


def _dev(args: argparse.Namespace, cfg: config.Config) -> int:
    from fleetd import dev

    return dev.main(args, cfg)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = _parser().parse_args(argv)
        code = _dispatch(args)
    except (UsageError, config.ConfigError) as e:
        print(f"fleetd: error: {e}", file=sys.stderr)
        code = exits.USAGE
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
