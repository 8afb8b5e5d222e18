"""Screenshots of what a newcomer sees: the report in a browser and the terminal in a real terminal.

    .venv/bin/python scripts/screenshots.py [--widths 80,120] [--keep DIR]

Writes docs/report-900.png and docs/report-1400.png (the demo's report, headless Chromium at 900 and
1400 px) and, per terminal width, docs/screenshots/{name}-{width}.png with the ANSI capture beside it
({name}-{width}.ansi):

    sweep-live       the demo sweep's live display, while a benchmark runs
    sweep-end        the end of the demo sweep: its comparison
    bench            `harness bench` against a simulated server (python -m harness.sim)
    compare          `harness compare` of the demo's results
    status           `harness status` of the demo's results
    unknown-host-key `harness check` of a host whose key is not in known_hosts

Each runs in tmux (`new-session -x WIDTH -y 50`), is captured with `capture-pane -p -e` and drawn to
HTML by rich (`Text.from_ansi`, `Console.export_html`), which Chromium shoots. Everything stays on this
machine: the demo runs on localhost, the simulated server and an OpenSSH server listen on 127.0.0.1
(tests/sshd.py). Needs tmux and chromium; about three minutes.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.terminal_theme import MONOKAI
from rich.text import Text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.sshd import Sshd  # noqa: E402  (the repository's loopback sshd, for the host-key error)

HEIGHT = 50
CHAR_PX, LINE_PX, PAD_PX = 8.43, 17.5, 14   # DejaVu Sans Mono at 14 px
PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><style>
body {{ margin: 0; background: {background}; }}
pre {{ margin: 0; padding: 14px; color: {foreground}; font: 14px/17.5px "DejaVu Sans Mono", monospace; }}
</style></head><body><pre><code>{code}</code></pre></body></html>
"""


def browser() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("chromium is not installed (Debian: apt-get install chromium)")
    return exe


def shoot(page: Path, png: Path, width: int, height: int, profile: Path) -> None:
    """A screenshot of a local page; the browser's own traffic goes to a closed local port."""
    subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}", "--proxy-server=http://127.0.0.1:9",
                    "--hide-scrollbars", f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)


