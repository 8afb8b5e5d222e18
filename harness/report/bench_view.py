"""A bench.json as a table: one row per concurrency level, milliseconds unless the column says."""

from __future__ import annotations

from rich.table import Table

from harness.remote.bench import several_per_chunk


def render_bench(result: dict) -> Table:
    levels = result.get("levels", [])
    per_token = any(several_per_chunk(lv) for lv in levels)
    t = Table(title=f"{result.get('model')} at {result.get('url')}", header_style="bold")
    columns = ["conc", "done", "failed", "TTFT p50", "ITL p50", "ITL p99"]
    columns += ["ITL/tok p50", "tok/chunk"] if per_token else []
    columns += ["TPOT p50", "E2E p50", "tok/s", "req/s"]
    for col in columns:
        t.add_column(col, justify="right")
    for lv in levels:
        def q(metric: str, p: str, lv: dict = lv) -> str:
            v = (lv.get(metric) or {}).get(p)
            return "-" if v is None else f"{v:.1f}"
        row = [str(lv["concurrency"]), str(lv["completed"]), str(lv["failed"]), q("ttft_ms", "p50"),
               q("itl_ms", "p50"), q("itl_ms", "p99")]
        if per_token:
            row += [q("itl_token_ms", "p50"), f"{lv.get('tokens_per_chunk') or 1:.2f}"]
        row += [q("tpot_ms", "p50"), q("e2e_ms", "p50"), f"{lv.get('output_tok_s') or 0:.1f}",
                f"{lv.get('requests_per_s') or 0:.2f}"]
        t.add_row(*row)
    return t
