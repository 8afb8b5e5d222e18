"""`matrix:`: a product of axes with exclude, include and link; readable run ids; every mistake named
with its key and line before any host; the plan shows each run."""

from __future__ import annotations

import json

import pytest

from harness.config.matrix import point_name, points
from harness.errors import InputError
from harness.plan import load_sweep
from tests.conftest import harness

INVENTORY = "all:\n  hosts:\n    localhost: {transport: local, venv: /opt/venv}\n"

PLAYBOOK = """\
name: grid
hosts: localhost
engine: vllm
model: {path: /models/m}
benchmark: {concurrency: [1, 8], max_tokens: 32}
matrix:
  axes:
    args.tensor-parallel-size: [1, 2]
    args.enforce-eager: [true, false]
    benchmark.concurrency: [8, 64]
  exclude:
    - {args.tensor-parallel-size: 1, args.enforce-eager: true}
  include:
    - {args.tensor-parallel-size: 4, benchmark.concurrency: 256}
  link: {args.max-num-seqs: benchmark.concurrency}
"""


def load(tmp_path, playbook: str = PLAYBOOK):
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "pb.yaml").write_text(playbook)
    return load_sweep(tmp_path / "pb.yaml", tmp_path / "inventory.yaml")


def test_points_are_the_product_less_the_excluded_plus_the_included_with_links_applied():
    got = points({"args.tp": [1, 2], "args.eager": [True, False]},
                 exclude=[{"args.tp": 1, "args.eager": True}], include=[{"args.tp": 8}],
                 link={"env.TP": "args.tp"})
    assert got == [{"args.tp": 1, "args.eager": False, "env.TP": 1},
                   {"args.tp": 2, "args.eager": True, "env.TP": 2},
                   {"args.tp": 2, "args.eager": False, "env.TP": 2},
                   {"args.tp": 8, "env.TP": 8}]


def test_a_point_is_named_by_its_values():
    assert point_name({"args.tensor-parallel-size": 2, "args.enforce-eager": True, "env.NCCL_ALGO": "Ring",
                       "args.--cuda-graph-sizes": [1, 2, 4], "args.x": False}) == \
        "tensor-parallel-size-2_enforce-eager_NCCL_ALGO-Ring_cuda-graph-sizes-1-2-4_no-x"
    assert point_name({"env.PATHY": "/a b/c"}) == "PATHY-a-b-c"


def test_each_point_is_a_run_with_its_flags_its_benchmark_and_the_linked_batch_size(tmp_path):
    sweep = load(tmp_path)
    ids = [r.run_id for r in sweep.runs]
    assert ids == ["tensor-parallel-size-1_no-enforce-eager_concurrency-8-1",
                   "tensor-parallel-size-1_no-enforce-eager_concurrency-64-1",
                   "tensor-parallel-size-2_enforce-eager_concurrency-8-1",
                   "tensor-parallel-size-2_enforce-eager_concurrency-64-1",
                   "tensor-parallel-size-2_no-enforce-eager_concurrency-8-1",
                   "tensor-parallel-size-2_no-enforce-eager_concurrency-64-1",
                   "tensor-parallel-size-4_concurrency-256-1"]
    run = sweep.runs[3]
    assert run.benchmark.concurrency == [64] and run.benchmark.max_tokens == 32   # the rest: the playbook's
    rendered = sweep.render(run, sweep.hosts[0])
    assert "--tensor-parallel-size 2" in rendered.script and "--enforce-eager" in rendered.script
    assert "--max-num-seqs 64" in rendered.script                                 # linked to the concurrency
    assert "--no-enforce-eager" not in sweep.render(sweep.runs[0], sweep.hosts[0]).script


def test_configs_and_a_matrix_cross(tmp_path):
    sweep = load(tmp_path, PLAYBOOK.split("matrix:")[0] + """\
configs:
  - {name: graphs}
  - {name: fp8, args: {kv-cache-dtype: fp8}}
matrix:
  axes: {args.max-num-seqs: [8, 64]}
""")
    assert [r.run_id for r in sweep.runs] == ["graphs_max-num-seqs-8-1", "graphs_max-num-seqs-64-1",
                                              "fp8_max-num-seqs-8-1", "fp8_max-num-seqs-64-1"]
    assert "--kv-cache-dtype fp8" in sweep.render(sweep.runs[3], sweep.hosts[0]).script


