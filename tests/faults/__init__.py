"""The fault-injection suite (issue #7): scenarios run against real fleetd processes.

Each scenario runs a few randomized trials in CI and ≥ 20 with ``pytest --long``;
every trial is judged by :mod:`bench.audit` and recorded with :func:`record`.
"""
