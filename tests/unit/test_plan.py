"""Playbooks, rendering and the plan: every value quoted, every mistake named before any host."""

import hashlib
import os
import shlex
import subprocess

import pytest

import harness
from harness.errors import InputError
from harness.plan import load_sweep
from harness.remote import zipapp
from harness.render import flags, shquote

INVENTORY = """\
all:
  vars: {workdir: /tmp/hw}
  hosts:
    localhost: {transport: local, venv: /opt/venv}
  children:
    gpu:
      vars: {venv: /opt/venv}
      hosts: {g1: {address: 10.0.0.1}, g2: {address: 10.0.0.2}}
"""

PLAYBOOK = """\
name: t
hosts: gpu
engine: sglang
model: {path: /models/m, served_name: m}
server:
  args: {trust-remote-code: true, kv-cache-dtype: fp8_e4m3}
  env: {SGLANG_TORCH_PROFILER_DIR: "{{ run.profile_dir }}", HF_TOKEN: "hf_s3cr3t'$x"}
configs:
  - {name: tp8, args: {tp-size: 8}}
  - {name: ep8, args: {tp-size: 8, ep-size: 8, kv-cache-dtype: null}}
profile: {mode: engine}
"""


@pytest.fixture
def files(tmp_path):
    def make(playbook: str = PLAYBOOK, inventory: str = INVENTORY):
        (tmp_path / "inventory.yaml").write_text(inventory)
        (tmp_path / "pb.yaml").write_text(playbook)
        return tmp_path / "pb.yaml", tmp_path / "inventory.yaml"
    return make


def test_flags_render_bare_omitted_repeated_and_quoted():
    rendered = flags({"a": True, "b": False, "c": None, "d": [1, 2], "e": "x; touch /tmp/pwn", "-O3": True})
    assert shlex.split(rendered) == ["--a", "--d", "1", "--d", "2", "--e", "x; touch /tmp/pwn", "-O3"]


def test_a_nested_list_gives_one_flag_several_values_and_dotted_fields_take_explicit_booleans():
    rendered = flags({"cuda-graph-bs-decode": [[1, 2, 4]], "profiler-config.with_stack": False,
                      "compilation-config.use_inductor": True})
    assert shlex.split(rendered) == ["--cuda-graph-bs-decode", "1", "2", "4", "--profiler-config.with_stack",
                                     "false", "--compilation-config.use_inductor", "true"]


def test_shquote_keeps_metacharacters_literal():
    for value in ["$(id)", "a'b", "x; rm -rf /", "`id`", "new\nline"]:
        assert shlex.split(shquote(value)) == [value]


def test_configs_merge_over_server_args_and_null_removes_a_flag(files):
    sweep = load_sweep(*files(), sweep_id="s1")
    tp8, ep8 = (sweep.render(run, run.hosts[0]) for run in sweep.runs)
    assert tp8.args == {"trust-remote-code": True, "kv-cache-dtype": "fp8_e4m3", "tp-size": 8}
    assert "--kv-cache-dtype" not in ep8.script and "--ep-size 8" in ep8.script


def test_a_null_variable_is_unset_in_the_script_whatever_the_host_or_the_server_section_set(files):
    """`null` for a variable means no variable, as for a flag: an empty one is not an absent one
    (CUDA_VISIBLE_DEVICES="" hides every GPU). A configuration's or a matrix point's null unsets what
    the host's or the server section's set, and what the login's environment brought."""
    inventory = INVENTORY.replace("{g1: {address: 10.0.0.1}", "{g1: {address: 10.0.0.1, env: {HOSTVAR: h}}")
    playbook = PLAYBOOK.replace("HF_TOKEN: \"hf_s3cr3t'$x\"}", "HF_TOKEN: \"hf_s3cr3t'$x\", FOO: '1', BAR: keep}")
    playbook = playbook.replace("  - {name: tp8, args: {tp-size: 8}}",
                                "  - {name: tp8, args: {tp-size: 8}, env: {FOO: null, HOSTVAR: null, HF_TOKEN: null}}")
    playbook += "matrix: {axes: {env.QUX: [null, '1']}}\nhosts: g1\n"
    playbook = playbook.replace("hosts: gpu\n", "")
    sweep = load_sweep(*files(playbook, inventory), sweep_id="s1")
    rendered = {run.config.name: sweep.render(run, run.hosts[0]) for run in sweep.runs}
    assert sorted(rendered) == ["ep8_QUX-1", "ep8_no-QUX", "tp8_QUX-1", "tp8_no-QUX"]
    off = rendered["tp8_no-QUX"]
    assert off.env["FOO"] is None and "HF_TOKEN" not in off.secret_env and "export FOO" not in off.script
    lines = [line for line in off.script.splitlines() if line.startswith(("unset ", "export "))]
    shown = subprocess.run(["bash", "-c", "\n".join(lines) + "\nenv"], capture_output=True, text=True, check=True,
                           env={"PATH": os.environ["PATH"], "FOO": "outer", "HOSTVAR": "outer", "QUX": "outer",
                                "HF_TOKEN": "outer"}).stdout.splitlines()
    assert "BAR=keep" in shown and not [v for v in shown if v.split("=")[0] in ("FOO", "HOSTVAR", "QUX", "HF_TOKEN")]
    on = rendered["ep8_QUX-1"]
    assert "export QUX=1" in on.script and "export FOO=1" in on.script and "export HOSTVAR=h" in on.script
    assert "HF_TOKEN" in on.secret_env