@pytest.mark.parametrize("matrix, key, words", [
    ("axes: {tp: [1, 2]}", "matrix.axes", "an axis is args.FLAG, env.NAME or benchmark.FIELD"),
    ("axes: {benchmark.concurency: [1]}", "matrix.axes", "no field 'concurency'"),
    ("axes: {args.tp: []}", "matrix.axes", "at least one value"),
    ("axes: {args.tp: [1, 1]}", "matrix.axes", "a value appears twice"),
    ("axes: {env.BAD NAME: [1]}", "matrix.axes", "not a valid environment variable name"),
    ("axes: {args.tp: [1]}\n  exclude: [{args.ep: 1}]", "matrix", "'args.ep' is not an axis"),
    ("axes: {args.tp: [1]}\n  link: {args.max-num-seqs: benchmark.concurrency}", "matrix",
     "'benchmark.concurrency' is not an axis"),
    ("axes: {benchmark.concurrency: [0]}", "matrix.benchmark.concurrency", "concurrency levels must be >= 1"),
    # an exclude that matches no point left every point in without a word
    ("axes: {args.tp: [1, 2]}\n  exclude: [{args.tp: 3}]", "matrix", "3 is none of the axis's values (1, 2)"),
    ("axes: {args.enforce-eager: [true, false]}\n  exclude: [{args.enforce-eager: 'true'}]", "matrix",
     "'true' is none of the axis's values (True, False)"),
    # its values would name the runs and their folders
    ("axes: {env.HF_TOKEN: [hf_a1, hf_b2]}", "matrix.axes.env.HF_TOKEN", "which no matrix axis or include may set"),
    ("axes: {args.api-key: [sk-1, sk-2]}", "matrix.axes.args.api-key", "which no matrix axis or include may set"),
    # a name the playbook lists under `secrets:`, which the matrix alone does not know
    ("axes: {args.tp: [1]}\n  include: [{args.tp: 2, env.ORG_PASSPHRASE: s3cr3t}]\nsecrets: [ORG_PASSPHRASE]",
     "matrix.include.0", "env.ORG_PASSPHRASE is a secret"),
])
def test_a_matrix_mistake_is_named_with_its_key_and_line(tmp_path, matrix, key, words):
    with pytest.raises(InputError) as e:
        load(tmp_path, PLAYBOOK.split("matrix:")[0] + "matrix:\n  " + matrix + "\n")
    assert words in str(e.value) and e.value.key.startswith(key)
    assert e.value.line is not None and e.value.line >= 6


def test_a_playbook_needs_configs_or_a_matrix(tmp_path):
    with pytest.raises(InputError, match="needs `configs:`"):
        load(tmp_path, PLAYBOOK.split("matrix:")[0])


def test_harness_plan_shows_the_count_and_each_run_before_any_host(tmp_path):
    load(tmp_path)
    table = harness("plan", tmp_path / "pb.yaml", "-i", tmp_path / "inventory.yaml")
    assert table.returncode == 0, table.stderr
    assert "7 runs" in table.stdout and "tensor-parallel-size-4_concurrency-256-1" in table.stdout
    listed = harness("plan", tmp_path / "pb.yaml", "-i", tmp_path / "inventory.yaml", "--format", "json")
    assert len(json.loads(listed.stdout)) == 7


@pytest.mark.parametrize("rules, words", [
    # an empty entry matches every point: the sweep ran nothing and ended ok
    ("exclude: [{}]", "matrix.exclude[0] is empty: it matches every point"),
    ("exclude: [{args.tensor-parallel-size: 1}, {args.tensor-parallel-size: 2}]",
     "matrix.exclude leaves out every point of the matrix (2): nothing would run"),
])
def test_a_matrix_that_leaves_no_point_to_run_is_refused(tmp_path, rules, words):
    with pytest.raises(InputError) as e:
        load(tmp_path, PLAYBOOK.split("matrix:")[0] + "matrix:\n  axes: {args.tensor-parallel-size: [1, 2]}\n  "
             + rules + "\n")
    assert words in str(e.value) and e.value.file is not None and e.value.file.endswith("pb.yaml")
    # the matrix's key and line, not the playbook's first line
    assert (e.value.key, e.value.line) == ("matrix", PLAYBOOK.split("matrix:")[0].count("\n") + 1)
    shown = harness("plan", tmp_path / "pb.yaml", "-i", tmp_path / "inventory.yaml")
    assert shown.returncode == 2 and words in shown.stderr, shown.stdout + shown.stderr


