"""A bench.json as a table: one row per concurrency level."""

from __future__ import annotations

from rich.table import Table


def render_bench(result: dict) -> Table:
    t = Table(title=f"{result.get('model')} at {result.get('url')}", header_style="bold")
    for col in ("conc", "done", "failed", "TTFT p50", "ITL p50", "ITL p99", "TPOT p50", "E2E p50", "tok/s",
                "req/s"):
        t.add_column(col, justify="right")
    for lv in result.get("levels", []):
        def q(metric: str, p: str, lv: dict = lv) -> str:
            v = (lv.get(metric) or {}).get(p)
            return "-" if v is None else f"{v:.1f}"
        t.add_row(str(lv["concurrency"]), str(lv["completed"]), str(lv["failed"]), q("ttft_ms", "p50"),
                  q("itl_ms", "p50"), q("itl_ms", "p99"), q("tpot_ms", "p50"), q("e2e_ms", "p50"),
                  f"{lv.get('output_tok_s') or 0:.1f}", f"{lv.get('requests_per_s') or 0:.2f}")
    return t
