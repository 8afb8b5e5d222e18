"""A bench.json as a table: one row per concurrency level. Compact enough for 80 columns, numbers never
cut (three significant figures, as compare shows them), the unit in the title."""

from __future__ import annotations

from rich import box

from harness.remote.stats import several_per_chunk
from harness.report.compare import _fmt
from harness.report.plain import PlainTable


def render_bench(result: dict) -> PlainTable:
    levels = result.get("levels", [])
    per_token = any(several_per_chunk(lv) for lv in levels)
    t = PlainTable(title=f"{result.get('model')} at {result.get('url')} (latencies in ms)", header_style="bold",
                   title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    columns = ["conc", "done", "failed", "TTFT\np50", "ITL\np50", "ITL\np99"]
    columns += ["ITL/tok\np50", "tok/\nchunk"] if per_token else []
    columns += ["TPOT\np50", "E2E\np50", "tok/s", "req/s"]
    for col in columns:
        t.add_column(col, justify="right", no_wrap=True)
    for lv in levels:
        def q(metric: str, p: str, lv: dict = lv) -> str:
            return _fmt((lv.get(metric) or {}).get(p))
        row = [str(lv["concurrency"]), str(lv["completed"]), str(lv["failed"]), q("ttft_ms", "p50"),
               q("itl_ms", "p50"), q("itl_ms", "p99")]
        if per_token:
            row += [q("itl_token_ms", "p50"), f"{lv.get('tokens_per_chunk') or 1:.2f}"]
        row += [q("tpot_ms", "p50"), q("e2e_ms", "p50"), _fmt(lv.get("output_tok_s")), _fmt(lv.get("requests_per_s"))]
        t.add_row(*row, style="red" if lv.get("failed") else None)
    return t
