"""The connection item ``fleetd ctl start`` writes (SPEC §2, §7), in one place.

``ctl start``, ``fleetd dev`` and the benchmarks' seeding all write it through this
module, so the three cannot drift apart.  Rules the item obeys:

* ``lease_expires_at_ms`` exists (0 = free): ``by_state_expiry`` is sparse, and an
  item without its range key is invisible to every shard.
* A new item carries **no** ``last_seq``.  ``last_seq`` is the highest seq durably
  written; an item that never wrote anything has none, so its first connect sends
  no ``from_seq`` and the upstream's first frame is accepted whether its numbering
  starts at 0, 1 or anywhere else (SPEC §5).  A ``last_seq = 0`` here would resume
  at ``from_seq=1`` and lose seq 0.
* Starting an existing item keeps its owner, epoch and ``last_seq``.
"""

from __future__ import annotations

from typing import Any

from fleetd.lease import STARTED

START_EXPRESSION = (
    "SET desired_state = :started, ws_url = :url, updated_at_ms = :now, "
    "created_at_ms = if_not_exists(created_at_ms, :now), "
    "lease_expires_at_ms = if_not_exists(lease_expires_at_ms, :zero), "
    "lease_epoch = if_not_exists(lease_epoch, :zero)"
)
"""Upsert as STARTED: new attributes for a new item, only state, URL and time for an existing one."""


def start_update(table: str, connection_id: str, url: str, now_ms: int) -> dict[str, Any]:
    """UpdateItem arguments that start ``connection_id`` on ``url`` (creating the item if new)."""
    return {
        "TableName": table,
        "Key": {"connection_id": {"S": connection_id}},
        "UpdateExpression": START_EXPRESSION,
        "ExpressionAttributeValues": {":started": {"S": STARTED}, ":url": {"S": url},
                                      ":now": {"N": str(now_ms)}, ":zero": {"N": "0"}},
    }


def new_item(connection_id: str, url: str, now_ms: int) -> dict[str, Any]:
    """The whole item :func:`start_update` creates for a new id (for a PutItem or BatchWriteItem)."""
    now = {"N": str(now_ms)}
    return {"connection_id": {"S": connection_id}, "desired_state": {"S": STARTED}, "ws_url": {"S": url},
            "lease_expires_at_ms": {"N": "0"}, "lease_epoch": {"N": "0"},
            "created_at_ms": now, "updated_at_ms": now}
