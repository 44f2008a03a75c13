"""Deterministic simulation of fleetd: its own shard code on virtual time against simulated AWS and upstreams.

``python -m bench.sim --seeds N --out FILE`` (see ``bench/sim/__main__.py``).  Modules:
``vloop`` (virtual-time event loops and the scheduler), ``net`` (network faults and SDK
clients), ``services`` (SQS, CloudWatch, the DynamoDB wrapper), ``dynamo`` (DynamoDB's
expression semantics), ``feeds`` (upstreams and picows-like sockets), ``world`` (one
seeded run: tasks, shards, supervisors, ctl, lifecycle events), ``invariants``,
``scenarios`` (scripted schedules) and ``runner`` (many seeds, in parallel).
"""
