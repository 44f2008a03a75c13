"""One shard: one process, one uvloop event loop, up to ``max_connections_per_shard`` streams.

A shard is a set of components, each the one owner of its state (docs/architecture.md has the
table and who calls whom): the session keeper, the holdings (the only writer of what is held),
the claimer, the reconciler, the rebalancer, the inbox (hints), desired state, checkpoints, item
leases (item mode) and the orphan sweep, assembled and run by ``runtime.Shard``.

Safety rule (SPEC §3): a stream is fenced — socket dropped, nothing more written — before anyone
else may claim it: at ``renewal sent + TTL − margin`` on the monotonic clock if no renewal has
succeeded since.
"""

from fleetd.shard.boot import BootError
from fleetd.shard.runtime import Environment, Shard, main

__all__ = ["BootError", "Environment", "Shard", "main"]
