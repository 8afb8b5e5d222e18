"""The harness as a user installs it: `pip install .` (not editable) into a venv of its own, then a sweep
from a folder that holds nothing but a playbook and an inventory. The launch templates come from the
installed package; a template of one's own beside the playbook wins and can include the built-in
`_common.sh.j2`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.remote_venv import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with the harness installed from a wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", tmp / "wheel", REPO], check=True, capture_output=True)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    (wheel,) = (tmp / "wheel").glob("harness-*.whl")
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    wheel], check=True, capture_output=True)
    return venv


def folder_with_a_playbook(path, venv):
    path.mkdir()
    (path / "inventory.yaml").write_text(yaml.safe_dump(
        {"all": {"hosts": {"localhost": {"transport": "local", "venv": str(venv),
                                         "workdir": str(path / "work")}}}}))
    (path / "pb.yaml").write_text(yaml.safe_dump({
        "name": "installed", "hosts": "localhost", "engine": "sim", "flavor": "vllm",
        "model": {"path": "/models/tiny"}, "server": {"port": 18555, "startup_timeout_s": 60},
        "configs": [{"name": "one"}], "benchmark": {"requests": 2, "max_tokens": 4},
        "profile": {"mode": "engine", "num_steps": 3}}))
    return path


def sweep(venv, folder):
    return subprocess.run([venv / "bin/harness", "sweep", "pb.yaml", "-o", "results"], cwd=folder,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{venv}/bin:/usr/bin:/bin", "HARNESS_SIM_TIME_SCALE": "0.02",
                               "HARNESS_SIM_STARTUP_S": "0.5", "COLUMNS": "200"})


def manifest_of(folder):
    (run_dir,) = (folder / "results").glob("*/runs/*")
    return json.loads((run_dir / "manifest.json").read_text()), run_dir


def test_an_installed_harness_sweeps_from_any_folder_with_its_own_templates(installed, tmp_path):
    folder = folder_with_a_playbook(tmp_path / "elsewhere", installed)
    run = sweep(installed, folder)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest, run_dir = manifest_of(folder)
    assert manifest["status"] == "ok" and manifest["profile"]["status"] == "ok"
    assert "site-packages/harness/templates/sim.sh.j2" in manifest["template"]["path"]
    assert "python -m harness.sim vllm" in (run_dir / "launch.sh").read_text()


def test_a_template_beside_the_playbook_wins_and_includes_the_built_in_head(installed, tmp_path):
    folder = folder_with_a_playbook(tmp_path / "own", installed)
    (folder / "templates").mkdir()
    (folder / "templates" / "sim.sh.j2").write_text(
        '{% include "_common.sh.j2" %}\nexport OUR_OWN_TEMPLATE=1\n'
        'exec {{ launcher }} {{ model.path | shquote }} --host {{ server.host | shquote }} --port {{ server.port }}'
        ' --profiler-config.profiler torch --profiler-config.torch_profiler_dir {{ run.profile_dir | shquote }}'
        ' --profiler-config.max_iterations {{ profile.num_steps }}\n')
    run = sweep(installed, folder)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest, run_dir = manifest_of(folder)
    launch = (run_dir / "launch.sh").read_text()
    assert manifest["template"]["path"] == str(folder / "templates" / "sim.sh.j2")
    assert "export OUR_OWN_TEMPLATE=1" in launch and "source " in launch   # the built-in head came too
    assert {"_common.sh.j2", "sim.sh.j2"} <= set(manifest["template"]["files"])
    assert manifest["template"]["files"]["sim.sh.j2"] == (folder / "templates" / "sim.sh.j2").read_text()