def test_a_template_that_quotes_a_null_value_is_refused_naming_its_line(files, tmp_path):
    """A template of the team's own (or an older _common.sh.j2) quoting an unset variable would write
    `export NAME=None`; shquote refuses it, naming the template and its line, when the sweep loads."""
    (tmp_path / "mine.sh.j2").write_text("#!/bin/bash\nexport FOO={{ env.FOO | shquote }}\nexec true\n")
    playbook = PLAYBOOK.replace("profile: {mode: engine}", "profile: {mode: engine}\ntemplate: mine.sh.j2")
    playbook = playbook.replace("  - {name: tp8, args: {tp-size: 8}}",
                                "  - {name: tp8, args: {tp-size: 8}, env: {FOO: null}}")
    with pytest.raises(InputError) as e:
        load_sweep(*files(playbook), sweep_id="s1").validate()
    assert "mine.sh.j2:2" in str(e.value) and "null" in str(e.value)


def test_the_script_activates_the_venv_and_renders_template_values(files):
    sweep = load_sweep(*files(), sweep_id="s1")
    script = sweep.render(sweep.runs[0], sweep.runs[0].hosts[0]).script
    assert "source /opt/venv/bin/activate" in script
    assert "export SGLANG_TORCH_PROFILER_DIR=/tmp/hw/s1/tp8-1/profile" in script
    assert "python -m sglang.launch_server --model-path /models/m" in script


@pytest.mark.parametrize("line", ["exec python {{ tools.torchprof }} --dir {{ run.profile_dir | shquote }}",
                                  "exec python {{ tools.torchprof | shquote }} --dir {{ run.profile_dir | shquote }}"],
                         ids=["plain", "shquoted"])
def test_a_torch_window_template_runs_the_zipapps_torchprof_however_it_quotes(files, tmp_path, line):
    template = tmp_path / "own.sh.j2"
    template.write_text(line + " -- -m tinyserve\n")
    pb, inv = files(PLAYBOOK.replace("engine: sglang", "engine: openai").replace("mode: engine", "mode: torch")
                    + f"template: {template}\n", INVENTORY.replace("/tmp/hw", "\"/tmp/it's a $(dir)\""))
    sweep = load_sweep(pb, inv, sweep_id="s1")
    script = sweep.render(sweep.runs[0], sweep.runs[0].hosts[0]).script
    tools = f"/tmp/it's a $(dir)/.harness/{harness.__version__}-{hashlib.sha256(zipapp()).hexdigest()[:12]}"
    assert shlex.split(script.strip()) == ["exec", "python", f"{tools}/harness.pyz", "torchprof", "--dir",
                                           "/tmp/it's a $(dir)/s1/tp8-1/profile", "--", "-m", "tinyserve"]


def test_a_template_and_what_it_includes_are_read_again_when_edited(files, tmp_path):
    """Compiled templates are kept for the process (a sweep renders every run on every host): an edit
    on disk, to the template or to a file it includes, is still what the next render uses."""
    template, part = tmp_path / "own.sh.j2", tmp_path / "part.sh.j2"
    template.write_text("#!/bin/bash\necho first {{ config.name }}\n{% include 'part.sh.j2' %}\n")
    part.write_text("echo part one\n")
    pb, inv = files(PLAYBOOK + f"template: {template}\n")

    def script() -> str:
        sweep = load_sweep(pb, inv, sweep_id="s1")
        return sweep.render(sweep.runs[0], sweep.runs[0].hosts[0]).script

    assert script() == "#!/bin/bash\necho first tp8\necho part one\n"
    assert script() == "#!/bin/bash\necho first tp8\necho part one\n"
    template.write_text("#!/bin/bash\necho second {{ config.name }}\n{% include 'part.sh.j2' %}\n")
    part.write_text("echo part two\n")
    later = part.stat().st_mtime + 10   # a whole-second clock must not hide the edit
    os.utime(part, (later, later))
    assert script() == "#!/bin/bash\necho second tp8\necho part two\n"


