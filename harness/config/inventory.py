"""The inventory: which hosts exist, how to reach them, and what they hold.

Ansible-shaped, so an existing Ansible inventory works as it is:

    all:
      vars: {venv: /root/ml-env}
      hosts: {localhost: {transport: local}}
      children:
        gpu:
          vars: {user: root, gpus: 8}
          hosts: {gpu-01: {address: 10.0.0.5}}

Variables flow down: `all.vars` < parent group vars < child group vars < host vars (host wins); `env`
mappings merge key by key. The Ansible spellings (`ansible_host`, `ansible_port`, `ansible_user`,
`ansible_ssh_private_key_file`, `ansible_connection`) are accepted; other `ansible_*` variables are
Ansible's business: ignored, with a note. Any other key the harness does not know is kept as a
template variable (`host.vars.NAME`) with a note, except a near miss of a known key (`venvv`), which is
an error with a "did you mean". An Ansible INI inventory (`[group]`, `[group:vars]`,
`[group:children]`, `host key=value ...`) loads too: it is read into the same shape first.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from harness.config.playbook import ENV_NAME
from harness.config.yamlfile import Loc, YamlDoc, dotted, load_yaml, read_text
from harness.errors import InputError
from harness.remote import DEFAULT_WORKDIR
from harness.secrets import MASK, is_secret
from harness.transport.base import HostSpec

ALIASES = {
    "ansible_host": "address",
    "ansible_port": "port",
    "ansible_user": "user",
    "ansible_ssh_private_key_file": "identity_file",
    "ansible_connection": "transport",
    "ansible_ssh_common_args": None,
}
_CONNECTIONS = {"local": "local", "ssh": "ssh", "smart": "ssh", "paramiko": "ssh"}
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
JUMP = re.compile(r"^(?:[A-Za-z0-9_.\-]+@)?[A-Za-z0-9_.\-]+(?::(?P<port>\d{1,5}))?$")
GROUP_KEYS = {"vars", "hosts", "children"}
# what reaches salloc: a partition or account name, a time limit as Slurm writes one
SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
SLURM_TIME = re.compile(r"^(?:\d+-)?\d+(?::\d{1,2}){0,2}$")


class SlurmSettings(BaseModel):
    """A group that is a Slurm cluster: what its one allocation per sweep asks for. Every value here
    reaches salloc, so each is validated (and quoted besides)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(1, ge=1, le=4096, description="nodes the allocation takes; one run at a time on each")
    gpus_per_node: int | None = Field(None, ge=0, le=64, description="GPUs per node (salloc --gpus-per-node)")
    cpus_per_node: int | None = Field(None, ge=1, le=16384, strict=True, description="CPUs per node, all of them the "
                                      "server's (salloc and every srun step: --cpus-per-task, one task a "
                                      "node); default: the cluster's (often one CPU)")
    partition: str | None = Field(None, description="partition; default: the cluster's default partition")
    account: str | None = Field(None, description="account charged; default: the user's default account")
    time: str | None = Field(None, description="the allocation's time limit, as Slurm writes one "
                             "(MM, HH:MM:SS, D-HH:MM...); default: the partition's")
    login: str | None = Field(None, description="the inventory host (over SSH) that runs salloc, srun and "
                              "scancel; default: this machine")
    wait_s: float = Field(600, gt=0, le=7 * 86400, description="seconds to wait for the allocation before "
                          "the sweep gives up (and cancels the request)")

    @field_validator("partition", "account")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not SLURM_NAME.match(v):
            raise ValueError(f"{v!r}: use letters, digits, '.', '_' and '-'")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not SLURM_TIME.match(v):
            raise ValueError(f"time {v!r}: expected a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                             "D-HH:MM:SS)")
        return v

    @field_validator("login")
    @classmethod
    def _login(cls, v: str | None) -> str | None:
        if v is not None and not HOST_NAME.match(v):
            raise ValueError(f"login {v!r}: the name of a host of the inventory")
        return v