class Terminal:
    """One tmux session of a given width, running a login-free bash with the harness on its PATH."""

    def __init__(self, width: int, cwd: Path):
        self.name = f"harness-shots-{os.getpid()}-{width}"
        self.width = width
        env = f"PATH={REPO / '.venv' / 'bin'}:{os.environ['PATH']}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(HEIGHT),
                        "-c", str(cwd), f"env -u COLUMNS -u LINES {env} PS1='$ ' bash --norc --noprofile"],
                       check=True)
        self.wait_idle()

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout

    def run(self, command: str) -> None:
        """Clear the screen and its history, then type `command` and Enter."""
        self.tmux("send-keys", "-t", self.name, "clear", "Enter")
        time.sleep(0.3)
        self.tmux("clear-history", "-t", self.name)
        self.tmux("send-keys", "-t", self.name, command, "Enter")
        time.sleep(0.5)

    def busy(self) -> bool:
        return self.tmux("display-message", "-p", "-t", self.name, "#{pane_current_command}").strip() != "bash"

    def wait_idle(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: still running after {timeout:.0f} s")
            time.sleep(0.2)

    def watch(self, want: str, fallback: str, timeout: float = 300) -> str:
        """The screen as soon as it shows `want`; if the command ends first, the last screen that
        showed `fallback` (a heartbeat may not come during a short benchmark)."""
        deadline, seen = time.monotonic() + timeout, ""
        while time.monotonic() < deadline and self.busy():
            screen = self.capture(history=False)
            if want in screen:
                return screen
            seen = screen if fallback in screen else seen
            time.sleep(0.1)
        if not seen:
            raise TimeoutError(f"{self.name}: neither {want!r} nor {fallback!r} showed:\n{self.capture()}")
        return seen

    def capture(self, history: bool = True) -> str:
        """The pane with its colours (and what scrolled off, with `history`), trailing blank lines cut."""
        lines = self.tmux("capture-pane", "-p", "-e", "-t", self.name, *(["-S", "-"] if history else [])
                          ).rstrip("\n").splitlines()
        while lines and not Text.from_ansi(lines[-1]).plain.strip():
            lines.pop()
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def draw(ansi: str, width: int, out: Path, work: Path) -> None:
    """An ANSI capture as a PNG of a terminal `width` columns wide."""
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    text = Text.from_ansi(ansi)
    console.print(text, crop=False, soft_wrap=True)
    page = work / f"{out.stem}.html"
    page.write_text(console.export_html(theme=MONOKAI, inline_styles=True, code_format=PAGE))
    lines = len(text.plain.rstrip("\n").splitlines()) or 1
    # a window under about 150 px tall renders only its first line: 200 px at least
    shoot(page, out, math.ceil(width * CHAR_PX + 2 * PAD_PX), max(200, math.ceil(lines * LINE_PX + 2 * PAD_PX)),
          work / "chromium")
    out.with_suffix(".ansi").write_text(ansi)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim_server(port: int, log: Path) -> subprocess.Popen:
    """The simulated SGLang serving GLM-5 on 8 GPUs, 20x faster than the GPUs it models, as the demo has it."""
    env = {**os.environ, "HARNESS_SIM_TIME_SCALE": "0.05", "HARNESS_SIM_STARTUP_S": "0.5"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.sim", "sglang", "--model-path", "/models/GLM-5-NVFP4",
                             "--served-model-name", "glm-5", "--tp-size", "8", "--kv-cache-dtype", "fp8_e4m3",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise TimeoutError(f"the simulated server never became healthy: {log.read_text()[-2000:]}")


def unknown_key_inventory(sshd: Sshd, work: Path) -> str:
    """An inventory (in `work`, named relative to it) of one SSH host whose key known_hosts lacks."""
    (work / "known_hosts").write_text("")
    (work / "inventory-unknown-key.yaml").write_text(
        f"all:\n  hosts:\n    gpu-node-01:\n      address: {sshd.address}\n      port: {sshd.port}\n"
        f"      user: {sshd.user}\n      identity_file: {sshd.client_key}\n"
        f"      known_hosts: known_hosts\n      venv: {Path(sys.executable).parent.parent}\n")
    return "inventory-unknown-key.yaml"


def terminal_shots(width: int, work: Path, shots: Path, sshd: Sshd, port: int) -> list[Path]:
    """The terminal `width` columns wide, in `work` (which holds the demo's playbook and inventory),
    every path on screen relative to it."""
    results = f"results-{width}"
    made = []

    def keep(name: str, ansi: str) -> None:
        out = shots / f"{name}-{width}.png"
        draw(ansi, width, out, work)
        made.append(out)

    term = Terminal(width, work)
    try:
        term.run(f"harness sweep playbooks/demo.yaml -o {results}")
        keep("sweep-live", term.watch("bench level 2/2", "  bench  "))   # while a benchmark runs
        term.wait_idle()
        keep("sweep-end", term.capture())
        (sweep,) = [f"{results}/{p.name}" for p in (work / results).iterdir() if p.is_dir()]

        term.run(f"harness bench --url http://127.0.0.1:{port} --model glm-5 --concurrency 1,8 --requests 16 "
                 f"--max-tokens 200 -o bench-{width}.json")
        keep("bench-live", term.watch("concurrency 8", "concurrency 1"))
        term.wait_idle()
        keep("bench", term.capture())

        inventory = unknown_key_inventory(sshd, work)
        for name, command in (("compare", f"harness compare {sweep}"), ("status", f"harness status {sweep}"),
                              ("unknown-host-key", f"harness check -i {inventory} --engine sim")):
            term.run(command)
            term.wait_idle()
            keep(name, term.capture())
    finally:
        term.close()
    return made


def report_shots(results: Path, work: Path, docs: Path) -> list[Path]:
    """The demo's report at 900 and 1400 px."""
    (sweep,) = [p for p in results.iterdir() if p.is_dir()]
    page = work / "report.html"
    subprocess.run([str(REPO / ".venv" / "bin" / "harness"), "report", str(sweep), "-o", str(page)], check=True,
                   capture_output=True)
    made = []
    for width in (900, 1400):
        out = docs / f"report-{width}.png"
        shoot(page, out, width, 3200 if width == 900 else 2600, work / "chromium")
        made.append(out)
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="80,120", help="terminal widths in columns (default 80,120)")
    p.add_argument("--keep", type=Path, help="keep the work folder (results, captures, pages) here")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the servers below on the way out
    for tool in ("tmux",):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed (Debian: apt-get install {tool})")
    browser()
    work = Path(a.keep or tempfile.mkdtemp(prefix="harness-shots-"))
    work.mkdir(parents=True, exist_ok=True)
    docs, shots = REPO / "docs", REPO / "docs" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    (work / "playbooks").mkdir(exist_ok=True)
    shutil.copy(REPO / "playbooks" / "demo.yaml", work / "playbooks" / "demo.yaml")
    shutil.copy(REPO / "inventory.yaml", work / "inventory.yaml")
    port = free_port()
    server = sim_server(port, work / "sim-server.log")
    made: list[Path] = []
    widths = [int(w) for w in a.widths.split(",")]
    try:
        with Sshd(work / "sshd") as sshd:
            for width in widths:
                made += terminal_shots(width, work, shots, sshd, port)
        made += report_shots(work / f"results-{widths[0]}", work, docs)
    finally:
        server.terminate()
        server.wait(timeout=30)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    for path in made:
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