def test_an_include_of_true_is_its_own_point_not_the_point_of_1(tmp_path):
    """`--x` (true) and `--x 1` are two servers; Python finds True == 1 and the include was dropped."""
    sweep = load(tmp_path, PLAYBOOK.split("matrix:")[0] + "matrix:\n  axes: {args.x: [1, 2]}\n"
                 "  include: [{args.x: true}, {args.x: 2}]\n")
    assert [r.run_id for r in sweep.runs] == ["x-1-1", "x-2-1", "x-1"]
    assert sweep.render(sweep.runs[2], sweep.hosts[0]).script.rstrip().endswith("--x")


def test_a_point_name_too_long_for_a_folder_keeps_its_start_and_ends_in_a_hash(tmp_path):
    """JSON and paths as values (vLLM's --speculative-config) made names over a folder's 200 characters,
    which no shorter axis value could fix: each point is named within it, and two stay two."""
    spec = "{method: eagle3, model: /models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B-draft-model-of-a-long-name, " \
           "num_speculative_tokens: N}"
    sweep = load(tmp_path, PLAYBOOK.split("matrix:")[0] + "matrix:\n  axes:\n    args.speculative-config: ["
                 + ", ".join(spec.replace("N", str(n)) for n in (3, 5)) + "]\n"
                 "    args.max-num-batched-tokens-per-scheduler-step-in-prefill: [8192, 16384]\n"
                 "    args.enable-chunked-prefill-for-requests-of-long-context: [true]\n")
    names = [r.config.name for r in sweep.runs]
    assert len(set(names)) == 4 and all(len(n) <= 160 for n in names)
    assert all(n.startswith("speculative-config-method-eagle3-model-models-yuhuili-EAGLE3") for n in names)
    assert point_name({"args.x": "a" * 300}) == point_name({"args.x": "a" * 300})   # stable for --resume
    assert point_name({"args.x": "a" * 300}) != point_name({"args.x": "a" * 299})
    assert point_name({"args.x": "a" * 100}) == "x-" + "a" * 100                   # short names as before


def test_a_long_configuration_name_and_a_long_point_make_one_name_within_a_folder_s(tmp_path):
    """A configuration named in 150 characters crossed with a point of 160 made a name of 311: the
    matrix refused it, and a search's trial stopped with pydantic's traceback."""
    base = "c" * 150
    sweep = load(tmp_path, PLAYBOOK.split("matrix:")[0] + f"configs: [{{name: {base}}}]\nmatrix:\n  axes:\n"
                 "    args.x: [" + ", ".join("a" * 300 + str(n) for n in (1, 2)) + "]\n")
    names = [r.config.name for r in sweep.runs]
    assert len(set(names)) == 2 and all(len(n) <= 200 and n.startswith(base + "_x-aaa") for n in names)
    search = (PLAYBOOK.split("matrix:")[0] + f"configs: [{{name: {base}}}]\nsearch:\n  optuna:\n    space:\n"
              "      args.x: [" + ", ".join("a" * 300 + str(n) for n in (1, 2)) + "]\n    budget: 2\n")
    shown = harness("plan", write(tmp_path, search), "-i", tmp_path / "inventory.yaml", "--format", "json")
    assert shown.returncode == 0, shown.stderr
    (entry,) = json.loads(shown.stdout)
    assert len(entry["config"]) <= 200 and entry["config"].startswith(base + "_x-aaa")


def write(tmp_path, playbook: str):
    (tmp_path / "pb.yaml").write_text(playbook)
    return tmp_path / "pb.yaml"


def test_a_secret_in_an_include_is_refused_as_a_secret_axis_is(tmp_path):
    """Its value named the run: `x-2_HF_TOKEN-hf_...-1` in run ids, folders, the journal and the report."""
    with pytest.raises(InputError) as e:
        load(tmp_path, PLAYBOOK.split("matrix:")[0] + "matrix:\n  axes: {args.x: [1]}\n"
             "  include: [{args.x: 2, env.HF_TOKEN: hf_s3cr3tvalue}]\n")
    assert "matrix.include[0]: env.HF_TOKEN is a secret" in str(e.value) and "s3cr3t" not in str(e.value)
    shown = harness("plan", tmp_path / "pb.yaml", "-i", tmp_path / "inventory.yaml")
    assert shown.returncode == 2 and "s3cr3t" not in shown.stdout + shown.stderr
