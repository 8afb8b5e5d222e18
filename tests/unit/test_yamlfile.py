"""YAML that PyYAML takes silently or chokes on is refused with the file, key and line."""

from __future__ import annotations

import time

import pytest

from harness.config.yamlfile import load_yaml
from harness.errors import InputError
from harness.plan import load_sweep


def refused(tmp_path, text: str) -> InputError:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_yaml(path)
    assert e.value.file == str(path)
    return e.value


def test_a_key_given_twice_is_refused_with_both_lines_rather_than_losing_the_first(tmp_path):
    e = refused(tmp_path, "server: {port: 30001, args: {tp-size: 8}}\nname: x\nserver: {env: {A: b}}\n")
    assert e.line == 3 and e.key == "server" and "lines 1 and 3" in str(e)
    e = refused(tmp_path, "configs:\n  - {name: a, args: {tp-size: 2, tp-size: 4}}\n")
    assert e.key == "configs[0].args.tp-size"


def test_merge_keys_and_keys_that_differ_in_type_are_not_duplicates(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {a: 1, b: 2}\nc: {<<: *b, a: 3}\nd: {8: x, '8': y}\n")
    assert load_yaml(path).data == {"base": {"a": 1, "b": 2}, "c": {"a": 3, "b": 2}, "d": {8: "x", "8": "y"}}


def test_an_alias_inside_itself_is_refused(tmp_path):
    e = refused(tmp_path, "vars: &v {self: *v}\n")
    assert "contains itself" in str(e) and e.key == "vars.self"


def test_aliases_that_expand_to_billions_are_refused_at_once(tmp_path):
    text = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
    started = time.process_time()
    e = refused(tmp_path, text)
    assert "values once its aliases are expanded" in str(e) and time.process_time() - started < 30


def test_nesting_too_deep_is_an_input_error_not_a_recursion_error(tmp_path):
    assert "nested" in str(refused(tmp_path, "x: " + "[" * 500 + "]" * 500 + "\n"))
    assert "nested" in str(refused(tmp_path, "x: " + "[" * 80 + "]" * 80 + "\n"))


def test_a_nul_character_is_refused_where_it_stands(tmp_path):
    e = refused(tmp_path, 'model: {path: "/models/m\\0evil"}\n')
    assert e.key == "model.path" and e.line == 1 and "NUL" in str(e)


def test_a_wrong_value_that_may_hold_a_secret_is_not_repeated_in_the_error(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    localhost: {transport: local}\n")
    pb = tmp_path / "pb.yaml"
    for server in ("{env: HF_TOKEN=hf_Leaked99}", "{env: {HF_TOKEN: [hf_Leaked99]}}",
                   "{args: --api-key=hf_Leaked99}"):
        pb.write_text(f"name: t\nhosts: localhost\nengine: sim\nmodel: {{path: m}}\nserver: {server}\n")
        with pytest.raises(InputError) as e:
            load_sweep(pb, inventory)
        assert "hf_Leaked99" not in str(e.value) and e.value.key.startswith("server.")
    pb.write_text("name: t\nhosts: localhost\nengine: sim\nmodel: {path: m}\nserver: {port: abc}\n")
    with pytest.raises(InputError, match="got 'abc'"):   # a plain value is still shown
        load_sweep(pb, inventory)


def test_a_secrets_value_that_is_no_valid_template_is_refused_without_showing_it(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    localhost: {transport: local}\n")
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: t\nhosts: localhost\nengine: sim\nmodel: {path: m}\n"
                  "server: {env: {HF_TOKEN: 'hf_Ab{%Cd9xQ'}}\nconfigs: [{name: a}]\n")
    with pytest.raises(InputError) as e:
        load_sweep(pb, inventory)
    assert "Cd9xQ" not in str(e.value) and e.value.key == "server.env.HF_TOKEN" and "not shown" in str(e.value)
