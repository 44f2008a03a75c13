"""Fault injection for tests: an HTTP fault proxy in front of the local AWS servers."""
