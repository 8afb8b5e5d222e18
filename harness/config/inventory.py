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
Ansible's business and ignored; any other unknown key is an error naming the key and the host.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness.config.playbook import ENV_NAME
from harness.config.yamlfile import Loc, YamlDoc, dotted, load_yaml
from harness.errors import InputError
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
    workdir: str = Field("/tmp/harness", description="where runs live on the host")
    gpus: int | None = Field(None, ge=0, description="GPU count")
    gpu: str | None = Field(None, description="GPU model, e.g. H200")
    gpu_bandwidth_gbs: float | None = Field(None, gt=0, description="memory bandwidth per GPU in GB/s, for the "
                                            "roofline; default: from the GPU model")
    env: dict[str, str] = Field(default_factory=dict, description="environment for every server on this host")
    secrets: list[str] = Field(default_factory=list, description="env names to treat as secrets")
    groups: tuple[str, ...] = Field((), description="groups the host belongs to (filled by the loader)")

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

    def with_default_venv(self) -> "Host":
        """A local host without a venv runs the engine in the harness's own environment."""
        if self.transport == "local" and not self.venv:
            return self.model_copy(update={"venv": sys.prefix})
        return self

    def spec(self) -> HostSpec:
        return HostSpec(name=self.name, address=self.address, port=self.port, user=self.user,
                        identity_file=self.identity_file, jump=self.jump, known_hosts=self.known_hosts,
                        transport=self.transport)

    def public(self, redact) -> dict[str, Any]:
        """The entry as recorded in manifests: secrets redacted."""
        data = self.model_dump(mode="json")
        data["env"] = redact.env(self.env)
        return data


def _scalar_str(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v) if isinstance(v, (int, float)) else v


class Inventory:
    def __init__(self, path: Path, hosts: dict[str, Host], groups: dict[str, list[str]]):
        self.path, self.hosts, self.groups = path, hosts, groups

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
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "an inventory is a mapping of groups (e.g. `all:`)")
    raw_hosts: dict[str, list[tuple[Loc, dict]]] = {}   # host -> var layers, outermost first
    groups: dict[str, list[str]] = {}

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
    hosts = {name: _build_host(doc, name, layers, groups) for name, layers in raw_hosts.items()}
    return Inventory(doc.path, hosts, groups)


def _mapping(doc: YamlDoc, value: Any, loc: Loc) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise doc.error(loc, f"expected a mapping, got {type(value).__name__}")
    return value


def _build_host(doc: YamlDoc, name: str, layers: list[tuple[Loc, dict]], groups) -> Host:
    merged: dict[str, Any] = {}
    origin: dict[str, Loc] = {}
    for loc, layer in layers:
        for key, value in layer.items():
            field = ALIASES.get(key, key)
            if field is None or (key.startswith("ansible_") and key not in ALIASES):
                continue
            if field == "transport" and key == "ansible_connection":
                value = _CONNECTIONS.get(str(value), value)
            if field == "env" and isinstance(value, dict) and isinstance(merged.get("env"), dict):
                value = {**merged["env"], **value}
            if field not in Host.model_fields or field in ("name", "groups"):
                raise InputError(f"unknown host variable {key!r} for host {name!r}", file=str(doc.path),
                                 key=dotted(loc + (key,)), line=doc.line(loc + (key,)))
            merged[field], origin[field] = value, loc + (key,)
    merged["name"] = name
    merged["groups"] = tuple(g for g, members in groups.items() if name in members)
    try:
        return Host.model_validate(merged)
    except Exception as e:  # pydantic ValidationError: point at the layer that set the bad value
        err = e.errors()[0]  # type: ignore[attr-defined]
        field = err["loc"][0] if err["loc"] else None
        loc = origin.get(field, layers[-1][0])
        raise doc.error(loc, f"host {name!r}: {err['msg']}") from None

