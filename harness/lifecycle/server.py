"""Launch, health and teardown of the engine server on its host.

The server starts detached in its own session and process group (`setsid`), stdin from /dev/null,
output to server.log, its process-group id in server.pid and its exit code in server.exit: a
backgrounded command without redirects would hold the SSH channel open (fabric #1828), and without a
pty nothing is signalled when the channel closes, so we own the group and kill it ourselves.

A process can leave that group and session (setsid, as Ray's daemons and some launchers do), out of
reach of any signal to them. So the server also runs with a marker of its run in its environment,
`HARNESS_RUN_TOKEN`, which every process it starts inherits: the agent's stop, watchdog and reap end
the processes of the SSH user that carry it too (agent.py `marked`).
"""

from __future__ import annotations

import re
import shlex
import time
from secrets import token_hex

from harness.errors import Kind, RunFailed
from harness.facts import FACTS_WAIT_S
from harness.lifecycle.context import RunContext
from harness.remote.names import MARKER
from harness.results.answers import A, Stop, Wait
from harness.results.layout import RunFiles
from harness.secrets import api_key_env

HEALTH_POLL_S = 0.1   # the agent asks the engine's health URL this often while it starts (on the host itself)
PEER_CHECK_S = 5.0    # a server on several hosts: the other nodes are looked at this often while node 0 starts
OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|Cannot allocate memory", re.I)


def launch(ctx: RunContext) -> int:
    paths, q = ctx.paths, shlex.quote
    if ctx.rendered.secret_env:
        secrets = "".join(f"{k}={q(v)}\n" for k, v in ctx.rendered.secret_env.items())
        ctx.transport.put(secrets.encode(), paths.secrets_file, mode=0o600)
    root = q(paths.root)
    # The wrapper writes its own pid: after setsid it leads the session and the process group, whether
    # or not setsid had to fork to get there. The watchdog beside it stops that group when the lease
    # (touched by the orchestrator's heartbeat) lapses, so a dead orchestrator leaves no orphan.
    watch = ctx.agent_command("watch", "--pid-file", paths.pid_file, "--lease", paths.lease,
                              "--lease-s", ctx.lease_s)
    # the script comes on stdin: one round trip for writing it and starting it.
    # `--norc`: a bash started in the background of a command over SSH reads ~/.bashrc again (it sees
    # SSH_CLIENT and a shell level of 1), 0.2 s on a host whose ~/.bashrc sets up pyenv; the server
    # inherits the environment the login shell's ~/.bashrc made either way.
    # server.pid holds the wrapper's pid, start time and boot id (agent.py read_pid): a reused pid is
    # never taken for ours; then the run's marker, which the wrapper and all it starts carry in their
    # environment (agent.py read_marker, marked). Files are removed before they are written, so no
    # planted link is followed.
    f, token = RunFiles, token_hex(16)
    command = (f"cd {root} && rm -f {f.LAUNCH}.tmp && cat > {f.LAUNCH}.tmp && chmod 755 {f.LAUNCH}.tmp && "
               f"mv {f.LAUNCH}.tmp {f.LAUNCH} && rm -f {f.EXIT} {f.PID} {f.WATCHDOG_PID} {f.LEASE} && : > {f.LEASE} && "
               f"{{ {MARKER}={q(token)} setsid bash --norc -c 'read -r s </proc/$$/stat; set -- ${{s##*) }}; "
               f"echo \"$$ ${{20}} $(cat /proc/sys/kernel/random/boot_id) ${MARKER}\" >{f.PID}; "
               f"bash {f.LAUNCH} >{f.SERVER_LOG} 2>&1 </dev/null; "
               f"echo $? >{f.EXIT}' >/dev/null 2>&1 </dev/null & }} && "
               f"{{ setsid {watch} >{f.WATCHDOG_LOG} 2>&1 </dev/null & }} && "
               f"for _ in $(seq 500); do [ -s {f.PID} ] && break; sleep 0.01; done; cat {f.PID}")
    started = ctx.sh(command, timeout=60, stdin=ctx.rendered.script.encode())
    out, ctx.found.server_step = started.stdout, started.step
    lines = out.strip().splitlines()
    words = lines[-1].split() if lines else []
    if len(words) != 4 or not words[0].isdigit() or words[3] != token:
        raise ctx.fail(Kind.LAUNCH, f"the launch wrapper on {ctx.host.name} wrote no server pid within 5 s "
                       f"(is {paths.root} writable, and bash and setsid there?)", output=out[-2000:])
    pid = int(words[0])
    ctx.found.server_pid = pid
    return pid


