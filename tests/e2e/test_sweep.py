"""Whole sweeps through a real sshd into a "remote" venv whose engines are the simulator.

These run the real `harness` command line: launch scripts rendered from the shipped templates, the
engine's real launch command, real HTTP, the real profiler protocol, real files pulled back.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import harness
from tests.remote_venv import make_remote_venv, plant_distribution

FAST = {"HARNESS_SIM_TIME_SCALE": "0.02", "HARNESS_SIM_STARTUP_S": "0.5"}


def playbook(tmp_path: Path, *, engine="sglang", configs=None, profile="engine", hosts="node1", **extra) -> Path:
    pb = {
        "name": f"e2e-{engine}", "hosts": hosts, "engine": engine,
        "model": {"path": "/models/tiny", "served_name": "tiny"},
        "server": {"port": _free_port(), "env": dict(FAST), "startup_timeout_s": 60},
        "configs": configs or [{"name": "tp2", "args": {"tp-size" if engine != "vllm" else "tensor-parallel-size": 2}},
                               {"name": "tp1"}],
        "benchmark": {"prompt": "hello there", "max_tokens": 12, "concurrency": [1, 4], "requests": 4,
                      "warmup": 1, "timeout_s": 60},
        "profile": {"mode": profile, "num_steps": 3, "timeout_s": 60},
        **extra,
    }
    path = tmp_path / "playbook.yaml"
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep_dir(results: Path) -> Path:
    (only,) = [p for p in results.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return only


def manifests(results: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir(results).glob("runs/*/manifest.json")}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_sweep_over_ssh_measures_profiles_and_compares_every_configuration(tmp_path, ssh_inventory, engine):
    results = tmp_path / "results"
    run = harness("sweep", playbook(tmp_path, engine=engine), "-i", ssh_inventory(), "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    root = sweep_dir(results)
    for name in ("sweep.json", "journal.jsonl", "summary.json", "summary.csv"):
        assert (root / name).is_file(), name
    runs = manifests(results)
    assert sorted(runs) == ["tp1-1", "tp2-1"]
    for run_id, m in runs.items():
        d = root / "runs" / run_id
        assert m["schema"] == "harness.run/1" and m["status"] == "ok", m.get("error")
        assert set(m["phases"]) >= {"preflight", "launch", "health", "bench", "profile", "collect", "teardown"}
        assert m["host"]["name"] == "node1" and m["engine"] == engine
        bench = json.loads((d / "bench.json").read_text())
        assert [lv["concurrency"] for lv in bench["levels"]] == [1, 4]
        assert all(lv["completed"] == 4 and lv["failed"] == 0 for lv in bench["levels"])
        assert len((d / "requests.jsonl").read_text().splitlines()) == 8
        assert "source " in (d / "launch.sh").read_text() and (d / "server.log").stat().st_size > 0
        ranks = 2 if run_id.startswith("tp2") else 1
        assert m["profile"]["status"] == "ok", m["profile"]
        assert len(m["profile"]["files"]) == ranks
        assert len([p for p in (d / "profile").iterdir() if ".trace.json" in p.name]) == ranks
        analysis = json.loads((d / "analysis.json").read_text())
        assert analysis["schema"] == "harness.analysis/1" and analysis["top"]
        assert m["collected"]["files"] > 0 and (d / "facts" / "python.txt").exists()
        assert not (d / ".secrets.env").exists()
    states = [json.loads(line)["state"] for line in (root / "journal.jsonl").read_text().splitlines()]
    assert states.count("ok") == 2
    assert "tp1" in run.stdout and "tp2" in run.stdout

    compared = harness("compare", root, "--format", "json")
    assert compared.returncode == 0, compared.stderr
    rows = json.loads(compared.stdout)
    assert {(r["config"], r["concurrency"]) for r in rows} == {("tp2", 1), ("tp2", 4), ("tp1", 1), ("tp1", 4)}
    assert all(r["itl_ms_p50"] > 0 and r["output_tok_s"] > 0 for r in rows)


def test_no_server_is_left_running_after_a_sweep(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, configs=[{"name": "one"}], profile="none")
    port = yaml.safe_load(pb.read_text())["server"]["port"]
    assert harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r").returncode == 0
    import socket
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_bad_input_exits_2_naming_the_file_and_key_before_any_host_is_touched(tmp_path, ssh_inventory):
    inv = ssh_inventory()
    pb = playbook(tmp_path)
    pb.write_text(pb.read_text().replace("max_tokens: 12", "max_tokens: lots"))
    run = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r")
    assert run.returncode == 2
    assert str(pb) in run.stderr and "benchmark.max_tokens" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "remote-work").exists() and not (tmp_path / "r").exists()


def test_a_host_with_a_changed_key_is_refused_and_never_retried(tmp_path, ssh_inventory, sshd):
    other = tmp_path / "known_hosts"
    other.write_text(f"[{sshd.address}]:{sshd.port} ssh-ed25519 "
                     "AAAAC3NzaC1lZDI1NTE5AAAAIOcWSk6oNYUqWjFmHqLYsaEJ3Go9qAyWxLOLTnzLdOGn\n")
    run = harness("sweep", playbook(tmp_path), "-i", ssh_inventory(known_hosts=str(other)), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")
    assert {x["error"]["kind"] for x in m.values()} == {"host_key"}
    assert "changed" in next(iter(m.values()))["error"]["message"].lower()
    assert not (tmp_path / "remote-work").exists()


def test_an_unknown_host_key_is_refused_with_the_command_that_pins_it(tmp_path, ssh_inventory):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    run = harness("sweep", playbook(tmp_path), "-i", ssh_inventory(known_hosts=str(empty)), "-o", tmp_path / "r")
    assert run.returncode == 1
    message = next(iter(manifests(tmp_path / "r").values()))["error"]["message"]
    assert "ssh-keyscan" in message and str(empty) in message


def test_a_missing_venv_is_a_preflight_failure_that_says_so(tmp_path, ssh_inventory):
    run = harness("sweep", playbook(tmp_path, configs=[{"name": "one"}]), "-i",
                  ssh_inventory(venv=str(tmp_path / "no-such-venv")), "-o", tmp_path / "r")
    assert run.returncode == 1
    err = manifests(tmp_path / "r")["one-1"]["error"]
    assert err["kind"] == "preflight" and "no-such-venv" in err["message"] and "does not exist" in err["message"]


def test_an_engine_missing_from_the_venv_is_named_with_host_and_venv(tmp_path, ssh_inventory):
    venv = make_remote_venv(tmp_path / "sglang-only", engines=("sglang",))
    run = harness("sweep", playbook(tmp_path, engine="vllm", configs=[{"name": "one"}]), "-i",
                  ssh_inventory(venv=str(venv)), "-o", tmp_path / "r")
    assert run.returncode == 1
    err = manifests(tmp_path / "r")["one-1"]["error"]
    assert err["kind"] == "preflight"
    assert "cannot import 'vllm'" in err["message"] and str(venv) in err["message"] and "node1" in err["message"]


def test_a_flag_the_installed_engine_dropped_fails_in_preflight(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, configs=[{"name": "old", "args": {"enable-piecewise-cuda-graph": True}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")["old-1"]
    assert m["error"]["kind"] == "preflight" and "--enable-piecewise-cuda-graph" in m["error"]["message"]
    # what the host has (the engine's version first) is brought back with the failure
    assert m["facts"]["engine_version"] == "0.5.23" and m["facts"]["python"], m["facts"]


def test_the_flag_listing_runs_beside_the_facts_and_the_probe(tmp_path, ssh_inventory):
    """A first run's preflight lists the engine's flags, collects the host's facts and probes at once. The
    flag listing here lists flags only once the facts collection has begun writing: one after the other
    (the listing first), it would give up after a minute and list nothing, which fails the preflight."""
    facts = tmp_path / "remote-work" / "*" / ".host" / "node1" / "facts*" / "kernel.txt"
    # Seen once is enough: the facts' folder is renamed into place while the listing waits, and a second
    # look between the shell's glob and ls's own would find neither name.
    listing = (f"seen=; for _ in $(seq 600); do ls {facts} >/dev/null 2>&1 && {{ seen=1; break; }}; sleep 0.1; "
               f"done; [ -n \"$seen\" ] && python -m sglang.launch_server --help")
    pb = yaml.safe_load(playbook(tmp_path, configs=[{"name": "one"}], profile="none").read_text())
    pb["server"]["help_command"] = listing
    (tmp_path / "playbook.yaml").write_text(yaml.safe_dump(pb))
    run = harness("sweep", tmp_path / "playbook.yaml", "-i", ssh_inventory(), "-o", tmp_path / "r")
    m = manifests(tmp_path / "r")["one-1"]
    assert run.returncode == 0 and m["status"] == "ok", (m.get("error"), run.stderr[-2000:])
    assert m["facts"]["kernel"] and m["facts"]["python"]
    # the probe marked the host once the engine imported: the host's later runs skip the import
    assert len(list((tmp_path / "remote-work").glob("*/.host/node1/module.ok"))) == 1


def test_the_server_starts_while_the_facts_are_collected_and_the_run_has_them(tmp_path, ssh_inventory):
    """A first run's preflight starts the host's facts and does not wait for them. This venv's
    nvidia-smi (the `cuda` fact) answers only once the run's server has been launched: were the
    facts waited for in the preflight, it would see no server for 30 s and say `alone`."""
    venv = make_remote_venv(tmp_path / "venv", engines=("sglang",))
    pid_files = f"{tmp_path}/remote-work/*/*/server.pid"
    smi = venv / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ $# -gt 0 ] && exit 9\n"   # the queries with arguments: no GPU here
                   f"for i in $(seq 300); do ls {pid_files} >/dev/null 2>&1 && "
                   "{ echo 'CUDA Version: 99.9'; exit 0; }; sleep 0.1; done; echo alone\n")
    smi.chmod(0o755)
    pb = playbook(tmp_path, configs=[{"name": "one"}, {"name": "two", "args": {"mem-fraction-static": 0.8}}],
                  profile="none")
    run = harness("sweep", pb, "-i", ssh_inventory(venv=str(venv)), "-o", tmp_path / "r", "--jobs", "1")
    ms = manifests(tmp_path / "r")
    assert run.returncode == 0 and [m["status"] for m in ms.values()] == ["ok", "ok"], run.stderr[-2000:]
    for name, m in ms.items():   # the second run takes the facts the first one's collection wrote
        assert m["facts"]["cuda"] == "99.9" and m["facts"]["python"], (name, m["facts"])
        assert (sweep_dir(tmp_path / "r") / "runs" / name / "facts" / "pip_freeze.txt").exists()


def test_hosts_that_share_a_workdir_keep_their_own_facts_and_flag_listing(tmp_path, ssh_inventory):
    """Two hosts, one workdir (as a home directory on NFS is), each with a venv of its own: what the
    sweep finds once on a host (facts, the engine's flag listing) is that host's, not the other's."""
    own = make_remote_venv(tmp_path / "own-venv", engines=("sglang",))
    (site,) = own.glob("lib/python*/site-packages")
    plant_distribution(site, "onlyhere", "1.0")
    inv = yaml.safe_load(ssh_inventory().read_text())
    inv["all"]["hosts"]["localhost"]["venv"] = str(own)        # node1 keeps the shared remote venv
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv))
    pb = playbook(tmp_path, configs=[{"name": "one"}], profile="none", hosts="localhost,node1", placement="each")
    # one run at a time: both hosts are this machine, and their servers would want the one port
    run = harness("sweep", pb, "-i", tmp_path / "inventory.yaml", "-o", tmp_path / "r", "--jobs", "1")
    ms = manifests(tmp_path / "r")
    assert run.returncode == 0 and sorted(ms) == ["one-localhost-1", "one-node1-1"], run.stderr[-2000:]
    packages = {name: (sweep_dir(tmp_path / "r") / "runs" / name / "facts" / "pip_freeze.txt").read_text().split()
                for name in ms}
    assert "onlyhere==1.0" in packages["one-localhost-1"]
    assert "onlyhere==1.0" not in packages["one-node1-1"]
    assert ms["one-localhost-1"]["facts"]["pip_freeze"] != ms["one-node1-1"]["facts"]["pip_freeze"]
    assert sorted(p.name for p in (tmp_path / "remote-work").glob("*/.host/*")) == ["localhost", "node1"]


