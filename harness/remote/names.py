"""The names inside a run folder, which the harness and its tools on the host both use: a run folder
has the same names on the host and, once pulled, in the results (harness/results/layout.py builds
every path from these). Standard library only: it ships in the tools' zipapp.
"""


MARKER = "HARNESS_RUN_TOKEN"
"""The variable the launch wrapper puts in the server's environment, set to a value of that run alone
(the fourth word of server.pid): every process of the server inherits it, whatever session it moves to."""


class RunFiles:
    """The names inside a run folder."""
    LAUNCH = "launch.sh"
    SERVER_LOG = "server.log"
    PID = "server.pid"                # the server's wrapper: pid, start time, boot id, the run's MARKER value
    EXIT = "server.exit"              # its exit code, once it exited
    WATCHDOG_PID = "watchdog.pid"
    WATCHDOG_LOG = "watchdog.log"
    LEASE = "lease"
    SECRETS = ".secrets.env"          # mode 0600 on the host: never pulled, removed at every teardown
    PROFILE = "profile"
    FACTS = "facts"
    BENCH = "bench.json"
    REQUESTS = "requests.jsonl"       # beside bench.json (the benchmark client writes both)
    TELEMETRY = "telemetry.jsonl"     # the server's /metrics and the GPUs, sampled around the benchmark
    BENCH_PROGRESS = "bench.progress.json"
    PROMPT = "prompt.txt"
    MANIFEST = "manifest.json"
    ANALYSIS = "analysis.json"
    HARNESS_ERROR = "harness-error.log"
    NODES = "nodes"                   # a server on several hosts: nodes/node<k>/, the run folder of node k >= 1