def key_words(ctx: RunContext) -> list[str]:
    """`--api-key-env NAME` for the host's clients (agent.py, bench.py) when the server asks for a key."""
    name = api_key_env(ctx.rendered.args, ctx.rendered.secret_env)
    return ["--api-key-env", name] if name else []


def with_key(ctx: RunContext, command: str) -> str:
    """`command` with the run's secrets in its environment, read from their 0600 file on the host,
    when the server asks for an API key: the key is never on a command line, in a log or an error."""
    if not key_words(ctx):
        return command
    return f"set -a && . {shlex.quote(ctx.paths.secrets_file)} && set +a && {command}"


def agent_with_key(ctx: RunContext, model: type[A], *args: str | int | float, timeout: float, then: str = "") -> A:
    """One agent subcommand that talks to the server, sending its API key if it asks for one; `then`:
    shell run after it in the same command, printing nothing."""
    command = with_key(ctx, ctx.agent_command(*args, *key_words(ctx)))
    if then:
        command = f"( {command} ); {then}"
    return ctx.parse_agent(model, str(args[0]), ctx.sh(command, timeout=timeout, check=False))


def _wait(ctx: RunContext, health: str, timeout: float, *, with_facts: bool = True) -> Wait:
    """The agent's wait for the server's health; with `with_facts`, the same command ends with the host's
    facts in the run's folder (harness.facts: collected while the server starts), so the benchmark
    never shares the host with their collection."""
    paths = ctx.paths
    return agent_with_key(ctx, Wait, "wait", "--url", health, "--pid-file", paths.pid_file, "--exit-file",
                          paths.exit_file, "--log", paths.log, "--timeout", timeout, "--interval", HEALTH_POLL_S,
                          timeout=timeout + 120 + (FACTS_WAIT_S if with_facts else 0),
                          then=ctx.take_facts() if with_facts else "")


def _wait_nodes(ctx: RunContext, health: str, timeout: float) -> Wait:
    """Node 0's health, asked in slices of PEER_CHECK_S with a look at every other node between them:
    node 0 is not up before every node joined, so a node that died starting would otherwise cost the
    whole startup timeout. A node that died first fails the run, named (kind launch)."""
    start = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - start)
        answer = _wait(ctx, health, max(0.1, min(PEER_CHECK_S, left)), with_facts=False)
        if answer.status == "healthy":
            ctx.copy_facts()   # before the benchmark, as `_wait`
            return answer.model_copy(update={"seconds": time.monotonic() - start})
        died = dead_node(ctx, "startup", kind=Kind.LAUNCH, peers_only=answer.status != "died")
        if died is not None and (answer.status != "died" or died.host != ctx.host.name):
            raise died
        if answer.status == "died" or time.monotonic() - start >= timeout:
            return answer.model_copy(update={"seconds": time.monotonic() - start})


def wait_healthy(ctx: RunContext) -> float:
    """Seconds until healthy; fails fast (kind oom/launch) when the server exits while loading (on any
    node, for a server on several hosts: health is node 0's, which waits for the others)."""
    pb = ctx.sweep.playbook
    timeout = pb.server.startup_timeout_s
    health = ctx.base_url + (pb.server.health_path or ctx.sweep.engine.health_path)
    answer = _wait_nodes(ctx, health, timeout) if ctx.peers else _wait(ctx, health, timeout)
    paths = ctx.paths
    if answer.status == "healthy":
        return answer.seconds
    log = answer.log_tail
    ctx.found.log_tail = log
    if answer.status == "died":
        code = answer.exit_code
        if OOM.search(log) or (ctx.sweep.engine.oom_log and re.search(ctx.sweep.engine.oom_log, log)):
            raise ctx.fail(Kind.OOM, f"the server ran out of memory while starting (exit {code}): "
                           f"{ctx.sweep.engine.oom_hint}", output=log)
        said = answer.error_line
        raise ctx.fail(Kind.LAUNCH, f"the server exited during startup (exit {code}) after "
                       f"{answer.seconds:.0f} s" + (f": {said}" if said else "")
                       + f" (the log's end below; all of it in {paths.log} on the host, server.log in the run)",
                       output=log)
    raise ctx.fail(Kind.STARTUP_TIMEOUT, f"not healthy after {timeout:g} s (last answer from {health}: "
                   f"{answer.last_answer or 'none'})", output=log)


