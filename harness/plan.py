"""From inventory + playbook + template to the list of runs, each with its rendered launch script.

Everything here is pure: nothing touches a host, so `harness plan` and `harness sweep --dry-run` show
exactly what would run, and every mistake (an undefined template variable included) surfaces as an
InputError before the first SSH connection.

Run ids begin with the configuration name: `tp8-1` (pool placement, repeat 1) or `tp8-gpu01-1`
(placement `each`). They are stable, so `--resume` can match a journal to a plan.
"""

from __future__ import annotations

import datetime as dt
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import harness
from harness.config import space
from harness.config.inventory import Host, Inventory, load_inventory
from harness.config.playbook import Benchmark, Config, Playbook, load_playbook
from harness.config.yamlfile import Loc, YamlDoc
from harness.engines import Engine, NodeInfo, engine_for
from harness.errors import InputError
from harness.remote import ZIPAPP, remote_dir, tool_words
from harness.render import (
    BUILTIN_TEMPLATES,
    ShellWords,
    builtin_templates,
    hide_flag_value,
    render_string,
    render_template,
)
from harness.results.layout import HostRunLayout
from harness.secrets import MASK, Redactor, arg_env_name, is_secret


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    config: Config
    repeat: int                    # 1-based
    hosts: tuple[Host, ...]        # where it may run: the pool's hosts, or the one host of `each`
    benchmark: Benchmark           # the playbook's, with the configuration's own settings over it
    nodes: int = 1                 # hosts one server spans: node 0 serves and benchmarks


@dataclass
class Rendered:
    script: str
    args: dict[str, Any]
    env: dict[str, str | None]     # public env (in the script; None: unset there)
    secret_env: dict[str, str]     # reaches the host in a 0600 file, never in the script
    port: int
    paths: HostRunLayout
    node: NodeInfo | None = None   # which node of how many this script is (node 0 of 1 on one host)


