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


def test_a_near_miss_of_a_known_variable_names_it_the_host_and_the_line(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      address: x\n      venvv: /opt/v\n")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    assert "'venvv'" in str(e.value) and "'a'" in str(e.value) and "did you mean 'venv'?" in str(e.value)
    assert e.value.line == 5 and e.value.file == str(path)


def test_an_ansible_inventorys_own_variables_are_kept_or_ignored_each_with_one_note(inv, tmp_path):
    path = write(tmp_path, "all:\n  vars: {datacenter: lab-3, ansible_become: true}\n"
                           "  hosts:\n    a: {rack: 12}\n    b: {ansible_python_interpreter: /usr/bin/python3}\n")
    inventory = load_inventory(path)
    assert inventory.hosts["a"].vars == {"datacenter": "lab-3", "rack": 12}
    assert inventory.hosts["b"].vars == {"datacenter": "lab-3"}
    assert sorted(inventory.notes) == [
        f"{path}: Ansible connection variables the harness does not use, ignored: ansible_become, "
        "ansible_python_interpreter",
        f"{path}: kept as template variables (host.vars.NAME), unused by the harness: datacenter, rack"]


INI = """\
# an Ansible INI inventory, as `ansible-inventory` reads it
bastion.lab ansible_user=jump

[h200]
h200-01 ansible_host=10.0.0.1 ansible_port=2222
h200-02 ansible_host=10.0.0.2 gpu="NVIDIA H200"

[h200:vars]
gpus=8
venv=/opt/venv

[gpu:children]
h200

[gpu:vars]
user=root
"""


def test_an_ini_inventory_loads_with_groups_children_and_vars(tmp_path):
    path = tmp_path / "hosts.ini"
    path.write_text(INI)
    inventory = load_inventory(path)
    h1, h2 = inventory.hosts["h200-01"], inventory.hosts["h200-02"]
    assert (h1.address, h1.port, h1.user, h1.gpus, h1.venv) == ("10.0.0.1", 2222, "root", 8, "/opt/venv")
    assert h2.gpu == "NVIDIA H200" and inventory.hosts["bastion.lab"].user == "jump"
    assert [h.name for h in inventory.select("gpu")] == ["h200-01", "h200-02"]


def test_a_mistake_in_an_ini_inventory_names_its_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("[gpu]\nbox-1 ansible_host=10.0.0.1\nbox-2 gpus=eight\n")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    assert e.value.line == 3 and "box-2" in str(e.value)


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