def test_a_server_that_runs_out_of_memory_fails_fast_as_oom_with_its_log(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, configs=[{"name": "big", "env": {"HARNESS_SIM_FAULT": "oom_at_start"}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")["big-1"]
    assert m["error"]["kind"] == "oom" and "out of memory" in m["error"]["log_tail"].lower()
    assert m["phases"]["health"]["seconds"] < 60  # failed on the evidence, not at the startup timeout
    assert (sweep_dir(tmp_path / "r") / "runs" / "big-1" / "server.log").exists()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_no_memory_left_for_the_kv_cache_is_oom_in_each_engines_own_words(tmp_path, ssh_inventory, engine):
    """Neither engine says "out of memory" when the weights leave no room for the KV cache (SGLang
    0.5.23, vLLM 0.26.0 and 0.32.0): it was a plain launch failure, without the hint."""
    pb = playbook(tmp_path, engine=engine, profile="none",
                  configs=[{"name": "big", "env": {"HARNESS_SIM_FAULT": "no_kv_cache"}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")["big-1"]
    assert m["error"]["kind"] == "oom", m["error"]
    assert "out of memory" not in m["error"]["log_tail"].lower() and "memory for the" in m["error"]["log_tail"]


def test_a_profiler_that_answers_500_keeps_the_benchmark_and_says_what_it_answered(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, configs=[{"name": "p", "env": {"HARNESS_SIM_FAULT": "profile_500"}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stderr
    m = manifests(tmp_path / "r")["p-1"]
    assert m["status"] == "ok" and m["profile"]["status"] == "failed"
    assert "HTTP 500" in m["profile"]["error"] and "stayed empty" in m["profile"]["error"]
    assert m["profile"]["missing_ranks"] == 1 and m["profile"]["ranks_found"] == 0
    assert "p-1: warning: profile failed: the engine answered POST /start_profile with HTTP 500" in run.stderr
    compared = harness("compare", sweep_dir(tmp_path / "r"))
    assert "p: profile failed: the engine answered" in " ".join(compared.stdout.split())
    analyzed = harness("analyze", sweep_dir(tmp_path / "r") / "runs" / "p-1")
    said = " ".join(analyzed.stderr.split())
    assert analyzed.returncode == 2 and "the profile is failed" in said and "POST /start_profile -> 500" in said


def test_a_secret_server_flag_reaches_the_engine_and_nothing_the_harness_writes(tmp_path, ssh_inventory):
    """`api-key` in server.args: launch.sh passes it as "$HARNESS_ARG_API_KEY" from the 0600 secrets
    file; the engine gets the value (its log prints its arguments, as SGLang does), and every file
    brought back shows *** instead."""
    key = "sk-" + "9f3a" * 6
    pb = playbook(tmp_path, configs=[{"name": "k", "args": {"api-key": key}}], profile="none")
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    root = sweep_dir(tmp_path / "r") / "runs" / "k-1"
    assert '--api-key "$HARNESS_ARG_API_KEY"' in (root / "launch.sh").read_text()
    assert "***" in (root / "server.log").read_text()            # the engine had the real value
    for path in [p for p in (tmp_path / "r").rglob("*") if p.is_file()]:
        assert key not in path.read_text(errors="replace"), path
    assert key not in run.stdout + run.stderr
    collected = json.loads((root / "manifest.json").read_text())["collected"]   # hashed as masked, as kept
    assert not collected.get("unhashed") and len(collected["sha256"]) == collected["files"] >= 3
    assert collected["sha256"] == {name: hashlib.sha256((root / name).read_bytes()).hexdigest()
                                   for name in collected["sha256"]}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_server_that_asks_for_its_api_key_is_waited_for_benchmarked_and_profiled_with_it(
        tmp_path, ssh_inventory, engine):
    """The simulated engine answers 401 without `Authorization: Bearer KEY` where the real one does
    (all of /v1; SGLang's profiler too): the health wait, the benchmark and the profile all pass, so
    each sent the key, and no file of the results, compressed traces included, holds it."""
    key = "sk-" + "7c1e" * 6
    pb = playbook(tmp_path, engine=engine, configs=[{"name": "k", "args": {"api-key": key}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(tmp_path / "r").values()
    assert m["status"] == "ok" and m["profile"]["status"] == "ok", m.get("error") or m["profile"]
    root = sweep_dir(tmp_path / "r") / "runs" / "k-1"
    bench = json.loads((root / "bench.json").read_text())
    assert all(lv["completed"] == 4 and lv["failed"] == 0 for lv in bench["levels"])
    log = (root / "server.log").read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log and " 401 " not in log
    for path in [p for p in (tmp_path / "r").rglob("*") if p.is_file()]:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        assert key.encode() not in data, path
    assert key not in run.stdout + run.stderr


def test_shell_metacharacters_and_secrets_pass_literally_and_stay_secret(tmp_path, ssh_inventory):
    marker = tmp_path / "pwned"
    secret = "s3cr3t'; touch " + str(marker) + " #"
    pb = playbook(tmp_path, configs=[{"name": "q", "args": {"served-model-name": f"tiny; touch {marker}"},
                                      "env": {"HF_TOKEN": secret, "NOTE": f"$(touch {marker})"}}],
                  profile="none")
    pb.write_text(pb.read_text().replace("served_name: tiny", f"served_name: 'tiny; touch {marker}'"))
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert not marker.exists()
    assert run.returncode == 0, run.stdout + run.stderr
    root = sweep_dir(tmp_path / "r")
    for path in [*root.rglob("*.json"), *root.rglob("*.jsonl"), *root.rglob("*.sh"), *root.rglob("*.log")]:
        assert "s3cr3t" not in path.read_text(errors="replace"), path
    assert "s3cr3t" not in run.stdout + run.stderr


def test_plan_shows_every_run_and_script_as_json_without_touching_a_host(tmp_path, ssh_inventory):
    run = harness("plan", playbook(tmp_path), "-i", ssh_inventory(), "--format", "json")
    assert run.returncode == 0, run.stderr
    entries = json.loads(run.stdout)
    assert [e["run_id"] for e in entries] == ["tp2-1", "tp1-1"]
    assert all(set(e) == {"run_id", "host", "config", "script"} for e in entries)
    assert "--tp-size 2" in entries[0]["script"]
    assert not (tmp_path / "remote-work").exists()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_sweep_stops_its_server_flushes_the_journal_and_exits_130(tmp_path, ssh_inventory, sig):
    import signal
    import socket
    import subprocess
    import sys
    import time
    pb = playbook(tmp_path, configs=[{"name": "slow", "env": {"HARNESS_SIM_TIME_SCALE": "1"}}], profile="none")
    port = yaml.safe_load(pb.read_text())["server"]["port"]
    proc = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(ssh_inventory()),
                             "-o", str(tmp_path / "r")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "finish it with: harness sweep" in err and "--resume" in err
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    journal = (sweep_dir(tmp_path / "r") / "journal.jsonl").read_text().splitlines()
    assert json.loads(journal[-1]) | {"state": "interrupted", "run_id": "slow-1"} == json.loads(journal[-1])
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout
    assert leftovers == ""


def test_the_sweep_shows_how_far_each_benchmark_level_has_got(tmp_path, ssh_inventory):
    """A level can take tens of minutes: the heartbeat brings back the host's progress file, and the
    sweep's output says requests done of how many, tokens a second so far and the time left."""
    pb = playbook(tmp_path, configs=[{"name": "slow", "env": {"HARNESS_SIM_TIME_SCALE": "0.3"}}], profile="none",
                  benchmark={"prompt": "hello", "max_tokens": 24, "concurrency": [1, 2], "requests": 8, "warmup": 0})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r", "--lease", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"slow-1: bench level [12]/2 \(concurrency [12]\): \d+/8 requests", run.stderr), run.stderr
    assert not list((tmp_path / "r").rglob("bench.progress.json"))
