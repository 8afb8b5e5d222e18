"""A Slurm group in the inventory, and every value on its way to salloc, srun and scancel.

The cluster itself is tested for real in tests/e2e/test_slurm.py; here are the words: what the
inventory accepts and refuses (file, key and line named), the command lines built from it, and what
is believed of Slurm's answers.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from harness.config.inventory import SlurmSettings, load_inventory
from harness.errors import HarnessError, InputError
from harness.slurm import granted_job, node_names, salloc_command
from harness.transport.slurm import STEP_LINE, srun_command

CLUSTER = """\
all:
  vars: {venv: /shared/venv}
  hosts:
    login-01: {address: 10.0.0.9, user: me}
  children:
    gpu:
      vars:
        scheduler: slurm
        slurm: {nodes: 2, gpus_per_node: 8, partition: h200, account: lab, time: "2:00:00", login: login-01}
        env: {NCCL_DEBUG: WARN}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


def test_a_slurm_group_has_one_slot_per_node_with_the_group_settings(tmp_path):
    inv = load_inventory(write(tmp_path, CLUSTER))
    slots = inv.select("gpu")
    assert [h.name for h in slots] == ["gpu-1", "gpu-2"]
    for h in slots:
        assert h.cluster == "gpu" and h.scheduler == "slurm" and h.venv == "/shared/venv"
        assert h.slurm == SlurmSettings(nodes=2, gpus_per_node=8, partition="h200", account="lab",
                                        time="2:00:00", login="login-01")
        assert h.env == {"NCCL_DEBUG": "WARN"}
    assert inv.hosts["login-01"].cluster is None and inv.hosts["login-01"].slurm is None


@pytest.mark.parametrize("change, key, message", [
    ("login: login-01", "all.children.gpu.vars.slurm.login", "is not a host of the inventory"),
    ("partition: h200", "all.children.gpu.vars.slurm", "use letters, digits"),
    ("time: \"2:00:00\"", "all.children.gpu.vars.slurm", "expected a Slurm time limit"),
    ("nodes: 2", "all.children.gpu.vars.slurm", "greater than or equal to 1"),
    ("account: lab", "all.children.gpu.vars.slurm", "use letters, digits"),
])
def test_a_bad_slurm_value_is_refused_naming_file_key_and_line(tmp_path, change, key, message):
    bad = {"login: login-01": "login: login-99", "partition: h200": "partition: \"h200; rm -rf /\"",
           "time: \"2:00:00\"": "time: \"$(reboot)\"", "nodes: 2": "nodes: 0",
           "account: lab": "account: \"a b\""}[change]
    with pytest.raises(InputError) as e:
        load_inventory(write(tmp_path, CLUSTER.replace(change, bad)))
    assert str(e.value).startswith(f"{tmp_path / 'inventory.yaml'}:9: {key}"), str(e.value)
    assert message in str(e.value)


def test_a_slurm_group_lists_no_hosts_of_its_own(tmp_path):
    text = CLUSTER + "      hosts: {gpu-node-7: {}}\n"
    with pytest.raises(InputError, match=r"inventory.yaml:11: all.children.gpu.hosts: group 'gpu' is a Slurm "
                                         r"cluster: its nodes come from its allocation"):
        load_inventory(write(tmp_path, text))


def test_scheduler_and_slurm_go_together(tmp_path):
    with pytest.raises(InputError, match="sets both `scheduler: slurm` and `slurm:`"):
        load_inventory(write(tmp_path, CLUSTER.replace("        scheduler: slurm\n", "")))


def test_salloc_gets_every_setting_as_one_quoted_word():
    settings = SlurmSettings(nodes=2, gpus_per_node=8, partition="h200", account="lab", time="1-00:00:00",
                             wait_s=90)
    words = shlex.split(salloc_command(settings, nodes=2, name="harness-demo-20260101-000000-gpu"))
    assert words == ["salloc", "--no-shell", "--immediate=90", "--job-name=harness-demo-20260101-000000-gpu",
                     "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=h200",
                     "--account=lab", "--time=1-00:00:00"]
    assert shlex.split(salloc_command(SlurmSettings(), nodes=1, name="j")) == [
        "salloc", "--no-shell", "--immediate=600", "--job-name=j", "--nodes=1", "--ntasks-per-node=1"]
    with pytest.raises(ValueError):
        salloc_command(SlurmSettings(), nodes=1, name="j; scancel -u everyone")


