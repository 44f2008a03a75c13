"""A shard's share of a backlog (free items, a dead session's items) among the live sessions.

Rule: shards that find the same backlog at the same time split it without talking: each estimates
its share as the backlog ÷ the live sessions it sees, claims up to that in one burst, and tries the
items of its own partition first — the items whose CRC32 modulo the number of sessions is its rank
among their sorted ids — so that the bursts of shards that see the same sessions hardly collide.
What a burst leaves (a peer that was full, slow or not yet listed) is claimed in later steps.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence


def fair_share(backlog: int, sessions: Sequence[str], me: str) -> int:
    """The backlog ÷ the live sessions (us included, listed or not), rounded up."""
    return math.ceil(backlog / len(set(sessions) | {me}))


def mine_first(ids: Sequence[str], sessions: Sequence[str], me: str) -> list[str]:
    """``ids`` with our partition first (each part keeps its order)."""
    ranked = sorted(set(sessions) | {me})
    n, rank = len(ranked), ranked.index(me)
    mine: list[str] = []
    rest: list[str] = []
    for cid in ids:
        (mine if zlib.crc32(cid.encode()) % n == rank else rest).append(cid)
    return mine + rest
