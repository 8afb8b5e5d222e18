"""A colleague's run directory, copied elsewhere with nothing beside it, run again on another host."""

from __future__ import annotations

import json
import shutil

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook, sweep_dir


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