class Host(BaseModel):
    """One host, after inheritance. Field descriptions double as the inventory's reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="inventory name")
    address: str | None = Field(None, description="address or DNS name (alias ansible_host); default: the name")
    port: int | None = Field(None, ge=1, le=65535, description="SSH port (alias ansible_port)")
    user: str | None = Field(None, description="SSH user (alias ansible_user)")
    identity_file: str | None = Field(None, description="private key (alias ansible_ssh_private_key_file)")
    transport: Literal["ssh", "local"] = Field("ssh", description="ssh, or local for this machine")
    jump: str | None = Field(None, description="ProxyJump host, user@host:port")
    known_hosts: str | None = Field(None, description="known_hosts file; default ~/.ssh/known_hosts")
    venv: str | None = Field(None, description="Python venv holding the engine; activated for every command")
    workdir: str = Field(DEFAULT_WORKDIR, description="where runs live on the host: the SSH user's own, private "
                         "folder (made 0700; refused when another user owns it or others may write in it); "
                         "~/ is that user's home")
    gpus: int | None = Field(None, ge=0, description="GPU count")
    gpu: str | None = Field(None, description="GPU model, e.g. H200")
    gpu_bandwidth_gbs: float | None = Field(None, gt=0, description="memory bandwidth per GPU in GB/s, for the "
                                            "roofline; default: from the GPU model")
    env: dict[str, str | None] = Field(default_factory=dict, description="environment for every server on this "
                                       "host (null: unset)")
    secrets: list[str] = Field(default_factory=list, description="env names to treat as secrets")
    scheduler: Literal["slurm"] | None = Field(None, description="slurm: the group is a Slurm cluster, its "
                                              "nodes allocated for each sweep (see `slurm`)")
    slurm: SlurmSettings | None = Field(None, description="the allocation a Slurm group asks for: nodes, "
                                        "gpus_per_node, cpus_per_node, partition, account, time, login, wait_s")
    cluster: str | None = Field(None, description="the Slurm group a node slot belongs to (filled by the loader)")
    groups: tuple[str, ...] = Field((), description="groups the host belongs to (filled by the loader)")
    vars: dict[str, Any] = Field(default_factory=dict, description="variables the harness does not use "
                                 "itself (an Ansible inventory's own): template variables, host.vars.NAME")

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v):
        if isinstance(v, dict):
            return {k: _scalar_str(x) for k, x in v.items()}
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        # a host name names directories, journal entries and a comment in every launch script
        if not HOST_NAME.match(v):
            raise ValueError(f"host name {v!r}: use letters, digits, '.', '_' and '-'")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict) -> dict:
        for name in v:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return v

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list) -> list:
        for name in v:
            if not ENV_NAME.match(name):
                raise ValueError(f"secret {name!r} is not a valid environment variable name")
        return v

    @field_validator("jump")
    @classmethod
    def _jump(cls, v: str | None) -> str | None:
        m = JUMP.match(v or "")
        if v is not None and (not m or (m["port"] and not 1 <= int(m["port"]) <= 65535)):
            raise ValueError(f"jump {v!r}: expected [user@]host[:port], the port 1-65535")
        return v

    @field_validator("workdir", "venv")
    @classmethod
    def _absolute(cls, v):
        if v is not None and not (v.startswith("/") or v.startswith("~")):
            raise ValueError("must be an absolute path")
        return v

    @model_validator(mode="after")
    def _scheduled(self):
        if (self.scheduler == "slurm") != (self.slurm is not None):
            raise ValueError("a Slurm group sets both `scheduler: slurm` and `slurm:` (nodes, partition...)")
        return self

    def with_default_venv(self) -> Host:
        """A local host without a venv runs the engine in the harness's own environment."""
        if self.transport == "local" and not self.venv:
            return self.model_copy(update={"venv": sys.prefix})
        return self

    def spec(self) -> HostSpec:
        return HostSpec(name=self.name, address=self.address, port=self.port, user=self.user,
                        identity_file=self.identity_file, jump=self.jump, known_hosts=self.known_hosts,
                        transport=self.transport, python=f"{self.venv.rstrip('/')}/bin/python" if self.venv else None)

    def public(self, redact) -> dict[str, Any]:
        """The entry as recorded in manifests: secrets redacted, those of its variables too (an Ansible
        inventory's `ansible_become_pass`, an `hf_token` kept for a template)."""
        data = self.model_dump(mode="json")
        data["env"] = redact.env(self.env, self.secrets)
        data["vars"] = redact.data({k: MASK if is_secret(k, self.secrets) else v for k, v in data["vars"].items()})
        return data

    @property
    def secret_values(self) -> list[str]:
        """The values of its secret env and variables, for the redactor: text, or a number as written."""
        found = [v for k, v in self.env.items() if v is not None and is_secret(k, self.secrets)]
        return found + [str(v) for k, v in self.vars.items()
                        if is_secret(k, self.secrets) and isinstance(v, (str, int, float)) and not isinstance(v, bool)]


