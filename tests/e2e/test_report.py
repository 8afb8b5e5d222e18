"""The morning report, from a real sweep of the simulated engine: `harness compare` in every format with
the roofline, baseline deltas and reference misses; `harness report` as one self-contained HTML page,
opened in a real headless Chromium whose console would show anything the page tried to fetch."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.report.references import sweep_misses
from tests.conftest import harness

FAST = {"HARNESS_SIM_TIME_SCALE": "0.02", "HARNESS_SIM_STARTUP_S": "0.3"}
CONFIGS = ["tp8", "tp8-bf16-kv", "tp8-oom"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One sweep: two configurations that run and one that runs out of memory, an 8-GPU Blackwell host
    (by the inventory's word), GLM-5's roofline facts and a reference tp8-bf16-kv cannot meet."""
    tmp = tmp_path_factory.mktemp("report")
    inventory = {"all": {"hosts": {"localhost": {"transport": "local", "gpus": 8, "gpu": "RTX PRO 6000 Blackwell",
                                                 "workdir": str(tmp / "work")}}}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pb = {"name": "report", "hosts": "localhost", "engine": "sim", "flavor": "sglang",
          "model": {"path": "/models/GLM-5-NVFP4", "served_name": "glm-5", "active_params_b": 40,
                    "bytes_per_weight": 1.16, "kv_bytes_per_token": 44928},
          "server": {"port": port, "args": {"tp-size": 8, "kv-cache-dtype": "fp8_e4m3"}, "env": FAST,
                     "startup_timeout_s": 30},
          # a long unbroken flag value (JSON), as vLLM's --compilation-config takes: the page must wrap it
          "configs": [{"name": "tp8", "args": {"cuda-graph-config": {"decode": {"backend": "full", "max_bs": 256,
                                                                              "bs": list(range(1, 257, 8))}}}},
                      {"name": "tp8-bf16-kv", "args": {"kv-cache-dtype": "bf16"}},
                      {"name": "tp8-oom", "env": {"HARNESS_SIM_FAULT": "oom_at_start"}}],
          "benchmark": {"prompt": "hello there", "max_tokens": 8, "concurrency": [1, 2], "requests": 2,
                        "warmup": 0, "timeout_s": 30},
          "profile": {"mode": "engine", "num_steps": 3, "timeout_s": 30},
          # bands no timing noise crosses: every configuration meets the first, tp8-bf16-kv misses the second
          "references": {"*": {"itl_ms_p50": {1: [2, -0.999, 99]}},
                         "tp8-bf16-kv": {"output_tok_s": {1: [1e6, -0.1, None]}}}}
    (tmp / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    (tmp / "playbook.yaml").write_text(yaml.safe_dump(pb, sort_keys=False))
    run = harness("sweep", tmp / "playbook.yaml", "-i", tmp / "inventory.yaml", "-o", tmp / "results")
    assert run.returncode == 1, run.stdout + run.stderr  # tp8-oom failed
    return tmp / "results"


def sweep_dir(results: Path) -> Path:
    (only,) = [p for p in results.iterdir() if p.is_dir()]
    return only


def test_compare_shows_the_roofline_the_deltas_and_fails_on_a_missed_reference(results):
    run = harness("compare", results, "--format", "json", "--baseline", "tp8")
    assert run.returncode == 1 and "reference(s) missed" in run.stderr
    rows = {(r["config"], r["concurrency"]): r for r in json.loads(run.stdout)}
    tp8 = rows[("tp8", 1)]
    assert round(tp8["theoretical_ms"], 2) == 3.24  # 46.4 GB over 8 x 1,792 GB/s
    assert tp8["efficiency"] == pytest.approx(tp8["theoretical_ms"] / tp8["itl_ms_p50"])
    assert tp8["itl_vs_baseline"] == 0 and tp8["misses"] == []
    fast = rows[("tp8-bf16-kv", 1)]
    assert fast["itl_vs_baseline"] < -0.3 and fast["tok_s_vs_baseline"] > 0.3
    assert [m["metric"] for m in fast["misses"]] == ["output_tok_s"]
    assert rows[("tp8-bf16-kv", 2)]["misses"] == []
    assert rows[("tp8-oom", None)]["error"].startswith("oom")


def test_every_format_carries_the_same_fields(results):
    csv_rows = list(csv.DictReader(io.StringIO(harness("compare", results, "--format", "csv").stdout)))
    assert {"theoretical_ms", "efficiency", "itl_vs_baseline", "tok_s_vs_baseline", "misses"} <= set(csv_rows[0])
    missed = next(r for r in csv_rows if r["config"] == "tp8-bf16-kv" and r["concurrency"] == "1")
    assert "output_tok_s" in missed["misses"] and float(missed["theoretical_ms"]) == pytest.approx(3.24, abs=0.005)

    markdown = harness("compare", results, "--format", "markdown").stdout.splitlines()
    assert all(h in markdown[0] for h in ("roofline ms", "efficiency", "ITL vs tp8", "tok/s vs tp8", "misses"))
    row = next(line for line in markdown if line.startswith("| tp8-bf16-kv | 1 |"))
    assert "| 3.24 |" in row and "%" in row and "output_tok_s" in row

    table = harness("compare", results).stdout
    assert "roof" in table and "eff = roofline / ITL p50" in table and "3.24" in table
    assert "reference missed: tp8-bf16-kv at concurrency 1: output_tok_s" in table.replace("\n", " ")


def test_the_sweep_end_check_finds_the_same_misses(results):
    assert [(m.config, m.concurrency, m.metric) for m in sweep_misses(sweep_dir(results))] == \
        [("tp8-bf16-kv", 1, "output_tok_s"), ("tp8-oom", None, "itl_ms_p50")]


def test_the_report_is_one_page_that_needs_nothing_from_the_network(results, tmp_path):
    page = tmp_path / "report.html"
    run = harness("report", results, "-o", page)
    assert run.returncode == 0, run.stderr
    html = page.read_text()
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"url\(|@import|<script|<link", html, re.I)
    assert "default-src 'none'" in html  # and the browser is told to fetch nothing for it
    for section in ("comparison", "latency", "gpu-time", "roofline", "failures", "configs", "hosts"):
        assert f'id="{section}"' in html, section
    assert html.count("<svg") == 6  # ITL, TTFT, throughput, ITL against load, the per-user/per-GPU frontier, GPU time


@pytest.fixture
def chromium(tmp_path):
    """Headless Chromium, its console on stderr; the browser's own background traffic (time, updates)
    goes to a local proxy that answers nothing, so it never leaves the machine."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}", f"--proxy-server=http://127.0.0.1:{proxy.getsockname()[1]}",
                 "--proxy-bypass-list=<-loopback>", "--enable-logging=stderr", "--v=0", *args],
                capture_output=True, text=True, timeout=120)
        yield run


def blocked_fetches(browser_log: str) -> list[str]:
    """What the page's Content-Security-Policy refused to fetch, from the browser's console."""
    return [line for line in browser_log.splitlines() if "violates the following Content Security Policy" in line]


def test_a_real_browser_shows_every_configuration_with_its_efficiency_and_fetches_nothing(
        results, tmp_path, chromium):
    page = tmp_path / "report.html"
    assert harness("report", results, "-o", page).returncode == 0
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    for config in CONFIGS:
        assert config in dom.stdout
    assert "3.24" in dom.stdout and "inventory gpu: RTX PRO 6000 Blackwell" in dom.stdout
    assert "out of memory" in dom.stdout  # the failure, with its reason
    assert blocked_fetches(dom.stderr) == []
    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1400,2400", page.as_uri())
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1400, 2400)


def test_the_browser_check_would_see_a_page_that_fetches(results, tmp_path, chromium):
    page = tmp_path / "report.html"
    assert harness("report", results, "-o", page).returncode == 0
    page.write_text(page.read_text().replace("</main>", '<img src="http://127.0.0.1:9/logo.png"></main>'))
    assert len(blocked_fetches(chromium("--dump-dom", page.as_uri()).stderr)) == 1


MEASURE = """<script>
addEventListener("load", () => {
  const box = e => e.getBoundingClientRect();
  const out = {viewport: document.documentElement.clientWidth, page: document.documentElement.scrollWidth,
               tables: [...document.querySelectorAll("table")].map(t => ({
                 section: t.closest("section").id, left: Math.floor(box(t).left), right: Math.ceil(box(t).right),
                 room: Math.ceil(box(t.parentElement).right)}))};
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(out);
  document.body.append(pre);
});
</script>"""


def measured(chromium, page: Path, width: int) -> dict:
    """Where each table of the page lies at a window `width` px wide, from a copy of the page with a
    script that measures it (the page itself runs none: its policy forbids scripts)."""
    probe = page.with_name(f"measure-{width}.html")
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text())
    probe.write_text(html.replace("</body>", MEASURE + "</body>"))
    dom = chromium("--dump-dom", f"--window-size={width},1600", probe.as_uri())
    found = re.search(r'<pre id="measured">([^<]*)</pre>', dom.stdout)
    assert found, dom.stderr[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"'))


@pytest.mark.parametrize("width", [900, 1400])
def test_no_table_is_wider_than_the_window_or_its_section(results, tmp_path, chromium, width):
    page = tmp_path / "report.html"
    assert harness("report", results, "-o", page).returncode == 0
    m = measured(chromium, page, width)
    assert m["viewport"] <= width and len(m["tables"]) == 3   # comparison, GPU time, configurations
    too_wide = [t for t in m["tables"] if t["right"] > t["room"] or t["right"] > m["viewport"]]
    assert too_wide == [], f"at {width} px (viewport {m['viewport']}): {too_wide}"
    assert m["page"] <= m["viewport"]   # nothing else makes the page scroll sideways either
