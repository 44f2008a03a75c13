"""Exit codes are a contract between shards, the supervisor and operators (STYLE.md item 3)."""

OK = 0
FAILURE = 1  # a runtime failure worth restarting, or `init --check` drift
USAGE = 2  # bad configuration or command-line input: fix the input, do not retry
BOOT_ERROR = 3  # a shard cannot boot (no credentials, missing tables): the supervisor halts
