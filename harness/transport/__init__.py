"""Reaching hosts: `connect(host)` gives a `Transport` (run, put, pull, close) over SSH or locally."""

from __future__ import annotations

from harness.errors import InputError
from harness.transport.base import HostSpec, Pulled, Result, Transport

__all__ = ["HostSpec", "Pulled", "Result", "Transport", "connect"]


def connect(host: HostSpec) -> Transport:
    """Open a transport to `host`; over SSH this connects (and verifies the host key) right away.

    The SSH transport is imported here, not at the top: importing fabric costs a noticeable part of
    a second, and everything that only reads `harness.transport.base` should not pay it.
    """
    if host.transport == "local":
        from harness.transport.local import LocalTransport

        return LocalTransport(host)
    if host.transport == "ssh":
        from harness.transport.ssh import SSHTransport

        return SSHTransport(host)
    raise InputError(f"unknown transport {host.transport!r} (ssh or local)", key=f"{host.name}.transport")
