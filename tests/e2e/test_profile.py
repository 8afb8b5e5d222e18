"""Profile capture beyond the engine's own profiler: nsys mode, and its absence named in preflight.

Nsight Systems cannot run on a machine without a GPU, so the nsys case uses a stand-in `nsys` on the
host's PATH that behaves as nsys does at the process level: it runs the command, and writes its
report into `-o OUT` when it is told to stop.
"""

from __future__ import annotations

import stat

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook, sweep_dir
from tests.remote_venv import make_remote_venv

FAKE_NSYS = """#!/bin/bash
# nsys profile [options] -o OUT CMD...: run CMD; on SIGTERM stop it and write OUT.nsys-rep
shift
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift 2;; --*) shift;; *) break;; esac
done
"$@" &
child=$!
trap 'kill -TERM $child; wait $child; echo "nsys report" > "$out.nsys-rep"; exit 0' TERM
wait $child
"""


def test_nsys_mode_without_nsys_is_a_preflight_failure_that_says_so(tmp_path, ssh_inventory):
    run = harness("sweep", playbook(tmp_path, configs=[{"name": "n"}], profile="nsys"), "-i", ssh_inventory(),
                  "-o", tmp_path / "r")
    assert run.returncode == 1
    err = manifests(tmp_path / "r")["n-1"]["error"]
    assert err["kind"] == "preflight" and "nsys is not on the PATH" in err["message"]


def test_nsys_mode_wraps_the_launch_and_collects_the_report_written_at_exit(tmp_path, ssh_inventory):
    venv = make_remote_venv(tmp_path / "venv-nsys")
    nsys = venv / "bin" / "nsys"
    nsys.write_text(FAKE_NSYS)
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    run = harness("sweep", playbook(tmp_path, configs=[{"name": "n"}], profile="nsys"), "-i",
                  ssh_inventory(venv=str(venv)), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    m = manifests(tmp_path / "r")["n-1"]
    assert m["profile"]["status"] == "ok" and m["profile"]["files"][0]["name"] == "n-1.nsys-rep"
    launch = (sweep_dir(tmp_path / "r") / "runs" / "n-1" / "launch.sh").read_text()
    assert "exec nsys profile" in launch and "--capture-range=cudaProfilerApi" in launch
    start = m["profile"]["answers"][0]["request"]
    assert start["activities"] == ["CUDA_PROFILER"] and start["num_steps"] == 3