def _scalar_str(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v) if isinstance(v, (int, float)) else v


class Inventory:
    def __init__(self, path: Path, hosts: dict[str, Host], groups: dict[str, list[str]],
                 notes: list[str] | None = None):
        self.path, self.hosts, self.groups = path, hosts, groups
        self.notes = notes or []   # what was kept or ignored, said once each

    def select(self, pattern: str | None, *, what: str = "--limit") -> list[Host]:
        """Hosts matching a host name, group name or glob; several patterns separated by ',' or ':'."""
        if not pattern:
            return list(self.hosts.values())
        chosen: list[str] = []
        for part in [p.strip() for p in pattern.replace(":", ",").split(",") if p.strip()]:
            names = self._match(part)
            if not names:
                known = ", ".join([*self.groups, *self.hosts])
                raise InputError(f"{part!r} matches no host or group in {self.path} (known: {known})",
                                 key=what)
            chosen += [n for n in names if n not in chosen]
        return [self.hosts[n] for n in chosen]

    def _match(self, part: str) -> list[str]:
        if part in self.hosts:
            return [part]
        if part in self.groups:
            return list(self.groups[part])
        names = [h for h in self.hosts if fnmatch.fnmatchcase(h, part)]
        for g in fnmatch.filter(self.groups, part):
            names += self.groups[g]
        return list(dict.fromkeys(names))


def load_inventory(path: Path | str) -> Inventory:
    doc = load_ini(Path(path)) if _is_ini(Path(path)) else load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "an inventory is a mapping of groups (e.g. `all:`)")
    raw_hosts: dict[str, list[tuple[Loc, dict]]] = {}   # host -> var layers, outermost first
    groups: dict[str, list[str]] = {}
    slots: dict[str, str] = {}   # a Slurm group's node slot -> the group

    def walk(group: str, node: Any, loc: Loc, inherited: list[tuple[Loc, dict]]) -> None:
        if node is None:
            node = {}
        if not isinstance(node, dict):
            raise doc.error(loc, "a group is a mapping with vars, hosts and children")
        for key in node:
            if key not in GROUP_KEYS:
                raise doc.error(loc + (key,), f"unknown key in group {group!r} (expected vars, hosts, children)")
        layers = inherited + ([(loc + ("vars",), _mapping(doc, node.get("vars"), loc + ("vars",)))]
                              if node.get("vars") is not None else [])
        members = groups.setdefault(group, [])
        own: dict = node["vars"] if isinstance(node.get("vars"), dict) else {}
        if ("slurm" in own or "scheduler" in own) and own.get("scheduler") != "slurm":
            raise doc.error(loc + ("vars", "scheduler" if "scheduler" in own else "slurm"),
                            f"group {group!r}: a Slurm group sets both `scheduler: slurm` and `slurm:` "
                            "(nodes, partition...)")
        if own.get("scheduler") == "slurm":   # its hosts are the slots of its allocation
            for key in ("hosts", "children"):
                if node.get(key):
                    raise doc.error(loc + (key,), f"group {group!r} is a Slurm cluster: its nodes come from "
                                    "its allocation, so it lists no hosts or children (slurm.nodes says how "
                                    "many; its login host is another host of the inventory, named by "
                                    "slurm.login)")
            count = (own.get("slurm") or {}).get("nodes", 1) if isinstance(own.get("slurm"), dict) else 1
            count = count if isinstance(count, int) and 1 <= count <= 4096 else 1  # a bad value: the model says
            node = {**node, "hosts": {f"{group}-{i}": {} for i in range(1, count + 1)}}
            slots.update({f"{group}-{i}": group for i in range(1, count + 1)})
        for name, hvars in _mapping(doc, node.get("hosts"), loc + ("hosts",)).items():
            hloc = loc + ("hosts", name)
            raw_hosts.setdefault(str(name), []).extend(
                [lay for lay in layers if lay not in raw_hosts.get(str(name), [])]
                + [(hloc, _mapping(doc, hvars, hloc))])
            if name not in members:
                members.append(str(name))
        for child, cnode in _mapping(doc, node.get("children"), loc + ("children",)).items():
            walk(str(child), cnode, loc + ("children", child), layers)
            for h in groups[str(child)]:
                if h not in members:
                    members.append(h)

    for group, node in doc.data.items():
        walk(str(group), node, (group,), [])
    if not raw_hosts:
        raise doc.error((), "the inventory defines no hosts")
    notes: dict[str, set[str]] = {}
    hosts = {name: _build_host(doc, name, layers, groups, notes, slots.get(name))
             for name, layers in raw_hosts.items()}
    _check_logins(doc, hosts)
    return Inventory(doc.path, hosts, groups, [f"{doc.path}: {what}: {', '.join(sorted(keys))}"
                                              for what, keys in notes.items()])


