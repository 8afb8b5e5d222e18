"""A "remote" venv for end-to-end tests, in which the real launch commands reach the simulated engine.

`python -m sglang.launch_server ARGS` and `vllm serve MODEL ARGS` resolve to `python -m harness.sim`,
so the launch templates render and run exactly the commands they would on a GPU host. The venv has
only the standard library and this checkout on its path, like a host venv that never heard of the
harness: everything the harness runs there (agent, benchmark client) must make do with that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SGLANG_INIT = '__version__ = "0.5.23"\n'
SGLANG_LAUNCH = '''import sys
from harness.sim.__main__ import main
sys.exit(main(["sglang", *sys.argv[1:]]))
'''
VLLM_INIT = '__version__ = "0.32.0"\n'
VLLM_SCRIPT = '''#!{python}
import sys
from harness.sim.__main__ import main
args = sys.argv[1:]
if args[:1] == ["serve"]:
    args = args[1:]
sys.exit(main(["vllm", *args]))
'''


def make_remote_venv(path: Path, *, engines: tuple[str, ...] = ("sglang", "vllm")) -> Path:
    """A venv at `path` whose engines are the simulator; returns `path`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*/site-packages"))
    shims = path / "shims"
    (site / "harness-checkout.pth").write_text(f"{REPO}\n{shims}\n")
    if "sglang" in engines:
        (shims / "sglang").mkdir(parents=True)
        (shims / "sglang" / "__init__.py").write_text(SGLANG_INIT)
        (shims / "sglang" / "launch_server.py").write_text(SGLANG_LAUNCH)
    if "vllm" in engines:
        (shims / "vllm").mkdir(parents=True)
        (shims / "vllm" / "__init__.py").write_text(VLLM_INIT)
        script = path / "bin" / "vllm"
        script.write_text(VLLM_SCRIPT.format(python=path / "bin" / "python"))
        script.chmod(0o755)
    return path


def plant_distribution(site: Path, name: str, version: str) -> None:
    """An installed distribution as Python's metadata finds it (a dist-info folder), with no code."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
