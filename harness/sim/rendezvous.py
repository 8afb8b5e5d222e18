"""The rendezvous of a simulated server on several hosts (`--nnodes N --node-rank R`).

As the real engines do it: every node is started with the same flags and its own rank; they meet at
node 0's address (SGLang 0.5.23 `--dist-init-addr HOST:PORT`, vLLM 0.26 / 0.32 `--master-addr HOST
--master-port PORT`), where torch.distributed's store listens, and node 0 is not up (its HTTP port
closed) until every node joined. Nodes of rank >= 1 serve no API: SGLang's a dummy `/health`, vLLM's
(`--headless`) nothing at all.

Here node 0 listens on the rendezvous port and waits for one `{"hello": rank}` line from each other
node. It then relays, one JSON line each, what every rank of a real server sees because the ranks
step together: each forward step (`step`), the profiler's `start` and `stop`, each finished request
(`completed`, so a fault such as `crash_after` can fire on any node). A node whose link to the others
closes exits with an error LOST_AFTER_S later, so when one node dies every node does, and after it:
the simulator's stand-in for the collective that fails (or hangs until the distributed timeout) on a
real server, where the node that broke goes first, by far.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[dict[str, Any]], Awaitable[None]]
JOIN_RETRY_S = 0.2
LOST_AFTER_S = 2.0
"""Wall seconds between a node's link closing and that node exiting (not scaled: who went first is
told by the time each exited, and a real server's survivors outlive the node that broke by far more)."""


def endpoint(engine: str, ns: Any) -> tuple[str, int] | None:
    """Node 0's (host, port) from the launch flags; None when they name none."""
    if engine == "sglang":
        if not ns.dist_init_addr:
            return None
        host, _, port = ns.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            return None
        return host.strip("[]"), int(port)
    return ns.master_addr, ns.master_port


def lost(message: str) -> None:
    """The process ends, as a rank does when its group is gone."""
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR {message}\n")
    sys.stderr.flush()
    os._exit(1)


async def lost_later(message: str) -> None:
    """A node's link to the others closed: it fails its next collective, LOST_AFTER_S from now."""
    await asyncio.sleep(LOST_AFTER_S)
    lost(message)


class Head:
    """Node 0: waits for every other node, then relays to them."""

    def __init__(self, port: int, peers: int, log: Callable[[str], None]):
        self.port, self.peers, self.log = port, peers, log
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.joined = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def gather(self) -> None:
        self.server = await asyncio.start_server(self._member, None, self.port)
        self.log(f"waiting for {self.peers} more node(s) at port {self.port}")
        await self.joined.wait()
        self.log(f"all {self.peers + 1} nodes joined")

    async def _member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 30))
            rank = int(hello["hello"])
        except (ValueError, KeyError, TypeError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        if not 0 < rank <= self.peers or rank in self.writers or self.joined.is_set():
            writer.close()
            return
        self.writers[rank] = writer
        self.log(f"node {rank} joined from {writer.get_extra_info('peername')}")
        if len(self.writers) == self.peers:
            self.joined.set()
        try:
            while await reader.read(4096):
                pass
        except ConnectionError:
            pass
        await lost_later(f"node {rank} left the group (its connection to node 0 closed): stopping")

    def send(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        for writer in self.writers.values():
            writer.write(line)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        if self.server is not None:
            self.server.close()


async def join(host: str, port: int, rank: int, timeout: float, log: Callable[[str], None]
               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Node `rank`: connect to node 0 (retrying while it is not listening yet) and say hello."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                lost(f"node {rank} could not reach node 0 at {host}:{port} within {timeout:g} s: {e}")
            await asyncio.sleep(JOIN_RETRY_S)
    writer.write((json.dumps({"hello": rank}) + "\n").encode())
    await writer.drain()
    log(f"node {rank} joined node 0 at {host}:{port}")
    return reader, writer


async def follow(reader: asyncio.StreamReader, rank: int, handle: Handler) -> None:
    """Node `rank`: act on what node 0 relays until the link closes, then exit."""
    try:
        while line := await reader.readline():
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                await handle(message)
    except ConnectionError:
        pass
    await lost_later(f"node {rank} lost node 0 (its connection closed): stopping")
