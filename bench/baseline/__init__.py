"""The seed design fleetd is benchmarked against (issue #5): see :mod:`bench.baseline.worker`.

``python -m bench.baseline --help`` runs one worker process.
"""