def test_secrets_never_reach_the_script(files):
    sweep = load_sweep(*files(), sweep_id="s1")
    rendered = sweep.render(sweep.runs[0], sweep.runs[0].hosts[0])
    assert "hf_s3cr3t" not in rendered.script
    assert rendered.secret_env == {"HF_TOKEN": "hf_s3cr3t'$x"}
    assert "source /tmp/hw/s1/tp8-1/.secrets.env" in rendered.script
    assert sweep.redactor.text("token=hf_s3cr3t'$x") == "token=***"


@pytest.mark.parametrize("old, new, key, line", [
    ('HF_TOKEN: "hf_s3cr3t\'$x"', 'HF_TOKEN: "***"', "server.env.HF_TOKEN", 7),
    ("{name: ep8, args: {", "{name: ep8, args: {api-key: '***', ", "configs.1.args.api-key", 10),
    ("{name: ep8, args: {", "{name: ep8, args: {api-key: [a, '***'], ", "configs.1.args.api-key", 10),
])
def test_a_secret_masked_as_a_record_masks_it_is_refused_naming_its_key(files, old, new, key, line):
    """A playbook copied out of a run's record holds *** for each secret: run as it is, the server would
    get *** for its token or key."""
    with pytest.raises(InputError) as e:
        load_sweep(*files(PLAYBOOK.replace(old, new)))
    assert (e.value.key, e.value.line) == (key, line) and "***" in e.value.message
    load_sweep(*files(PLAYBOOK.replace('"hf_s3cr3t\'$x"', '"a***b"')))   # a value that holds *** is a value


def test_pool_runs_may_land_on_any_matching_host_and_each_pins_them(files):
    sweep = load_sweep(*files(), sweep_id="s1")
    assert [r.run_id for r in sweep.runs] == ["tp8-1", "ep8-1"]
    assert [h.name for h in sweep.runs[0].hosts] == ["g1", "g2"]
    sweep = load_sweep(*files(PLAYBOOK + "placement: each\nrepeat: 2\n"), sweep_id="s1")
    assert [r.run_id for r in sweep.runs][:4] == ["tp8-g1-1", "tp8-g2-1", "tp8-g1-2", "tp8-g2-2"]


def test_limit_narrows_the_playbook_hosts(files):
    sweep = load_sweep(*files(), limit="g2", sweep_id="s1")
    assert [h.name for h in sweep.hosts] == ["g2"]
    with pytest.raises(InputError, match="--limit"):
        load_sweep(*files(), limit="localhost")


@pytest.mark.parametrize("mutation, key, line", [
    (("tp-size: 8}", "tp-size: eight, x: [}"), None, 9),                       # broken YAML
    (("profile: {mode: engine}", "profile: {mode: engin}"), "profile.mode", 11),
    (("name: tp8, args", "name: tp8, argz"), "configs[0].argz", 9),
    (("name: t\n", "name: t\nrepeats: 2\n"), "repeats", 2),
    (("{{ run.profile_dir }}", "{{ run.profile_dri }}"), "server.env.SGLANG_TORCH_PROFILER_DIR", 7),
    (("name: ep8", "name: tp8"), "configs", 8),
])
def test_mistakes_name_the_file_the_key_and_the_line(files, mutation, key, line):
    old, new = mutation
    pb, inv = files(PLAYBOOK.replace(old, new))
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    assert e.value.file == str(pb)
    assert e.value.key == key
    assert e.value.line == line


def test_an_undefined_variable_in_the_template_names_the_template_and_line(files, tmp_path):
    template = tmp_path / "custom.sh.j2"
    template.write_text("#!/bin/bash\necho ok\necho {{ model.nope }}\n")
    pb, inv = files(PLAYBOOK + f"template: {template}\n")
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    assert e.value.file == str(template) and e.value.line == 3 and "nope" in str(e.value)


