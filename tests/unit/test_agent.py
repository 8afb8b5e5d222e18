"""The host agent's own logic that needs no host: reading why a server died from its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.remote.agent import root_error

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def test_the_root_cause_is_found_under_the_wrappers_of_each_process(tmp_path):
    """vLLM 0.32.0 (CPU build) with --kv-cache-dtype fp8 on a CPU without AVX-512: the Worker raises,
    EngineCore and the API server each wrap it ("see root cause above"), and warnings that quote
    an exception's name come first."""
    assert root_error(str(LOGS / "vllm-0.32.0-cpu-kv-fp8.log")) == (
        "(Worker pid=24650) ERROR 12-01 12:14:13 [multiproc_executor.py:1063] NotImplementedError: "
        "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")


@pytest.mark.parametrize("log, expected", [
    ("loading\nvllm: error: unrecognized arguments: --enforce-eagr\n",
     "vllm: error: unrecognized arguments: --enforce-eagr"),
    ("a\nRuntimeError: Engine core initialization failed. See root cause above.\n",
     "RuntimeError: Engine core initialization failed. See root cause above."),
    ("all fine\nbye\n", ""),
])
def test_an_argparse_error_a_lone_wrapper_or_nothing(tmp_path, log, expected):
    path = tmp_path / "server.log"
    path.write_text(log)
    assert root_error(str(path)) == expected


def test_a_missing_log_says_nothing(tmp_path):
    assert root_error(str(tmp_path / "none.log")) == ""
