"""A server process that leaves its session (setsid, as Ray's daemons do) over real SSH: stopped at the
run's teardown, with a warning in the manifest, and by the watchdog once a killed orchestrator's lease
lapses. Before, it outlived both, holding whatever it held (a port, the GPUs) for the next run."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from tests.conftest import harness
from tests.e2e.test_faults import listening, port_of, start_sweep, wait_until
from tests.e2e.test_sweep import manifests, playbook
from tests.unit.test_agent_processes import live

# Double-forks, the middle process calling setsid: the grandchild is in neither the launch wrapper's
# process group nor its session. It ignores SIGTERM and names itself by a file in the folder given.
ESCAPER = """
import os, signal, sys, time
if os.fork():
    os.wait()
    sys.exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
while True:
    time.sleep(1)
"""


def escaping(tmp_path: Path) -> tuple[Path, Path]:
    """A launch template that starts the escaper before the engine's own script, and the folder where
    each escaper leaves its pid."""
    folder = tmp_path / "escaped"
    folder.mkdir()
    helper = tmp_path / "escaper.py"
    helper.write_text(ESCAPER)
    template = tmp_path / "escaping.sh.j2"
    template.write_text(shlex.join([sys.executable, str(helper), str(folder)]) + "\n"
                        '{% include "sglang.sh.j2" %}\n')
    return template, folder


def escaped(folder: Path) -> list[int]:
    return [int(p.name) for p in folder.iterdir()]


def kill_escaped(folder: Path) -> None:
    """What a failed test left behind."""
    for pid in escaped(folder):
        if live(pid) and b"escaper.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


def test_teardown_stops_a_server_process_that_left_its_session(tmp_path, ssh_inventory):
    template, folder = escaping(tmp_path)
    pb = playbook(tmp_path, profile="none", configs=[{"name": "one"}], template=str(template))
    try:
        run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
        assert run.returncode == 0, run.stdout + run.stderr
        assert len(escaped(folder)) == 1
        assert wait_until(lambda: not any(live(p) for p in escaped(folder)), 60), "it outlived the teardown"
        warnings = manifests(tmp_path / "r")["one-1"]["warnings"]
        assert any("1 server process(es) on node1 had left the server's session" in w for w in warnings), warnings
    finally:
        kill_escaped(folder)


def test_the_watchdog_stops_a_server_process_that_left_its_session(tmp_path, ssh_inventory):
    """The orchestrator SIGKILLed while the server runs: once the lease lapses, the watchdog ends the
    server and what left its session."""
    template, folder = escaping(tmp_path)
    pb = playbook(tmp_path, profile="none", template=str(template),
                  configs=[{"name": "slow", "env": {"HARNESS_SIM_TIME_SCALE": "1"}}])
    out = tmp_path / "r"
    proc = start_sweep(pb, ssh_inventory(), out, "--lease", "4")
    try:
        assert wait_until(lambda: escaped(folder) and listening(port_of(pb)), 120), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: not any(live(p) for p in escaped(folder)), 120), "it outlived the lease"
        assert wait_until(lambda: not listening(port_of(pb)), 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_escaped(folder)