def test_a_flag_name_with_shell_characters_is_refused(files):
    pb, inv = files(PLAYBOOK.replace("tp-size: 8}", "'tp-size; touch /tmp/pwn': 8}", 1))
    with pytest.raises(InputError, match="not a valid flag name"):
        load_sweep(pb, inv)


def test_every_mistake_is_named_at_once_and_a_near_miss_says_what_was_meant(files):
    bad = PLAYBOOK.replace("profile: {mode: engine}", "profile: {mode: engin}\nbenchmark: {concurency: [1, 8]}")
    pb, inv = files(bad)
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    said = str(e.value)
    assert "benchmark.concurency: unknown key (did you mean 'concurrency'?)" in said
    assert "profile.mode" in said and said.count(str(pb)) == 2      # both, each with its file and line


def test_hosts_that_match_nothing_name_the_playbooks_line(files):
    pb, inv = files(PLAYBOOK.replace("hosts: gpu", "hosts: gpus"))
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    assert (e.value.file, e.value.key, e.value.line) == (str(pb), "hosts", 2)
    assert "'gpus' matches no host" in str(e.value)


def test_an_undefined_variable_is_said_in_words_with_what_exists(files, tmp_path):
    template = tmp_path / "custom.sh.j2"
    template.write_text("#!/bin/bash\necho {{ model.nope }}\n")
    pb, inv = files(PLAYBOOK + f"template: {template}\n")
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    assert "undefined template variable 'nope'" in str(e.value) and "dict object" not in str(e.value)
    assert "a template sees: " in str(e.value) and "model" in str(e.value)


def test_the_api_key_clients_must_send_is_found_among_the_secrets():
    from harness.secrets import api_key_env
    assert api_key_env({"api-key": "EnvRef"}, {"HARNESS_ARG_API_KEY": "k"}) == "HARNESS_ARG_API_KEY"
    assert api_key_env({"--api-key": "x"}, {"HARNESS_ARG_API_KEY": "k"}) == "HARNESS_ARG_API_KEY"
    assert api_key_env({"api-key": None}, {}) is None            # null removes the flag
    assert api_key_env({"tp-size": 8}, {"HF_TOKEN": "t"}) is None
    assert api_key_env({}, {"VLLM_API_KEY": "k"}) == "VLLM_API_KEY"


@pytest.mark.parametrize("name", ["HF_TOKEN", "hf-token", "api-key", "--api-key", "WANDB_API_KEY", "NGC_APIKEY",
                                  "apiKey", "AWS_SECRET_ACCESS_KEY", "ssl-keyfile-password", "DB_PASSWD"])
def test_names_with_a_secret_word_are_secret(name):
    from harness.secrets import is_secret
    assert is_secret(name)


@pytest.mark.parametrize("name", ["max-num-batched-tokens", "max-prefill-tokens", "max_new_tokens", "tokenizer",
                                  "tokenizer-mode", "skip-tokenizer-init", "TOKENIZERS_PARALLELISM", "ssl-keyfile",
                                  "kv-cache-dtype"])
def test_tuning_flags_and_settings_that_merely_contain_a_secret_word_stay_public(files, name):
    """A flag taken for a secret vanished from launch.sh into the secrets file, and its value (8192)
    read *** in every log and manifest."""
    from harness.secrets import is_secret
    assert not is_secret(name)
    pb, inv = files(PLAYBOOK.replace("{name: tp8, args: {tp-size: 8}}", f"{{name: tp8, args: {{{name}: 8192}}}}"))
    sweep = load_sweep(pb, inv, sweep_id="s1")
    rendered = sweep.render(sweep.runs[0], sweep.runs[0].hosts[0])
    assert f"--{name.lstrip('-')} 8192" in rendered.script and rendered.secret_env.keys() == {"HF_TOKEN"}
    assert sweep.redactor.text("max_model_len=8192") == "max_model_len=8192"