def _mapping(doc: YamlDoc, value: Any, loc: Loc) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise doc.error(loc, f"expected a mapping, got {type(value).__name__}")
    return value


KEPT = "kept as template variables (host.vars.NAME), unused by the harness"
IGNORED = "Ansible connection variables the harness does not use, ignored"


def _check_logins(doc: YamlDoc, hosts: dict[str, Host]) -> None:
    """A Slurm group's login host is another host of the inventory, reached over SSH."""
    for h in hosts.values():
        login = h.slurm.login if h.slurm else None
        if login is None:
            continue
        where = (*_group_loc(doc, h.cluster or ""), "vars", "slurm", "login")
        target = hosts.get(login)
        if target is None or target.cluster is not None:
            raise InputError(f"slurm.login {login!r} of group {h.cluster!r} is not a host of the inventory "
                             f"(known: {', '.join(n for n, o in hosts.items() if o.cluster is None)})",
                             file=str(doc.path), key=dotted(where), line=doc.line(where))


def _group_loc(doc: YamlDoc, group: str) -> Loc:
    """Where a group is written in the inventory (for error lines)."""
    def find(node: Any, loc: Loc) -> Loc | None:
        if not isinstance(node, dict):
            return None
        for name, child in node.items():
            here = loc + (name,)
            if name == group:
                return here
            found = find(child.get("children") if isinstance(child, dict) else None, here + ("children",))
            if found:
                return found
        return None
    return find(doc.data, ()) or ()


def _build_host(doc: YamlDoc, name: str, layers: list[tuple[Loc, dict]], groups,
                notes: dict[str, set[str]], cluster: str | None = None) -> Host:
    merged: dict[str, Any] = {"vars": {}}
    origin: dict[str, Loc] = {}
    for loc, layer in layers:
        for key, value in layer.items():
            key = str(key)
            field = ALIASES.get(key, key)
            if field is None or (key.startswith("ansible_") and key not in ALIASES):
                notes.setdefault(IGNORED, set()).add(key)
                continue
            if field not in Host.model_fields or field in ("name", "groups", "vars", "cluster"):
                near = difflib.get_close_matches(key, [*HOST_KEYS, *ALIASES], n=1, cutoff=0.8)
                if near:
                    raise InputError(f"unknown host variable {key!r} for host {name!r}: did you mean "
                                     f"{near[0]!r}?", file=str(doc.path), key=dotted(loc + (key,)),
                                     line=doc.line(loc + (key,)))
                merged["vars"][key] = value
                notes.setdefault(KEPT, set()).add(key)
                continue
            if field == "transport" and key == "ansible_connection":
                value = _CONNECTIONS.get(str(value), value)
            if field == "env" and isinstance(value, dict) and isinstance(merged.get("env"), dict):
                value = {**merged["env"], **value}
            merged[field], origin[field] = value, loc + (key,)
    merged["name"] = name
    merged["cluster"] = cluster
    merged["groups"] = tuple(g for g, members in groups.items() if name in members)
    try:
        return Host.model_validate(merged)
    except Exception as e:  # pydantic ValidationError: point at the layer that set the bad value
        err = e.errors()[0]  # type: ignore[attr-defined]
        loc = origin.get(err["loc"][0], layers[-1][0]) if err["loc"] else layers[-1][0]
        if err["loc"][:1] == ("slurm",) and len(err["loc"]) > 1:   # the key inside `slurm:` that is wrong
            key = ".".join(str(k) for k in err["loc"])
            raise doc.error(loc + tuple(err["loc"][1:]), f"group {cluster or name!r}: {key}: {err['msg']}") from None
        raise doc.error(loc, f"host {name!r}: {err['msg']}") from None



