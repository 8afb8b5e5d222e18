"""`slurm.cpus_per_node`: the CPUs each node of an allocation gives its run. Without it salloc asked
for none, and Slurm gave one CPU a node (a server's tokenizer, scheduler and workers on one core
wherever the cluster binds steps to their CPUs); every step asked one CPU too. The cluster itself:
tests/e2e/test_slurm_faults.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from harness.config.inventory import SlurmSettings, load_inventory
from harness.errors import InputError
from harness.slurm import Allocation, NodeConnect, salloc_command
from harness.transport import HostSpec, connect
from harness.transport.slurm import srun_command

CLUSTER = """\
all:
  vars: {venv: /shared/venv}
  hosts:
    localhost: {transport: local}
  children:
    gpu:
      vars:
        scheduler: slurm
        slurm:
          nodes: 2
          cpus_per_node: CPUS
"""


def _inventory(tmp_path: Path, cpus: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(CLUSTER.replace("CPUS", cpus))
    return path


def test_cpus_per_node_is_an_inventory_key_of_the_slurm_group(tmp_path):
    inv = load_inventory(_inventory(tmp_path, "16"))
    assert [h.slurm.cpus_per_node for h in inv.select("gpu") if h.slurm] == [16, 16]
    assert SlurmSettings().cpus_per_node is None


@pytest.mark.parametrize("bad, message", [
    ("0", "greater than or equal to 1"),
    ("\"16; reboot\"", "valid integer"),
    ("\"16\"", "valid integer"),     # a string is not taken for a number: the YAML says what it is
    ("2.5", "valid integer"),
    ("true", "valid integer"),
    ("99999", "less than or equal to 16384"),
])
def test_a_bad_cpus_per_node_is_refused_naming_file_key_and_line(tmp_path, bad, message):
    with pytest.raises(InputError) as e:
        load_inventory(_inventory(tmp_path, bad))
    said = str(e.value)
    assert said.startswith(f"{tmp_path / 'inventory.yaml'}:11: all.children.gpu.vars.slurm.cpus_per_node: "
                           "group 'gpu': slurm.cpus_per_node: "), said
    assert message in said, said


def test_salloc_asks_the_cpus_of_the_one_task_of_each_node():
    words = shlex.split(salloc_command(SlurmSettings(nodes=2, cpus_per_node=16, gpus_per_node=8), nodes=2,
                                       name="j"))
    assert words == ["salloc", "--no-shell", "--immediate=600", "--job-name=j", "--nodes=2",
                     "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=16"]
    assert not any(w.startswith("--cpus") for w in shlex.split(salloc_command(SlurmSettings(), nodes=1, name="j")))


def test_each_step_asks_the_nodes_cpus_and_a_bad_count_never_reaches_srun():
    words = shlex.split(srun_command("42", "n1", "true", cpus=16))
    assert words[:8] == ["srun", "--jobid=42", "--overlap", "--nodelist=n1", "-N1", "-n1", "--cpus-per-task=16",
                         "--export=ALL"]
    assert "--cpus-per-task=1" in shlex.split(srun_command("42", "n1", "true"))
    for bad in (0, -1, True, "4; reboot", 2.0):
        with pytest.raises(ValueError):
            srun_command("42", "n1", "true", cpus=bad)  # type: ignore[arg-type]


def test_a_node_of_the_allocation_runs_its_steps_with_the_groups_cpus():
    for cpus, expected in ((12, 12), (None, 1)):
        allocation = Allocation("gpu", SlurmSettings(nodes=1, cpus_per_node=cpus), 1,
                                login=HostSpec(name="localhost", transport="local"), name="j", connect=connect,
                                log=lambda line: None)
        allocation.job_id, allocation.nodes = "42", ["n1"]
        from harness.transport.slurm import JobWatch
        allocation.watch = JobWatch("42")
        link = NodeConnect({"n1": allocation}, connect)(HostSpec(name="n1"))
        try:
            assert link.cpus == expected   # type: ignore[attr-defined]
        finally:
            link.close()