def alive_check(ctx: RunContext) -> str:
    """Shell that prints `alive` while the launch wrapper runs (no exit code written, not a zombie:
    some inits never reap), else `gone`."""
    return (f"( cd {shlex.quote(ctx.paths.root)} && read -r pid _ < {RunFiles.PID} && [ ! -e {RunFiles.EXIT} ] && "
            "kill -0 \"$pid\" 2>/dev/null && ! grep -q ') Z' \"/proc/$pid/stat\" ) && echo alive || echo gone")


def server_alive(ctx: RunContext) -> bool:
    return "alive" in ctx.sh(alive_check(ctx), timeout=30, check=False).stdout.split()[-1:]


def dead_node(ctx: RunContext, during: str, *, kind: Kind = Kind.SERVER_DIED, peers_only: bool = False
              ) -> RunFailed | None:
    """The failure of a server on several hosts when any node's server is gone, naming the node that
    went first (by the time its wrapper wrote its exit code; a wrapper killed outright wrote none and
    counts as first), with the nodes that followed; None while every node runs. One look per node."""
    gone: list[tuple[float, RunContext, str]] = []
    q = shlex.quote
    for node in ctx.peers if peers_only else ctx.nodes:
        said = node.sh(f"{alive_check(node)}; date -r {q(node.paths.exit_file)} +%s.%N 2>/dev/null; "
                       f"echo; tail -n 40 {q(node.paths.log)} 2>/dev/null | tail -c 8000", timeout=30,
                       check=False).stdout.split("\n")
        if said[0].strip() != "gone":
            continue
        try:
            when = float(said[1])
        except (IndexError, ValueError):
            when = float("-inf")
        gone.append((when, node, "\n".join(said[2:]).strip()))
    if not gone:
        return None
    gone.sort(key=lambda g: (g[0], g[1].node_rank))
    _, first, log = gone[0]
    followed = [g[1].label for g in gone[1:]]
    first.found.log_tail = log
    message = f"the server on {first.label} died during the {during}"
    if followed:
        message += f" ({', '.join(followed)} went down after it)"
    if first.node_rank:
        message += f"; its log: {RunFiles.NODES}/{first.layout.dir.name}/{RunFiles.SERVER_LOG} in the run"
    return first.fail(kind, message, output=log)


def stop_command(ctx: RunContext) -> str:
    """Kill the server's process group, wait for the port to close, remove the secrets file."""
    # nsys writes its report after the server gets SIGTERM: give it time before SIGKILL
    grace = 240 if ctx.sweep.playbook.profile.mode == "nsys" else 30
    devices = ctx.found.probe.gpus.devices if ctx.found.probe is not None else []
    baseline = ",".join("" if d.memory_used_mib is None else str(d.memory_used_mib) for d in devices)
    return (ctx.agent_command("stop", "--pid-file", ctx.paths.pid_file, "--port", ctx.rendered.port,
                              "--bind", ctx.server_address, "--timeout", grace, "--gpu-baseline", baseline)
            + f"; rm -f {shlex.quote(ctx.paths.secrets_file)}")


def teardown(ctx: RunContext) -> Stop:
    """Stop the server; the host's facts are copied into the run's folder on the way, for a run that
    failed before its health check did (on every node of a server on several hosts)."""
    command = f"{stop_command(ctx)}; {ctx.take_facts()}"
    answer = ctx.parse_agent(Stop, "stop", ctx.sh(command, timeout=600 + FACTS_WAIT_S, check=False))
    if answer.escaped:
        ctx.found.warnings.append(
            f"{answer.escaped} server process(es) on {ctx.host.name} had left the server's session (setsid), "
            f"found by the run's marker ({MARKER} in their environment): "
            + (f"{answer.escaped_alive} still running" if answer.escaped_alive else "stopped"))
    if answer.group_alive:
        ctx.found.warnings.append(
            f"server processes still run on {ctx.host.name} after teardown: end the process group "
            f"{answer.pid} and the processes with {MARKER} from {ctx.paths.pid_file} in their environment "
            "by hand, or the next run there finds its port or GPUs taken")
    if not answer.port_closed:
        holders = [h.record() for h in answer.port_holders]
        ctx.found.warnings.append(f"port {ctx.rendered.port} still open after teardown: {holders}")
    if answer.gpu_released is False:
        ctx.found.warnings.append(
            f"GPU memory not released after teardown: {answer.gpu_memory_used_mib} MiB in use, "
            f"{answer.gpu_memory_before_mib} before the launch")
    return answer