def test_srun_runs_the_command_as_one_word_on_one_validated_node():
    command = "echo 'it''s' $HOME; rm -rf /tmp/x"
    words = shlex.split(srun_command("42", "gpu-node-1", command))
    assert words[:10] == ["srun", "--jobid=42", "--overlap", "--nodelist=gpu-node-1", "-N1", "-n1",
                          "--cpus-per-task=1", "--export=ALL", "--quiet", "bash"]
    assert words[-1] == command
    for job, node in (("42; reboot", "n1"), ("42", "n1 --uid=0"), ("42", "-n1"), ("", "n1")):
        with pytest.raises(ValueError):
            srun_command(job, node, "true")


def test_what_slurm_says_is_checked_before_it_is_believed():
    assert granted_job("salloc: Pending job allocation 17\nsalloc: Granted job allocation 17\n") == "17"
    assert granted_job("salloc: error: Unable to allocate resources: Connection timed out\n") is None
    assert node_names("n1\nn2\n", expected=2) == ["n1", "n2"]
    for said in ("n1\n", "n1\nn1\n", "n1\n$(reboot)\n", "n1\n-oProxyCommand=x\n"):
        with pytest.raises(HarnessError):
            node_names(said, expected=2)
    assert STEP_LINE.match(b"harness-step 17.3") and STEP_LINE.match(b"harness-step 17_2.0")
    assert not STEP_LINE.match(b"harness-step 17.") and not STEP_LINE.match(b"hello")


class _Chunks:
    """A login host's srun as `_StepProcess` reads it: bytes in the chunks given, then its end."""

    def __init__(self, *chunks: bytes, code: int = 0):
        self.chunks, self.code = list(chunks), code

    def read(self, deadline: float) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def wait(self, deadline: float) -> int:
        return self.code

    def stderr(self) -> bytes:
        return b""

    def kill(self) -> None: ...

    def close(self) -> None: ...


def _unframed(*chunks: bytes) -> tuple[bytes, list[str], int | None]:
    from harness.transport.slurm import _StepProcess
    steps: list[str] = []
    proc = _StepProcess(_Chunks(*chunks, code=143), steps.append, lambda p: None)
    out = b""
    while data := proc.read(0):
        out += data
    return out, steps, proc.wait(0)


def test_a_step_output_is_unframed_however_it_is_cut():
    stream = b"harness-step 7.3\n5\nhello7\n world\nend 3\n"
    for cut in range(1, len(stream)):
        assert _unframed(stream[:cut], stream[cut:]) == (b"hello world\n", ["7.3"], 3)
    # no end frame: the step was cut short, and srun's own code is what is left
    assert _unframed(b"harness-step 7.3\n5\nhel") == (b"", ["7.3"], 143)
    assert _unframed(b"") == (b"", [], 143)   # srun never started it


def test_what_the_nodes_shell_prints_before_the_step_line_is_dropped():
    """A BASH_ENV file (Lmod names one in the environment srun passes on) may print as the node's
    shell starts, before the wrapper's first line."""
    stream = b"Lmod: loading cuda/12.4\n\nharness-step 7.3\n5\nhelloend 0\n"
    for cut in range(1, len(stream)):
        assert _unframed(stream[:cut], stream[cut:]) == (b"hello", ["7.3"], 0)
    assert _unframed(b"x" * 40_000 + b"\n" + b"harness-step 7.3\nend 0\n") == (b"", ["7.3"], 0)
    assert _unframed(b"Lmod: loading cuda/12.4\n") == (b"", [], 143)   # srun never ran the command


@pytest.mark.parametrize("stream", [b"hello\n" * 12_000, b"x" * 70_000, b"harness-step 7.3\n99999999\n",
                                    b"harness-step 7.3\nx" * 300, b"harness-step 7.3\n70000\n" + b"x" * 70000])
def test_a_step_output_that_is_not_the_wrapper_is_refused(stream):
    from harness.errors import RemoteError
    with pytest.raises(RemoteError, match="not the harness's wrapper"):
        _unframed(stream)
