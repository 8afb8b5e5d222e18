"""A colleague's run directory, copied elsewhere with nothing beside it, run again on another host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from tests.conftest import harness
from tests.e2e.test_sweep import _free_port, manifests, playbook, sweep_dir


def test_a_copied_run_directory_alone_reproduces_on_another_host(tmp_path, ssh_inventory):
    inv = ssh_inventory()
    pb = playbook(tmp_path, configs=[{"name": "tp2", "args": {"tp-size": 2}, "env": {"HF_TOKEN": "hf_abc123"}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    original = sweep_dir(tmp_path / "r") / "runs" / "tp2-1"
    lonely = tmp_path / "colleague" / "tp2-1"
    shutil.copytree(original, lonely)
    shutil.rmtree(tmp_path / "r")
    pb.unlink()  # nothing but the run directory and an inventory

    refused = harness("reproduce", lonely, "-i", inv, "--host", "localhost", "-o", tmp_path / "r2")
    assert refused.returncode == 2 and "HF_TOKEN" in refused.stderr  # the secret is not in the record

    run = harness("reproduce", lonely, "-i", inv, "--host", "localhost", "-o", tmp_path / "r2",
                  env={"HF_TOKEN": "hf_abc123"})
    assert run.returncode == 0, run.stdout + run.stderr
    (again,) = manifests(tmp_path / "r2").values()
    assert again["host"]["name"] == "localhost" and again["status"] == "ok"
    assert again["config"]["args"] == {"tp-size": 2}
    assert "ITL p50 ms" in run.stdout and "beyond?" in run.stdout and "top kernels" in run.stdout
    launch = (sweep_dir(tmp_path / "r2") / "runs" / "tp2-1" / "launch.sh").read_text()
    assert "--tp-size 2" in launch and "hf_abc123" not in launch
    assert "hf_abc123" not in json.dumps(again)


def test_reproduce_needs_a_run_directory(tmp_path, ssh_inventory):
    run = harness("reproduce", tmp_path, "-i", ssh_inventory())
    assert run.returncode == 2 and "manifest.json" in run.stderr


def test_a_run_whose_server_took_several_keys_reproduces_with_each_from_the_environment(tmp_path, ssh_inventory):
    """vLLM's --api-key takes several keys: the sweep benchmarks with them, no file holds them, and
    reproduce asks for each variable the launch script read them from before it runs again."""
    inv = ssh_inventory()
    keys = ["sk-" + "a1b2" * 6, "sk-" + "c3d4" * 6]
    pb = playbook(tmp_path, engine="vllm", profile="none",
                  configs=[{"name": "k", "args": {"api-key": [keys], "max-num-batched-tokens": 8192}}])
    run = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    root = sweep_dir(tmp_path / "r") / "runs" / "k-1"
    launch = (root / "launch.sh").read_text()
    assert '--api-key "$HARNESS_ARG_API_KEY" "$HARNESS_ARG_API_KEY_1"' in launch
    assert "--max-num-batched-tokens 8192" in launch
    for path in [p for p in (tmp_path / "r").rglob("*") if p.is_file()]:
        assert not any(k in path.read_text(errors="replace") for k in keys), path

    refused = harness("reproduce", root, "-i", inv, "-o", tmp_path / "r2", env={"HARNESS_ARG_API_KEY": keys[0]})
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "HARNESS_ARG_API_KEY_1" in said and "args.api-key" in said, said
    again = harness("reproduce", root, "-i", inv, "-o", tmp_path / "r2",
                    env={"HARNESS_ARG_API_KEY": keys[0], "HARNESS_ARG_API_KEY_1": keys[1]})
    assert again.returncode == 0, again.stdout + again.stderr
    (m,) = manifests(tmp_path / "r2").values()
    assert m["status"] == "ok" and m["playbook"]["configs"][0]["args"]["api-key"] == [["***", "***"]]


def _local_inventory(tmp_path, remote_venv, **other_vars) -> Path:
    """Two hosts on this machine: `localhost`, and `other` with the variables given (its own env)."""
    local = {"transport": "local", "venv": str(remote_venv)}
    inv = {"all": {"vars": {"workdir": str(tmp_path / "remote-work")},
                   "hosts": {"localhost": local, "other": {**local, **other_vars}}}}
    path = tmp_path / "inventory-local.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _secret_run(tmp_path, remote_venv) -> tuple[Path, Path, str, str]:
    """A finished run whose server took a secret env value and a secret flag: its inventory, folder, both."""
    inv = _local_inventory(tmp_path, remote_venv)
    token, key = "hf_" + "t0k3n" * 5, "sk-" + "k3y" * 8
    pb = playbook(tmp_path, engine="vllm", profile="none", hosts="localhost",
                  configs=[{"name": "k", "args": {"api-key": key}, "env": {"HF_TOKEN": token}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    return inv, sweep_dir(tmp_path / "r") / "runs" / "k-1", token, key


def test_reproduce_writes_no_secret_it_is_given(tmp_path, remote_venv):
    """The secrets taken from the environment reach the reproduced server, and no file of the results
    (the recorded playbook beside them included) holds them."""
    inv, run_dir, token, key = _secret_run(tmp_path, remote_venv)
    again = harness("reproduce", run_dir, "-i", inv, "-o", tmp_path / "r2",
                    env={"HF_TOKEN": token, "HARNESS_ARG_API_KEY": key})
    assert again.returncode == 0, again.stdout + again.stderr
    assert token not in again.stdout + again.stderr and key not in again.stdout + again.stderr
    (m,) = manifests(tmp_path / "r2").values()
    assert m["status"] == "ok"   # the server asked for the key, and the benchmark sent it
    written = [p for p in (tmp_path / "r2").rglob("*") if p.is_file()]
    assert any(p.name == "playbook.yaml" for p in written)
    for path in written:
        text = path.read_text(errors="replace")
        assert token not in text and key not in text, path


def test_reproduce_names_every_missing_secret_at_once(tmp_path, remote_venv):
    inv, run_dir, token, _ = _secret_run(tmp_path, remote_venv)
    for env in ({}, {"HF_TOKEN": token}):
        refused = harness("reproduce", run_dir, "-i", inv, "-o", tmp_path / "r2", env=env)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == 2 and "HARNESS_ARG_API_KEY" in said and "args.api-key" in said, said
        assert ("HF_TOKEN" in said) == (not env), said
    assert not (tmp_path / "r2").exists() or not list((tmp_path / "r2").rglob("*.yaml"))


def test_reproduce_shows_each_line_of_the_launch_that_differs(tmp_path, remote_venv):
    """The same recorded run on a host whose inventory adds env: the launch differs, and says so."""
    inv = _local_inventory(tmp_path, remote_venv, env={"NCCL_DEBUG": "INFO"})
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[{"name": "tp2", "args": {"tp-size": 2}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    run_dir = sweep_dir(tmp_path / "r") / "runs" / "tp2-1"

    same = harness("reproduce", run_dir, "-i", inv, "-o", tmp_path / "same")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "launch.sh" not in same.stdout   # the run folder on the host differs by nature, nothing else

    moved = harness("reproduce", run_dir, "-i", inv, "--host", "other", "-o", tmp_path / "moved")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    shown = [line for line in moved.stdout.splitlines() if "launch.sh" in line]
    assert any("export NCCL_DEBUG=INFO" in line for line in shown), moved.stdout


def test_a_recorded_host_this_inventory_lacks_is_refused_with_the_way_to_choose_one(tmp_path, remote_venv):
    inv = _local_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[{"name": "tp2", "args": {"tp-size": 2}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    theirs = tmp_path / "theirs.yaml"
    theirs.write_text(yaml.safe_dump({"all": {"hosts": {"gpu-02": {"transport": "local", "venv": str(remote_venv)}}}}))
    refused = harness("reproduce", sweep_dir(tmp_path / "r") / "runs" / "tp2-1", "-i", theirs, "-o", tmp_path / "r2")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "'localhost' matches no host" in said and "--host NAME" in said, said
    asked = harness("reproduce", sweep_dir(tmp_path / "r") / "runs" / "tp2-1", "-i", theirs, "-o", tmp_path / "r2",
                    "--host", "gpu-03")
    said = " ".join(asked.stderr.split())
    assert asked.returncode == 2 and f"--host: 'gpu-03' matches no host of {theirs}" in said, said
    assert ".reproduce" not in said   # the copy of the playbook is not what the user gave


def test_a_value_that_held_a_secret_inside_it_is_refused_never_launched_masked(tmp_path, remote_venv):
    """A secret's value inside another value is masked there too (`https://***@hub.local`): the record
    cannot say what the run had, so reproducing refuses, naming the key, rather than launch with ***."""
    inv = _local_inventory(tmp_path, remote_venv)
    token = "hf_" + "in51de" * 4
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[
        {"name": "t", "env": {"HF_TOKEN": token, "HF_ENDPOINT": f"https://{token}@hub.local"}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    run_dir = sweep_dir(tmp_path / "r") / "runs" / "t-1"
    refused = harness("reproduce", run_dir, "-i", inv, "-o", tmp_path / "r2", env={"HF_TOKEN": token})
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "configs.0.env.HF_ENDPOINT" in said, refused.stdout + said
    assert not (tmp_path / "r2").exists() or not any((tmp_path / "r2").glob("*/runs"))


def test_a_resume_after_a_reproduction_in_the_same_results_continues_the_sweep(tmp_path, remote_venv):
    """A run reproduced into the results folder of its sweep is a sweep of its own, never the one that
    `harness sweep PLAYBOOK --resume` continues."""
    inv = _local_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, profile="none", hosts="localhost")
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    (original,) = [p for p in (tmp_path / "r").iterdir() if not p.name.startswith(".")]
    assert harness("reproduce", original / "runs" / "tp1-1", "-i", inv, "-o", tmp_path / "r").returncode == 0
    resumed = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r", "--resume", "--dry-run")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = " ".join(resumed.stdout.split())
    assert f"--resume of {original.name} would run 0 of 2 runs" in said, said


def _hosts_inventory(tmp_path, remote_venv, **hosts) -> Path:
    """Hosts on this machine, each in a workdir of its own, with the variables given."""
    inv = {"all": {"hosts": {name: {"transport": "local", "venv": str(remote_venv),
                                    "workdir": str(tmp_path / f"work-{name}"), **extra}
                             for name, extra in hosts.items()}}}
    path = tmp_path / "inventory-hosts.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def test_every_node_of_a_server_on_two_hosts_is_compared_and_named(tmp_path, remote_venv):
    """A run on two hosts reproduced on node 0's host and a third whose inventory adds env: node 1's
    launch differs and says so, with its node; node 0's does not, nor does either node's folder on its
    host (another workdir on each). Both nodes live on this machine: node 1 serves on a port of its own."""
    inv = _hosts_inventory(tmp_path, remote_venv, a={}, b={}, c={"env": {"NCCL_DEBUG": "INFO"}})
    ports = [_free_port() for _ in range(3)]
    pb = playbook(tmp_path, profile="none", hosts="a,b", configs=[{"name": "tp2", "nodes": 2, "args": {
        "tp-size": 2, "port": f"{{{{ {ports[0]} if node_rank == 0 else {ports[1]} }}}}"}}])
    recorded = yaml.safe_load(pb.read_text())
    recorded["server"] |= {"port": ports[0], "rendezvous_port": ports[2]}
    pb.write_text(yaml.safe_dump(recorded))
    first = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r")
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = sweep_dir(tmp_path / "r") / "runs" / "tp2-1"
    assert (run_dir / "nodes" / "node1" / "launch.sh").is_file()

    again = harness("reproduce", run_dir, "-i", inv, "--host", "a,c", "-o", tmp_path / "r2")
    assert again.returncode == 0, again.stdout + again.stderr
    (m,) = manifests(tmp_path / "r2").values()
    assert [n["host"] for n in m["nodes"]] == ["a", "c"]
    shown = [" ".join(line.split()) for line in again.stdout.splitlines() if "launch.sh" in line]
    assert shown == ["node 1 launch.sh - export NCCL_DEBUG=INFO"], again.stdout


def test_a_refused_reproduction_leaves_nothing_new_on_disk(tmp_path, remote_venv):
    """Refusals after the recorded playbook was copied out (a host this inventory lacks, a record that
    makes more than one run): the results folder is as it was, and one not there before is not made."""
    inv = _local_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[{"name": "tp2", "args": {"tp-size": 2}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    run_dir = sweep_dir(tmp_path / "r") / "runs" / "tp2-1"
    before = sorted((tmp_path / "r").rglob("*"))

    refused = harness("reproduce", run_dir, "-i", inv, "--host", "gpu-09", "-o", tmp_path / "r")
    assert refused.returncode == 2 and "'gpu-09' matches no host" in refused.stderr, refused.stderr
    assert sorted((tmp_path / "r").rglob("*")) == before
    refused = harness("reproduce", run_dir, "-i", inv, "--host", "gpu-09", "-o", tmp_path / "fresh" / "r")
    assert refused.returncode == 2 and not (tmp_path / "fresh").exists()

    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["playbook"]["repeat"] = 2
    damaged = tmp_path / "damaged" / "tp2-1"
    shutil.copytree(run_dir, damaged)
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    refused = harness("reproduce", damaged, "-i", inv, "-o", tmp_path / "r")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and f"{damaged / 'manifest.json'}: playbook: the recorded playbook makes 2 runs" \
        in said, said
    assert sorted((tmp_path / "r").rglob("*")) == before


def test_the_model_where_it_lives_on_this_host_is_the_one_change_the_reproduction_makes(tmp_path, remote_venv):
    inv = _local_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[{"name": "tp2", "args": {"tp-size": 2}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    run_dir = sweep_dir(tmp_path / "r") / "runs" / "tp2-1"
    moved = tmp_path / "my models" / "tiny"
    again = harness("reproduce", run_dir, "-i", inv, "-o", tmp_path / "r2", "--model-path", moved)
    assert again.returncode == 0, again.stdout + again.stderr
    (m,) = manifests(tmp_path / "r2").values()
    assert m["status"] == "ok" and m["model"]["path"] == str(moved) and m["playbook"]["model"]["path"] == str(moved)
    launch = (sweep_dir(tmp_path / "r2") / "runs" / "tp2-1" / "launch.sh").read_text()
    assert f"--model-path '{moved}'" in launch
    said = [" ".join(line.split()) for line in again.stdout.splitlines()]
    assert f"model.path (--model-path) /models/tiny {moved}" in said, again.stdout
    assert not [line for line in said if "launch.sh" in line], again.stdout


def test_an_original_whose_figures_cannot_be_read_is_said_not_shown_as_nothing(tmp_path, remote_venv):
    inv = _local_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, profile="none", hosts="localhost", configs=[{"name": "tp2", "args": {"tp-size": 2}}])
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    copied = tmp_path / "colleague" / "tp2-1"
    shutil.copytree(sweep_dir(tmp_path / "r") / "runs" / "tp2-1", copied)
    (copied / "bench.json").write_text('{"levels": [')   # cut short on its way over
    again = harness("reproduce", copied, "-i", inv, "-o", tmp_path / "r2")
    assert again.returncode == 0, again.stdout + again.stderr
    said = " ".join(again.stdout.split())
    assert f"note: original: no benchmark figures: {copied / 'bench.json'} cannot be read" in said, said
