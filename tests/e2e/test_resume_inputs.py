"""`--resume` after the orchestrator stopped: what it compares with the sweep it continues, and how it
holds the sweep against a second orchestrator. Real sweeps of the simulated engine on this machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from harness.render import BUILTIN_TEMPLATES
from harness.resume import fingerprint
from tests.conftest import harness
from tests.e2e.test_sweep import playbook, sweep_dir


def local_inventory(tmp_path: Path, remote_venv: Path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"all": {"vars": {"workdir": str(tmp_path / "remote-work")}, "hosts": {
        "localhost": {"transport": "local", "venv": str(remote_venv)}}}}))
    return path


def own_templates(tmp_path: Path) -> Path:
    """A team's own copy of the launch templates beside its playbook: the one it names includes
    `_common.sh.j2` from the same folder."""
    folder = tmp_path / "tpl"
    folder.mkdir()
    for path in BUILTIN_TEMPLATES.glob("*.j2"):
        shutil.copy(path, folder / path.name)
    return folder


def test_an_included_template_edited_before_the_resume_is_a_change(tmp_path, remote_venv):
    """The template a run names is fingerprinted with every template it can include: an edit of
    `_common.sh.j2` changes each launch script, and a resume would mix the two without a word."""
    inv, out, folder = local_inventory(tmp_path, remote_venv), tmp_path / "r", own_templates(tmp_path)
    pb = playbook(tmp_path, profile="none", hosts="localhost", template=str(folder / "sglang.sh.j2"))
    assert harness("sweep", pb, "-i", inv, "-o", out).returncode == 0
    same = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--dry-run")
    assert same.returncode == 0 and "would run 0 of 2" in " ".join(same.stdout.split()), same.stdout + same.stderr

    common = folder / "_common.sh.j2"
    common.write_text(common.read_text() + "export EDITED_AFTER_THE_STOP=1\n")
    refused = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--dry-run")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "the playbook changed" in said and "_common.sh.j2" in said, said


def test_a_sweep_recorded_before_includes_were_fingerprinted_resumes_unchanged(tmp_path, remote_venv):
    """sweep.json written by an older harness has no `includes` in its inputs: it is not taken for a change."""
    inv, out = local_inventory(tmp_path, remote_venv), tmp_path / "r"
    pb = playbook(tmp_path, profile="none", hosts="localhost")
    assert harness("sweep", pb, "-i", inv, "-o", out).returncode == 0
    record = sweep_dir(out) / "sweep.json"
    data = json.loads(record.read_text())
    for run in data["runs"]:
        run["inputs"].pop("includes", None)
        run["fingerprint"] = fingerprint(run["inputs"])
    record.write_text(json.dumps(data))
    again = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--dry-run")
    assert again.returncode == 0 and "would run 0 of 2" in " ".join(again.stdout.split()), again.stdout + again.stderr


def test_a_journal_with_a_line_of_bytes_not_ours_is_named_not_a_traceback(tmp_path, remote_venv):
    """A whole line of the journal that is not UTF-8 is damage: `--resume` stops naming the journal and
    the line (it stopped with a traceback), and resumes once that line is gone."""
    inv, out = local_inventory(tmp_path, remote_venv), tmp_path / "r"
    pb = playbook(tmp_path, profile="none", hosts="localhost")
    assert harness("sweep", pb, "-i", inv, "-o", out).returncode == 0
    path = sweep_dir(out) / "journal.jsonl"
    kept = path.read_bytes()
    path.write_bytes(kept + b"\xff\xfe\x00 damaged\n")
    for args in (["--dry-run"], []):
        refused = harness("sweep", pb, "-i", inv, "-o", out, "--resume", *args)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert f"{path}: not UTF-8 text" in said and "line" in said, said
    path.write_bytes(kept)
    again = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--dry-run")
    assert again.returncode == 0 and "would run 0 of 2" in " ".join(again.stdout.split()), again.stdout + again.stderr
