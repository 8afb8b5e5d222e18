"""A server on several hosts, as planned: each node's launch command (pinned in golden files, per
engine), the engine's multi-node flags as its adapter writes them, the template's node variables,
and the playbooks refused before any host is touched.

After an intended change: HARNESS_UPDATE_GOLDEN=1 pytest tests/unit/test_multinode.py
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from harness.errors import InputError
from harness.plan import load_sweep
from harness.sim.flags import parse as sim_parse
from tests.unit.test_rendered_commands import checker, golden_text

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "multinode"
UPDATE = os.environ.get("HARNESS_UPDATE_GOLDEN") == "1"
# planning touches no host: these addresses (TEST-NET-1) are never contacted
INVENTORY = """\
all:
  vars: {workdir: /srv/harness}
  children:
    gpu:
      vars: {venv: /opt/engine-venv}
      hosts:
        gpu-01: {address: 192.0.2.1}
        gpu-02: {address: 192.0.2.2}
        gpu-03: {address: 192.0.2.3}
"""


@pytest.fixture
def inventory(tmp_path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    return path


def node_scripts(playbook: Path, inventory: Path) -> dict[tuple[str, int], str]:
    """(config, node rank) -> that node's launch script, on the run's first hosts."""
    sweep = load_sweep(playbook, inventory, sweep_id="golden")
    out = {}
    for run in sweep.runs:
        nodes = run.hosts[:run.nodes]
        for rank, host in enumerate(nodes):
            out[run.config.name, rank] = sweep.render(run, host, nodes).script
    return out


def argv(script: str) -> list[str]:
    return checker.launch_argv(script)[1]


def flag_values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            for i, w in enumerate(words) if w == flag]


CASES = [(engine, config, rank) for engine, configs in
         (("sglang", ("tp16", "tp16-by-flag", "tp8-pp2")), ("vllm", ("tp8-pp2", "tp16-by-flag")))
         for config in configs for rank in (0, 1)]


@pytest.mark.parametrize("engine, config, rank", CASES, ids=[f"{e}.{c}.node{r}" for e, c, r in CASES])
def test_each_nodes_command_matches_its_golden_file(inventory, engine, config, rank):
    text = golden_text(node_scripts(GOLDEN / f"{engine}.yaml", inventory)[config, rank])
    path = GOLDEN / f"{engine}.{config}.node{rank}.txt"
    if UPDATE:
        path.write_text(text)
    assert path.is_file(), f"{path.name} is missing: run with HARNESS_UPDATE_GOLDEN=1"
    assert text == path.read_text(), "the rendered command changed: if intended, HARNESS_UPDATE_GOLDEN=1"


def test_every_multinode_golden_file_belongs_to_a_case():
    expected = {f"{e}.{c}.node{r}.txt" for e, c, r in CASES}
    assert sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in expected) == []


def test_sglang_nodes_get_their_rank_the_count_and_node_0s_address(inventory):
    scripts = node_scripts(GOLDEN / "sglang.yaml", inventory)
    for config in ("tp16", "tp16-by-flag", "tp8-pp2"):
        for rank in (0, 1):
            words = argv(scripts[config, rank])
            assert flag_values(words, "--nnodes") == ["2"]
            assert flag_values(words, "--node-rank") == [str(rank)]
            # node 0's inventory address and SGLang's rendezvous port; a value the playbook wrote gives way
            assert flag_values(words, "--dist-init-addr") == ["192.0.2.1:25000"]
            assert "--headless" not in words


def test_vllm_nodes_other_than_0_run_headless(inventory):
    scripts = node_scripts(GOLDEN / "vllm.yaml", inventory)
    for config in ("tp8-pp2", "tp16-by-flag"):
        for rank in (0, 1):
            words = argv(scripts[config, rank])
            assert flag_values(words, "--nnodes") == ["2"]
            assert flag_values(words, "--node-rank") == [str(rank)]
            assert flag_values(words, "--master-addr") == ["192.0.2.1"]
            assert flag_values(words, "--master-port") == ["29600"]   # server.rendezvous_port
            assert ("--headless" in words) == (rank > 0)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_simulator_reads_every_nodes_command_as_its_engine_does(inventory, engine):
    for (config, rank), script in node_scripts(GOLDEN / f"{engine}.yaml", inventory).items():
        ns = sim_parse(engine, argv(script))
        assert (ns.nnodes, ns.node_rank) == (2, rank), config
        if engine == "vllm":
            assert (ns.master_addr, ns.master_port, ns.headless) == ("192.0.2.1", 29600, rank > 0)
        else:
            assert ns.dist_init_addr == "192.0.2.1:25000"


def test_the_template_sees_the_nodes_rank_count_head_and_port(tmp_path, inventory):
    (tmp_path / "nodes.sh.j2").write_text(
        "exec echo {{ node_rank }} {{ node_count }} {{ head_address | shquote }} {{ rendezvous_port }} "
        "{{ nodes | join(',') }}\n")
    playbook = tmp_path / "pb.yaml"
    playbook.write_text("name: t\nhosts: gpu\nengine: openai\ntemplate: nodes.sh.j2\nmodel: {path: m}\n"
                        "server: {rendezvous_port: 4242}\nconfigs: [{name: two, nodes: 2}, {name: one}]\n")
    sweep = load_sweep(playbook, inventory, sweep_id="t")
    two, one = sweep.runs
    nodes = two.hosts[:2]
    assert [sweep.render(two, h, nodes).script.split()[2:] for h in nodes] == [
        ["0", "2", "192.0.2.1", "4242", "gpu-01,gpu-02"], ["1", "2", "192.0.2.1", "4242", "gpu-01,gpu-02"]]
    assert sweep.render(one, one.hosts[1]).script.split()[2:] == ["0", "1", "192.0.2.2", "4242", "gpu-02"]
    assert (two.nodes, one.nodes) == (2, 1)


def playbook_with(tmp_path: Path, configs: str, extra: str = "") -> Path:
    path = tmp_path / "pb.yaml"
    path.write_text(f"name: t\nhosts: gpu\nengine: sglang\nmodel: {{path: m}}\n{extra}configs:\n{configs}")
    return path


def test_more_nodes_than_hosts_is_refused_naming_the_configuration_and_its_line(tmp_path, inventory):
    playbook = playbook_with(tmp_path, "  - {name: small, nodes: 2}\n  - {name: huge, nodes: 4}\n")
    with pytest.raises(InputError) as raised:
        load_sweep(playbook, inventory)
    message = str(raised.value)
    assert f"{playbook}:7: configs.1.nodes: configuration huge: a server on 4 hosts" in message
    assert "are 3: gpu-01, gpu-02, gpu-03" in message


def test_nodes_implied_by_the_engines_own_flag_count_too(tmp_path, inventory):
    playbook = playbook_with(tmp_path, "  - {name: big, args: {nnodes: 5}}\n")
    with pytest.raises(InputError, match=r"configs\.0\.args: configuration big: a server on 5 hosts"):
        load_sweep(playbook, inventory)
    sweep = load_sweep(playbook_with(tmp_path, "  - {name: ok, args: {nnodes: 3}}\n"), inventory)
    assert sweep.runs[0].nodes == 3


def test_nodes_and_a_different_nnodes_flag_are_refused(tmp_path, inventory):
    playbook = playbook_with(tmp_path, "  - {name: mixed, nodes: 2, args: {nnodes: 3}}\n")
    with pytest.raises(InputError, match="nodes is 2 but its flags say 3"):
        load_sweep(playbook, inventory)


def test_a_run_on_several_hosts_cannot_be_pinned_to_one(tmp_path, inventory):
    playbook = playbook_with(tmp_path, "  - {name: two, nodes: 2}\n", extra="placement: each\n")
    with pytest.raises(InputError, match="needs placement: pool"):
        load_sweep(playbook, inventory)


def test_a_matrix_keeps_the_nodes_of_its_configurations(tmp_path, inventory):
    playbook = playbook_with(tmp_path, "  - {name: two, nodes: 2}\n",
                             extra="matrix: {axes: {args.tp-size: [8, 16]}}\n")
    assert [r.nodes for r in load_sweep(playbook, inventory).runs] == [2, 2]


def test_one_host_renders_no_multinode_flag(tmp_path, inventory):
    script = node_scripts(playbook_with(tmp_path, "  - {name: one, args: {tp-size: 8}}\n"), inventory)["one", 0]
    assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(shlex.split(script))


# -- the pool: a run on several hosts takes them all at once ---------------------------------------

def scheduler(tmp_path: Path, configs: str):
    """An executor over four local hosts (none is connected: only the choice of hosts is exercised)."""
    from harness.executor import Executor
    inventory = tmp_path / "local.yaml"
    inventory.write_text("all:\n  hosts:\n" + "".join(
        f"    {h}: {{transport: local, venv: /opt/venv, workdir: {tmp_path / h}}}\n" for h in "abcd"))
    playbook = tmp_path / "pool.yaml"
    playbook.write_text(f"name: pool\nhosts: all\nengine: sim\nmodel: {{path: m}}\nconfigs:\n{configs}")
    executor = Executor(load_sweep(playbook, inventory), tmp_path / "results")
    return executor, executor.pool.states


def taken(executor, state) -> tuple[str, list[str]]:
    spec = executor._take(state)
    return spec.run_id, [p.host.name for p in executor.peers.get(spec.run_id, [])]


def test_a_run_on_several_hosts_takes_free_ones_together_and_the_runs_behind_it_wait(tmp_path):
    executor, hosts = scheduler(tmp_path, "  - {name: x, nodes: 3}\n  - {name: y, nodes: 3}\n  - {name: z}\n")
    assert taken(executor, hosts["a"]) == ("x-1", ["b", "c"])
    assert executor.busy == {"a", "b", "c"}
    # d alone cannot start y (three hosts), and z behind y does not pass it: nothing is half-held
    assert executor._free_peers(executor.todo[0], hosts["d"]) is None
    executor.stop.set()                      # _take returns at once instead of waiting for a release
    assert executor._take(hosts["d"]) is None and [s.run_id for s in executor.todo] == ["y-1", "z-1"]
    executor.stop.clear()
    executor._release(next(s for s in executor.sweep.runs if s.run_id == "x-1"))   # x done: its hosts free
    executor._free(hosts["a"])
    assert executor.busy == set()
    assert taken(executor, hosts["d"]) == ("y-1", ["a", "b"])
    assert taken(executor, hosts["c"]) == ("z-1", [])
    assert executor.busy == {"a", "b", "c", "d"}


def test_a_host_serving_as_another_runs_node_takes_nothing_until_released(tmp_path):
    executor, hosts = scheduler(tmp_path, "  - {name: x, nodes: 2}\n  - {name: z}\n")
    assert taken(executor, hosts["a"]) == ("x-1", ["b"])
    executor.stop.set()
    assert executor._take(hosts["b"]) is None      # b is x's node 1: z goes elsewhere
    executor.stop.clear()
    assert taken(executor, hosts["c"]) == ("z-1", [])


def test_dead_hosts_are_never_taken_as_nodes(tmp_path):
    executor, hosts = scheduler(tmp_path, "  - {name: x, nodes: 3}\n")
    hosts["b"].dead = True
    assert taken(executor, hosts["a"]) == ("x-1", ["c", "d"])


def test_every_nodes_lease_is_renewed_by_its_own_hosts_heartbeat(tmp_path):
    from harness.lifecycle.context import Node, RunContext
    executor, hosts = scheduler(tmp_path, "  - {name: x, nodes: 2}\n")
    spec = executor.sweep.runs[0]
    ctx = RunContext.of(executor.sweep, spec, [Node(hosts["a"].host, None), Node(hosts["b"].host, None)],
                        executor.layout.run(spec.run_id))
    executor.in_flight[spec.run_id] = ctx
    (beat_a,), (beat_b,) = executor._beats("a"), executor._beats("b")
    assert beat_a.lease == f"{tmp_path / 'a'}/{executor.sweep.sweep_id}/x-1/lease"
    assert beat_b.lease == f"{tmp_path / 'b'}/{executor.sweep.sweep_id}/x-1.node1/lease"
    assert executor._beats("c") == []
    assert ctx.peers[0].local_dir == executor.layout.run("x-1").dir / "nodes" / "node1"