HOST_KEYS = [f for f in Host.model_fields if f not in ("name", "groups", "vars", "cluster")]


def _is_ini(path: Path) -> bool:
    """An Ansible INI inventory: named .ini / .cfg, or with no YAML suffix and `[group]` lines."""
    if path.suffix in (".ini", ".cfg"):
        return True
    if path.suffix in (".yaml", ".yml", ".json"):
        return False
    try:
        first = next((line.strip() for line in path.read_text().splitlines()
                      if line.strip() and not line.lstrip().startswith(("#", ";"))), "")
    except (OSError, UnicodeDecodeError):
        return False
    return first.startswith("[")


def load_ini(path: Path) -> YamlDoc:
    """An Ansible INI inventory as the YAML shape, with the line of every host and variable."""
    text = read_text(path)
    groups: dict[str, dict] = {"all": {}}
    lines: dict[Loc, int] = {}
    parents: dict[str, str] = {}
    section, kind = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise InputError("a section header is `[group]`, `[group:vars]` or `[group:children]`",
                                 file=str(path), line=number)
            section, _, kind = line[1:-1].partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise InputError(f"unknown section kind {kind!r} (vars or children)", file=str(path), line=number)
            groups.setdefault(section, {})
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise InputError(f"cannot read this line: {e}", file=str(path), line=number) from None
        group = groups.setdefault(section, {})
        if kind == "vars":
            key, eq, value = line.partition("=")
            if not eq:
                raise InputError("a [group:vars] line is `name=value`", file=str(path), line=number)
            group.setdefault("vars", {})[key.strip()] = _ini_value(value.strip())
            lines[(section, "vars", key.strip())] = number
        elif kind == "children":
            parents[words[0]] = section
            groups.setdefault(words[0], {})
            lines[(section, "children", words[0])] = number
        else:
            host, pairs = words[0], words[1:]
            values = {}
            for pair in pairs:
                key, eq, value = pair.partition("=")
                if not eq:
                    raise InputError(f"host {host!r}: expected key=value, got {pair!r}", file=str(path), line=number)
                values[key] = _ini_value(value)
                lines[(section, "hosts", host, key)] = number
            group.setdefault("hosts", {})[host] = values
            lines[(section, "hosts", host)] = number
    tree = _ini_tree(groups, parents)
    return YamlDoc(path, tree, {_ini_loc(loc, parents): n for loc, n in lines.items()})


def _ini_value(text: str) -> Any:
    """Ansible reads INI values as Python literals where they are one (8, true, "quoted")."""
    unquoted = text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else None
    if unquoted is not None:
        return unquoted
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _ini_tree(groups: dict[str, dict], parents: dict[str, str]) -> dict:
    """Nest each group under its parent (children sections); the rest under `all`."""
    def node(name: str) -> dict:
        out = {k: v for k, v in groups[name].items() if k in ("vars", "hosts")}
        kids = {child: node(child) for child, parent in parents.items() if parent == name}
        if kids:
            out["children"] = kids
        return out
    top = {name for name in groups if name != "all" and name not in parents}
    root = node("all")
    root.setdefault("children", {}).update({name: node(name) for name in sorted(top)})
    return {"all": root}


def _ini_loc(loc: Loc, parents: dict[str, str]) -> Loc:
    """The YAML-shaped path of an INI location: all.children.parent.children.group..."""
    group, rest = str(loc[0]), loc[1:]
    chain = [group]
    while chain[0] in parents:
        chain.insert(0, parents[chain[0]])
    path: tuple = ("all",)
    for g in chain:
        if g != "all":
            path += ("children", g)
    return path + rest
