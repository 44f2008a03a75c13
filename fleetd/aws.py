"""AWS client construction: one aiobotocore session per process, explicit timeouts.

Endpoints are never configured here: the SDK reads ``AWS_ENDPOINT_URL_DYNAMODB``,
``AWS_ENDPOINT_URL_SQS`` and ``AWS_ENDPOINT_URL_CLOUDWATCH`` itself, so fleetd does
not know whether it talks to AWS or to a local stack.
"""

from __future__ import annotations

import enum
import os
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session

from fleetd.config import AwsConfig


def region_of(cfg: AwsConfig) -> str:
    return cfg.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def client_config(cfg: AwsConfig, *, read_timeout_s: float | None = None, attempts: int | None = None,
                  validate: bool = True) -> AioConfig:
    # botocore's "max_attempts" counts retries; "total_max_attempts" counts attempts.
    return AioConfig(
        connect_timeout=cfg.aws_timeout_s,
        read_timeout=read_timeout_s or cfg.aws_timeout_s,
        max_pool_connections=cfg.aws_max_pool,
        retries={"mode": "standard", "total_max_attempts": attempts or cfg.aws_max_attempts},
        parameter_validation=validate,
    )


@dataclass(slots=True)
class Clients:
    """The AWS clients of one process (entered into an AsyncExitStack by :func:`open_clients`)."""

    dynamodb: Any
    sqs: Any
    cloudwatch: Any
    sink_dynamodb: Any  # no SDK retries: the sink retries itself and re-checks fencing before each try
    renew_dynamodb: Any  # no SDK retries: the heartbeat is the renewal's retry policy (fresh values, no backoff)


async def open_clients(stack: AsyncExitStack, cfg: AwsConfig, session: AioSession | None = None) -> Clients:
    """Create the DynamoDB, SQS and CloudWatch clients; they close when ``stack`` closes."""
    session = session or get_session()
    region = region_of(cfg)
    ddb = await stack.enter_async_context(
        session.create_client("dynamodb", region_name=region, config=client_config(cfg))
    )
    # The SQS read timeout must exceed the long-poll wait or every poll times out.
    sqs = await stack.enter_async_context(
        session.create_client(
            "sqs", region_name=region, config=client_config(cfg, read_timeout_s=cfg.hint_wait_s + 10.0)
        )
    )
    cw = await stack.enter_async_context(
        session.create_client("cloudwatch", region_name=region, config=client_config(cfg))
    )
    # Parameter validation costs ~30 % of the client CPU per message; the sink builds valid requests.
    sink = await stack.enter_async_context(
        session.create_client("dynamodb", region_name=region,
                              config=client_config(cfg, attempts=1, validate=False))
    )
    renew = await stack.enter_async_context(
        session.create_client("dynamodb", region_name=region, config=client_config(cfg, attempts=1))
    )
    return Clients(ddb, sqs, cw, sink, renew)


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ClientError, '' otherwise."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


# ----- what an AWS call's failure means -------------------------------------------------------------


class Outcome(enum.Enum):
    WON = "won"
    LOST = "lost"
    RETRYABLE = "retryable"
    FATAL = "fatal"


_LOST_CODES = frozenset({"ConditionalCheckFailedException"})
_FATAL_CODES = frozenset({
    "ResourceNotFoundException", "AccessDeniedException", "UnrecognizedClientException",
    "InvalidSignatureException", "ValidationException", "ExpiredTokenException",
    "MissingAuthenticationTokenException", "SerializationException", "IncompleteSignatureException",
})


def classify(exc: BaseException) -> Outcome:
    """Map an exception from an AWS call to what the caller should do."""
    code = error_code(exc)
    if code in _LOST_CODES:
        return Outcome.LOST
    if code in _FATAL_CODES:
        return Outcome.FATAL
    # Throttling, 5xx, timeouts, connection errors and anything unknown: try again.
    return Outcome.RETRYABLE


MISSING_CODES = frozenset({"ResourceNotFoundException", "AWS.SimpleQueueService.NonExistentQueue",
                           "QueueDoesNotExist"})


def missing(exc: BaseException) -> bool:
    """The table or queue named in the call does not exist (wrong name, or `fleetd init` not run)."""
    code = error_code(exc)
    return code in MISSING_CODES or "NonExistentQueue" in code