@dataclass
class Sweep:
    playbook: Playbook
    doc: YamlDoc
    inventory: Inventory
    hosts: list[Host]
    engine: Engine
    template: Path
    sweep_id: str
    runs: list[RunSpec] = field(default_factory=list)

    @property
    def secret_names(self) -> list[str]:
        return [*self.playbook.secrets, *{s for h in self.hosts for s in h.secrets}]

    @property
    def redactor(self) -> Redactor:
        values = [v for h in self.hosts for v in h.secret_values]
        for env in [self.playbook.server.env, *(c.env for c in self.playbook.all_configs),
                    *(h.env for h in self.hosts)]:
            values += [v for k, v in env.items() if v is not None and is_secret(k, self.secret_names)]
        for args in [self.playbook.server.args, *(c.args for c in self.playbook.all_configs)]:
            for flag, value in args.items():
                if is_secret(flag, self.secret_names):
                    values += hide_flag_value(value, arg_env_name(flag))[1].values()
        return Redactor(values)

    def render(self, run: RunSpec, host: Host, nodes: Sequence[Host] = ()) -> Rendered:
        """The launch script of `run` on `host`; for a server on several hosts, `nodes` lists them
        (node 0 first, `host` among them) and the script is that node's, with the engine's own
        multi-node flags (`Engine.node_args`) over the configuration's."""
        pb = self.playbook
        port = pb.server.port or self.engine.default_port
        tools = remote_dir(host.workdir)
        nodes = list(nodes) or [host]
        rank = next(i for i, n in enumerate(nodes) if n.name == host.name)
        paths = HostRunLayout.of(host.workdir, self.sweep_id, run.run_id, rank)
        node = NodeInfo(rank=rank, count=len(nodes), head_address=node_address(nodes[0]),
                        rendezvous_port=pb.server.rendezvous_port or self.engine.rendezvous_port)
        base: dict[str, Any] = {
            "run": {"id": run.run_id, "repeat": run.repeat, "sweep_id": self.sweep_id, "dir": paths.root,
                    "profile_dir": paths.profile_dir, "log": paths.log, "pid_file": paths.pid_file,
                    "secrets_file": paths.secrets_file},
            "host": host.model_dump(mode="json", exclude={"env"}),
            "config": {"name": run.config.name, "description": run.config.description},
            "model": pb.model.model_dump() | {"name": pb.model.name},
            "engine": self.engine.name, "flavor": self.engine.speaks, "launcher": self.engine.launcher,
            "profile": pb.profile.model_dump(), "benchmark": run.benchmark.model_dump(),
            "vars": pb.vars, "playbook": {"name": pb.name}, "harness_version": harness.__version__,
            "nodes": [n.name for n in nodes], "node_rank": node.rank, "node_count": node.count,
            "head_address": node.head_address, "rendezvous_port": node.rendezvous_port, "port": port,
            # tools.torchprof: the words after `python` that run a server under torchprof, quoted
            "tools": {"dir": tools, "pyz": f"{tools}/{ZIPAPP}",
                      "torchprof": ShellWords(tool_words(tools, "torchprof"))},
            "server": {"port": port, "host": pb.server.host, "startup_timeout_s": pb.server.startup_timeout_s},
        }
        at = run.config.at
        args = self._merged(base, [(("server", "args"), pb.server.args), ((*at, "args"), run.config.args)])
        if node.count > 1:   # the engine's adapter writes these for every node; the playbook's give way
            written = {f.lstrip("-") for f in self.engine.node_flags}
            args = {k: v for k, v in args.items() if k.lstrip("-") not in written} | self.engine.node_args(node)
        env = self._merged(base, [(None, host.env), (("server", "env"), pb.server.env),
                                  ((*at, "env"), run.config.env)])
        secret = {k: v for k, v in env.items() if v is not None and is_secret(k, self.secret_names)}
        public = {k: v for k, v in env.items() if k not in secret}
        for flag, value in list(args.items()):   # `api-key: ...`: the value goes where secrets go
            if is_secret(flag, self.secret_names):
                args[flag], held = hide_flag_value(value, arg_env_name(flag))
                secret |= held
        context = base | {"args": args, "env": public, "secret_names": sorted(secret),
                          "server": base["server"] | {"args": args, "env": public}}
        return Rendered(render_template(self.template, context), args, public, secret, port, paths, node)

    def _merged(self, context: dict, layers: list[tuple[Loc | None, dict]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for loc, layer in layers:
            for key, value in layer.items():
                out[key] = self._render_value(value, context, loc + (key,) if loc else None,
                                              secret=is_secret(key, self.secret_names))
        return out

    def _render_value(self, value: Any, context: dict, loc: Loc | None, *, secret: bool = False) -> Any:
        if isinstance(value, str):
            where = ".".join(str(p) for p in loc) if loc else "inventory env"
            try:
                return render_string(value, context, where=where, file=str(self.doc.path) if loc else None,
                                     line=self.doc.line(loc) if loc else None)
            except InputError as e:
                if not secret:
                    raise
                # Jinja's message quotes the text it stumbled on: a piece of the secret
                raise InputError("a secret's value that is not a valid template (its text is not shown); "
                                 "braces a value must keep are written {{ '{{' }} and {{ '{%' }}",
                                 file=e.file, key=e.key, line=e.line) from None
        if isinstance(value, list):
            return [self._render_value(v, context, loc, secret=secret) for v in value]
        return value

    def validate(self) -> None:
        """Render every run for every host it may land on (every node of a run on several hosts, on
        the first of its hosts): all template errors, before any host."""
        for run in self.runs:
            if run.nodes > 1:
                nodes = run.hosts[:run.nodes]
                for host in nodes:
                    self.render(run, host, nodes)
                continue
            for host in run.hosts:
                self.render(run, host)


def node_address(host: Host) -> str:
    """Where the other nodes reach `host` (node 0's rendezvous): its inventory address, else its name."""
    if host.address:
        return host.address
    return "127.0.0.1" if host.transport == "local" else host.name


def find_template(path: str | None, engine: Engine, playbook_path: Path) -> Path:
    """The launch template. `template:` names one: beside the playbook, in the folder above it or in
    the current folder, else the built-in of that file name when `template:` is a bare name or
    `templates/NAME` (the built-ins' own folder): a path to elsewhere that is not there is a mistake,
    never a built-in taken in its place. Without it, a `templates/<engine's
    template>` beside the playbook (or one folder up, or in the current folder) wins over the built-in,
    so a team can keep its own next to its playbooks. Either may include the built-in `_common.sh.j2`."""
    bases = (playbook_path.parent, playbook_path.parent.parent, Path.cwd())
    if path:
        candidate = Path(path).expanduser()
        if candidate.is_absolute():
            found = [candidate] if candidate.is_file() else []
        else:
            found = [base / candidate for base in bases if (base / candidate).is_file()]
        if found:
            return found[0].absolute()
        builtin = BUILTIN_TEMPLATES / candidate.name
        if candidate.parent in (Path("."), Path("templates")) and builtin.is_file():
            return builtin
        where = ("" if candidate.is_absolute() else
                 f" (looked beside the playbook, above it, in {Path.cwd()}"
                 + (f" and among the built-in templates: {', '.join(builtin_templates())})"
                    if candidate.parent in (Path("."), Path("templates")) else ")"))
        raise InputError(f"launch template {path!r} not found{where}", file=str(playbook_path), key="template")
    for base in bases:
        for local in (base / engine.template, base / "templates" / engine.template):
            if local.is_file():
                return local.absolute()
    return BUILTIN_TEMPLATES / engine.template


def run_nodes(config: Config, engine: Engine | None, hosts: list[Host], pb: Playbook,
              doc: YamlDoc | None = None) -> int:
    """The hosts one server of `config` spans: `nodes:`, or what the engine's flags say (`--nnodes`);
    refused, before any host is touched, when they disagree or there are not that many hosts."""
    file = str(doc.path) if doc else None
    where = (*config.at, "nodes") if "nodes" in config.model_fields_set else (*config.at, "args")

    def refuse(message: str) -> InputError:
        return InputError(f"configuration {config.name}: {message}", file=file, key=".".join(map(str, where)),
                          line=doc.line(where) if doc else None)

    implied = 1
    if engine is not None:
        args = {**pb.server.args, **config.args}
        try:
            implied = engine.nodes(args)
        except InputError as e:
            raise refuse(e.message) from None
    nodes = config.nodes
    if "nodes" in config.model_fields_set and implied > 1 and implied != nodes:
        raise refuse(f"nodes is {nodes} but its flags say {implied} (--nnodes): give one of them")
    nodes = max(nodes, implied)
    if nodes > 1 and pb.placement == "each":
        raise refuse(f"a server on {nodes} hosts needs placement: pool (each pins a run to one host)")
    if nodes > len(hosts):
        raise refuse(f"a server on {nodes} hosts, but the playbook's hosts ({pb.hosts!r}) are "
                     f"{len(hosts)}: {', '.join(h.name for h in hosts)}")
    return nodes


def expand(pb: Playbook, hosts: list[Host], doc: YamlDoc | None = None, engine: Engine | None = None
           ) -> list[RunSpec]:
    runs = []
    for config in pb.all_configs:
        nodes = run_nodes(config, engine, hosts, pb, doc)
        try:
            bench = Benchmark.model_validate(pb.benchmark.model_dump() | config.benchmark)
        except ValidationError as e:
            first = e.errors()[0]
            where = (*config.at, "benchmark", *first["loc"])
            raise InputError(f"configuration {config.name}: {first['msg']}", file=str(doc.path) if doc else None,
                             key=".".join(map(str, where)), line=doc.line(where) if doc else None) from None
        for rep in range(1, pb.repeat + 1):
            if pb.placement == "pool":
                runs.append(RunSpec(f"{config.name}-{rep}", config, rep, tuple(hosts), bench, nodes))
            else:
                runs += [RunSpec(f"{config.name}-{h.name}-{rep}", config, rep, (h,), bench) for h in hosts]
    return runs


def search_run(sweep: Sweep, point: dict[str, Any]) -> RunSpec:
    """The run of one point of `search.optuna`'s space: its values over the playbook's configuration,
    once, on whichever host is free; its id says its values, as a matrix point's does."""
    pb = sweep.playbook
    assert pb.optuna is not None  # only a searching playbook has points
    config = pb.optuna.config(pb.configs, point)
    try:
        bench = Benchmark.model_validate(pb.benchmark.model_dump() | config.benchmark)
    except ValidationError as e:
        first = e.errors()[0]
        where = ("search", "optuna", "space")
        raise InputError(f"the point {config.name}: benchmark.{'.'.join(map(str, first['loc']))}: {first['msg']}",
                         file=str(sweep.doc.path), key=".".join(where), line=sweep.doc.line(where)) from None
    return RunSpec(f"{config.name}-1", config, 1, tuple(sweep.hosts), bench)


def search_plan(sweep: Sweep) -> dict[str, Any]:
    """What `harness plan` says of a search: its settings, its space and the first point's script."""
    settings = sweep.playbook.optuna
    assert settings is not None  # only a searching playbook is planned as a search
    example = search_run(sweep, space.first_point(settings.space))
    host = sweep.hosts[0]
    return {"sampler": "tpe", "budget": settings.budget, "objective": settings.objective,
            "direction": "maximize" if settings.maximize else "minimize", "level": settings.level,
            "patience": settings.patience, "random_state": settings.random_state,
            "startup_trials": settings.startup_trials, "space": space.describe(settings.space),
            "grid_size": space.size(settings.space), "hosts": [h.name for h in sweep.hosts],
            "example": {"run_id": example.run_id, "config": example.config.name, "host": host.name,
                        "script": sweep.render(example, host).script}}


def new_sweep_id(name: str) -> str:
    return f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _refuse_masked_secrets(sweep: Sweep) -> None:
    """A secret whose value is ***: a playbook copied from a run's record (`harness reproduce` writes
    one, secrets masked), run as it is. The server would be launched with *** for a token or key."""
    pb, doc = sweep.playbook, sweep.doc
    sections: list[tuple[Loc, dict[str, Any], dict[str, Any]]] = [(("server",), pb.server.env, pb.server.args)]
    sections += [(c.at, c.env, c.args) for c in pb.all_configs if c.at]
    for at, env, args in sections:
        for part, values in (("env", env), ("args", args)):
            for name, value in values.items():
                if is_secret(name, sweep.secret_names) and (value == MASK or isinstance(value, list) and MASK in value):
                    where: Loc = (*at, part, name)
                    raise InputError(f"is {MASK}, a secret as a run's record masks it, not its value: give the "
                                     "value itself here (`harness reproduce RUN_DIR` takes it from the environment)",
                                     file=str(doc.path), key=".".join(map(str, where)), line=doc.line(where))


def load_sweep(playbook_path: Path | str, inventory_path: Path | str, *, limit: str | None = None,
               sweep_id: str | None = None) -> Sweep:
    """Load and validate everything; raises InputError naming file, key and line."""
    playbook_path = Path(playbook_path)
    pb, doc = load_playbook(playbook_path)
    inventory = load_inventory(inventory_path)
    try:
        hosts = inventory.select(pb.hosts, what="hosts")
    except InputError as e:   # name the playbook's line, not only the inventory
        raise InputError(e.message.split(": ", 1)[-1] if e.key else e.message, file=str(playbook_path),
                         key="hosts", line=doc.line(("hosts",))) from None
    if limit:
        allowed = {h.name for h in inventory.select(limit)}
        hosts = [h for h in hosts if h.name in allowed]
        if not hosts:
            raise InputError(f"--limit {limit!r} leaves none of the playbook's hosts ({pb.hosts!r})",
                             key="--limit")
    hosts = [h.with_default_venv() for h in hosts]
    for h in hosts:
        if h.transport == "ssh" and not h.venv:
            raise InputError(f"host {h.name!r} has no venv: set `venv:` for it or its group",
                             file=str(inventory.path), key=f"{h.name}.venv")
    engine = engine_for(pb)
    sweep = Sweep(pb, doc, inventory, hosts, engine,
                  find_template(pb.template, engine, playbook_path), sweep_id or new_sweep_id(pb.name))
    names = [c.name for c in pb.all_configs]
    for name in pb.references if not pb.optuna else ():   # a search's trials are named as they come
        if name != "*" and name not in names:
            where: Loc = ("references", name)
            near = difflib.get_close_matches(name, names, n=1)
            raise InputError(f"names no configuration of the playbook{f' (did you mean {near[0]!r}?)' if near else ''}"
                             f": its reference would never be checked (\"*\" is every configuration)",
                             file=str(doc.path), key=".".join(map(str, where)), line=doc.line(where))
    # the playbook's own `secrets:` too: the matrix knows only the names every playbook treats as secrets
    m = pb.matrix
    places: list[tuple[str, Loc]] = ([(path, ("matrix", "axes", path)) for path in m.axes]
                                     + [(path, ("matrix", "include", i)) for i, entry in enumerate(m.include)
                                        for path in entry if path not in m.link]) if m else []
    for path, axis in places:
        section, name = path.split(".", 1)
        if section != "benchmark" and is_secret(name, sweep.secret_names):
            raise InputError(f"{path} is a secret, which no matrix axis or include may set: its values would name "
                             "the runs (run ids, folders, the report); give it in server.env or a configuration's env",
                             file=str(doc.path), key=".".join(map(str, axis)), line=doc.line(axis))
    _refuse_masked_secrets(sweep)
    sweep.runs = [] if pb.optuna else expand(pb, hosts, doc, engine)   # a search's runs come as it goes
    sweep.validate()
    if pb.optuna:   # the template's mistakes before any host, on the space's first point
        for path in pb.optuna.space:
            section, name = path.split(".", 1)
            if section != "benchmark" and is_secret(name, sweep.secret_names):
                where = ("search", "optuna", "space", path)
                raise InputError("a secret is not searched: its values would name the runs (run ids, the "
                                 "study, the report)", file=str(doc.path), key=".".join(where), line=doc.line(where))
        example = search_run(sweep, space.first_point(pb.optuna.space))
        for host in hosts:
            sweep.render(example, host)
    return sweep
