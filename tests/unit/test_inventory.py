"""The inventory: Ansible shape, inheritance, aliases, --limit, and mistakes named precisely."""

from pathlib import Path

import pytest

from harness.config.inventory import load_inventory
from harness.errors import InputError

INVENTORY = """\
all:
  vars: {venv: /opt/venv, workdir: /scratch, env: {A: "1", B: "all"}}
  hosts:
    localhost: {ansible_connection: local}
  children:
    gpu:
      vars: {user: root, gpus: 8, env: {B: gpu}}
      children:
        h200:
          vars: {gpu: H200}
          hosts:
            h200-01: {ansible_host: 10.0.0.1, ansible_port: 2222, ansible_python_interpreter: /usr/bin/python3}
            h200-02: {address: 10.0.0.2, user: ubuntu, env: {B: host}}
      hosts:
        b200-01: {address: 10.0.0.3, ansible_ssh_private_key_file: ~/.ssh/lab}
"""


@pytest.fixture
def inv(tmp_path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    return path


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


def test_group_vars_are_inherited_and_host_values_win(inv):
    hosts = load_inventory(inv).hosts
    assert hosts["h200-01"].user == "root" and hosts["h200-01"].gpu == "H200" and hosts["h200-01"].gpus == 8
    assert hosts["h200-02"].user == "ubuntu"
    assert hosts["h200-01"].venv == "/opt/venv" and hosts["h200-01"].workdir == "/scratch"


def test_env_mappings_merge_key_by_key_with_the_closest_value_winning(inv):
    hosts = load_inventory(inv).hosts
    assert hosts["h200-01"].env == {"A": "1", "B": "gpu"}
    assert hosts["h200-02"].env == {"A": "1", "B": "host"}


def test_ansible_aliases_are_understood_and_other_ansible_vars_ignored(inv):
    hosts = load_inventory(inv).hosts
    assert hosts["localhost"].transport == "local"
    assert (hosts["h200-01"].address, hosts["h200-01"].port) == ("10.0.0.1", 2222)
    assert hosts["b200-01"].identity_file == "~/.ssh/lab"


def test_limit_selects_by_host_group_or_glob(inv):
    inventory = load_inventory(inv)
    assert [h.name for h in inventory.select("h200-02")] == ["h200-02"]
    assert [h.name for h in inventory.select("h200")] == ["h200-01", "h200-02"]
    assert sorted(h.name for h in inventory.select("gpu")) == ["b200-01", "h200-01", "h200-02"]
    assert [h.name for h in inventory.select("b2*")] == ["b200-01"]
    assert [h.name for h in inventory.select("localhost,b200-01")] == ["localhost", "b200-01"]


def test_a_limit_matching_nothing_names_what_exists(inv):
    with pytest.raises(InputError, match="'nope' matches no host or group.*h200"):
        load_inventory(inv).select("nope")


def test_an_unknown_host_variable_names_the_key_the_host_and_the_line(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      address: x\n      gpu_count: 8\n")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    assert "gpu_count" in str(e.value) and "'a'" in str(e.value)
    assert e.value.line == 5 and e.value.file == str(path)


def test_a_wrong_type_names_the_host_and_the_line_of_the_value(tmp_path):
    path = write(tmp_path, "all:\n  vars:\n    gpus: eight\n  hosts:\n    a: {}\n")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    assert e.value.line == 3 and "host 'a'" in str(e.value)


def test_broken_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    a: {address: [x\n")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    assert e.value.line is not None and "invalid YAML" in str(e.value)


def test_an_unknown_group_key_is_refused(tmp_path):
    path = write(tmp_path, "all:\n  host:\n    a: {}\n")
    with pytest.raises(InputError, match="unknown key"):
        load_inventory(path)


def test_a_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_inventory(tmp_path / "nope.yaml")