def test_a_secret_flag_of_several_values_or_a_number_goes_where_secrets_go(files):
    """vLLM's --api-key takes several keys (`[[k1, k2]]`); a key may be all digits. Every value travels
    in a variable of its own, and the redactor masks them, numbers included."""
    from harness.secrets import MASK, masked_args
    pb, inv = files(PLAYBOOK.replace("{name: tp8, args: {tp-size: 8}}",
                                     "{name: tp8, args: {api-key: [[sk-one-1111, sk-two-2222]], hf-token: 98765}}"))
    sweep = load_sweep(pb, inv, sweep_id="s1")
    rendered = sweep.render(sweep.runs[0], sweep.runs[0].hosts[0])
    assert '--api-key "$HARNESS_ARG_API_KEY" "$HARNESS_ARG_API_KEY_1"' in rendered.script
    assert '--hf-token "$HARNESS_ARG_HF_TOKEN"' in rendered.script
    assert "sk-one" not in rendered.script and "98765" not in rendered.script
    assert rendered.secret_env | {"HF_TOKEN": ""} == {"HF_TOKEN": "", "HARNESS_ARG_API_KEY": "sk-one-1111",
                                                      "HARNESS_ARG_API_KEY_1": "sk-two-2222",
                                                      "HARNESS_ARG_HF_TOKEN": "98765"}
    assert sweep.redactor.data({"a": [["sk-one-1111"], 98765, "x sk-two-2222"]}) == {"a": [[MASK], MASK, "x ***"]}
    assert masked_args({"api-key": [["a", "b"]], "max-tokens": 8, "hf-token": True}) == {
        "api-key": [[MASK, MASK]], "max-tokens": 8, "hf-token": True}


@pytest.mark.parametrize("server, key", [
    ("{health_path: health}", "server.health_path"),            # no leading /: http://HOST:PORThealth
    ("{host: 'a b'}", "server.host"),
    ("{host: '$(reboot)'}", "server.host"),
])
def test_server_values_that_would_break_a_url_are_refused_when_the_playbook_loads(files, server, key):
    pb, inv = files(f"name: t\nhosts: gpu\nengine: sglang\nmodel: {{path: /m}}\nserver: {server}\n"
                    "configs: [{name: a}]\n")
    with pytest.raises(InputError) as e:
        load_sweep(pb, inv)
    assert e.value.key == key


def test_an_ipv6_bind_address_is_bracketed_in_the_servers_url():
    from types import SimpleNamespace

    from harness.lifecycle.context import RunContext
    url = RunContext.base_url.fget
    assert url is not None
    for address, expected in (("::1", "http://[::1]:8000"), ("10.0.0.1", "http://10.0.0.1:8000")):
        assert url(SimpleNamespace(server_address=address, rendered=SimpleNamespace(port=8000))) == expected


def test_a_configuration_name_too_long_for_a_folder_is_refused(files):
    pb, inv = files(PLAYBOOK.replace("{name: tp8, args: {tp-size: 8}}", "{name: " + "x" * 260 + "}"))
    with pytest.raises(InputError, match="at most 200"):
        load_sweep(pb, inv)


def test_a_template_or_an_include_that_is_not_utf8_is_named(files, tmp_path):
    (tmp_path / "latin.sh.j2").write_bytes(b"#!/bin/bash\necho caf\xe9\n")
    (tmp_path / "outer.sh.j2").write_text('#!/bin/bash\n{% include "latin.sh.j2" %}\n')
    for template, said in (("latin.sh.j2", "the launch template is not UTF-8"),
                           ("outer.sh.j2", "a template it includes is not UTF-8")):
        pb, inv = files(PLAYBOOK + f"template: {template}\n")
        with pytest.raises(InputError, match=said) as e:
            load_sweep(pb, inv)
        assert e.value.file == str(tmp_path / template)


def test_an_inventorys_secret_host_variables_are_masked_where_the_host_is_recorded(files):
    """An inventory keeps variables the harness does not use (`sudo_pass`), or a token a template
    reads (`host.vars.hf_token`): sweep.json and every manifest record the host without them."""
    import json

    from harness.resume import sweep_record
    pb, inv = files(inventory=INVENTORY.replace("{address: 10.0.0.1}", "{address: 10.0.0.1, hf_token: hf_InvSecret42, "
                                                "sudo_pass: 'b3c0me!', gpus_per_node: 8}"))
    sweep = load_sweep(pb, inv, sweep_id="s1")
    recorded = json.dumps(sweep_record(sweep, started=0, finished=None, argv=[], kept=[]).model_dump(mode="json"))
    assert "hf_InvSecret42" not in recorded and "b3c0me!" not in recorded
    (g1,) = [h for h in sweep.hosts if h.name == "g1"]
    assert g1.public(sweep.redactor)["vars"] == {"hf_token": "***", "sudo_pass": "***", "gpus_per_node": 8}
    assert sweep.redactor.text("sudo -S <<< b3c0me!") == "sudo -S <<< ***"
