"""Each engine's record against what the real engine showed: file names, step spans, rank counts, the
profiler protocol, the registry. Every row names the release the fact came from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import engines
from harness.engines import CaptureSettings, get_engine
from harness.errors import InputError

HARNESS = Path(__file__).resolve().parents[2] / "harness"


@pytest.mark.parametrize("engine, name, rank, seen_in", [
    ("vllm", "rank0.1796125680218160141.pt.trace.json.gz", ("0",), "vLLM 0.26.0 H200, dense model"),
    ("vllm", "rank1.1796124779063817282.pt.trace.json.gz", ("1",), "vLLM 0.32.0 CPU, -tp 2"),
    ("vllm", "dp0_pp0_tp1_dcp0_ep1_rank1.1796125680.pt.trace.json.gz", ("1",), "vLLM 0.26 with an EP group"),
    ("vllm", "x_rank3.1796125680.pt.trace.json.gz", ("3",), "vLLM 0.32 with profile_prefix x"),
    ("vllm", "vm_15880.async_llm.1796123778759659836.pt.trace.json.gz", None, "vLLM 0.32.0 CPU front end"),
    ("sglang", "1764500000.123-TP-3.trace.json.gz", ("3", None, None), "SGLang 0.5.23"),
    ("sglang", "1764500000.123-TP-1-DP-0-PP-1-EP-1.trace.json.gz", ("1", "0", "1"), "SGLang 0.5.23"),
    ("sglang", "merged-1764500000.123.trace.json.gz", None, "SGLang 0.5.23 merge_profiles"),
])
def test_trace_names_map_to_global_ranks_and_front_ends_to_none(engine, name, rank, seen_in):
    assert get_engine(engine).traces.rank_key(name) == rank, seen_in


def test_per_rank_drops_front_ends_and_keeps_the_preferred_split():
    vllm, sglang = get_engine("vllm").traces, get_engine("sglang").traces
    assert vllm.per_rank(["rank0.1.pt.trace.json.gz", "vm_1.async_llm.2.pt.trace.json.gz"]) == \
        ["rank0.1.pt.trace.json.gz"]
    split = ["1-TP-0-EXTEND.trace.json.gz", "1-TP-0-DECODE.trace.json.gz", "merged-1.trace.json.gz"]
    assert sglang.per_rank(split) == ["1-TP-0-DECODE.trace.json.gz"]
    assert sglang.rank_number("1-TP-3.trace.json.gz") == 3
    assert sglang.rank_number("1-TP-1-PP-1.trace.json.gz") is None      # two numbers: no single rank


@pytest.mark.parametrize("engine, span, stage, seen_in", [
    ("vllm", "execute_context_0(0)_generation_1(1)", "decode", "vLLM 0.26.0 H200 trace"),
    ("vllm", "execute_context_0(0)_generation_16(16)", "decode", "vLLM 0.26.0 H200, 16 streams"),
    ("vllm", "execute_context_1(2)_generation_0(0)", "prefill", "vLLM 0.26.0 H200 trace"),
    ("vllm", "execute_context_1(17)_generation_3(3)", "prefill", "mixed step: vLLM 0.32 scheduler"),
    ("vllm", "execute_context_0(0)_generation_0(0)", "", "vLLM 0.26.0 H200: 48 idle steps of 318"),
    ("vllm", "execute_20_context_1(sq17sk17sqsq289sqsk289)_generation_3(sq3sk96sqsq3sqsk96)", "prefill",
     "vLLM 0.26.0 and 0.32.0 gpu_worker.py annotate_profile, detailed_trace_annotation"),
    ("vllm", "execute_8_context_0(sq0sk0sqsq0sqsk0)_generation_8(sq8sk264sqsq8sqsk264)", "decode",
     "vLLM 0.32.0 detailed_trace_annotation"),
    ("vllm", "execute_0_context_0(sq0sk0sqsq0sqsk0)_generation_0(sq0sk0sqsq0sqsk0)", "",
     "vLLM 0.32.0 detailed_trace_annotation, an idle step"),
    ("vllm", "gpu_model_runner: forward", None, "vLLM 0.32.0 record_function, not a step"),
    ("sglang", "step[DECODE bs=8]", "decode", "SGLang 0.5.23 build_step_span_name"),
    ("sglang", "step[EXTEND bs=1 toks=1024]", "prefill", "SGLang 0.5.23"),
    ("sglang", "step[MIXED bs=4]", "prefill", "SGLang 0.5.23, chunked prefill"),
    ("sglang", "step[VERIFY bs=8]", "verify", "SGLang 0.5.23, speculative decoding"),
    ("sglang", "step[DRAFT bs=8]", "draft", "SGLang 0.5.23, draft worker"),
    ("sglang", "step[IDLE bs=0]", "", "SGLang 0.5.23, DP attention"),
    ("sglang", "aten::mm", None, "not a step"),
])
def test_step_span_names_give_their_stage(engine, span, stage, seen_in):
    assert get_engine(engine).steps.stage(span) == stage, seen_in


@pytest.mark.parametrize("engine, args, ranks", [
    ("vllm", {}, 1),
    ("vllm", {"tensor-parallel-size": 2}, 2),
    ("vllm", {"-tp": 4, "pipeline-parallel-size": 2}, 8),
    ("vllm", {"tp": 2, "dp": 2}, 4),
    ("sglang", {"tp-size": 8}, 8),
    ("sglang", {"tp-size": 8, "ep-size": 8}, 8),                  # EP lives inside the TP group
    ("sglang", {"tp-size": 8, "dp-size": 2}, 16),                 # replicas, each a TP group
    ("sglang", {"tp-size": 8, "dp-size": 8, "enable-dp-attention": True}, 8),
    ("sglang", {"--tp-size": 2, "pp-size": 2}, 4),
    ("sglang", {"tp-size": 8, "dp-size": 8, "--enable-dp-attention": True}, 8),   # spelled as on the command line
    ("sglang", {"tp-size": 8, "dp-size": 2, "enable-dp-attention": False}, 16),
    ("sglang", {"tp-size": 8, "attention-data-parallel-size": 4}, 8),
    ("sglang", {"tp-size": 8, "dp-size": 1, "attn-dp-size": 4, "enable-dp-attention": True}, 8),
    ("sglang", {"tp-size": 8, "dp-size": 4, "attn-dp-size": 1, "enable-dp-attention": True}, 8),
])
def test_ranks_follow_the_parallelism_flags(engine, args, ranks):
    assert get_engine(engine).ranks(args) == ranks


def test_a_rank_flag_that_is_not_a_number_is_bad_input_naming_the_flag():
    with pytest.raises(InputError, match="tp-size"):
        get_engine("sglang").ranks({"tp-size": "eight"})


def test_vllm_captures_a_bounded_number_of_steps_then_always_stops():
    """vLLM 0.32 keeps a session open after max_iterations until /stop_profile (a second start is a
    409); 0.26 reads the bound only from the launch flag, which the template also passes."""
    spec = get_engine("vllm").capture(CaptureSettings("/d", num_steps=10, start_step=3))
    assert spec["start"] == {"path": "/start_profile", "body": {"max_iterations": 10, "delay_iterations": 3}}
    assert spec["stop"] == {"path": "/stop_profile"} and spec["traffic"] == "flow" and spec["await"] == "files"


def test_sglang_never_stops_a_num_steps_capture_and_nsys_waits_for_the_exit():
    sglang = get_engine("sglang")
    spec = sglang.capture(CaptureSettings("/d", num_steps=5))
    assert spec["start"]["body"] == {"output_dir": "/d", "num_steps": 5, "activities": ["CPU", "GPU"]}
    assert spec["stop"] is None and spec["traffic"] == "flow"
    nsys = sglang.capture(CaptureSettings("/d", num_steps=5, nsys=True))
    assert nsys["start"]["body"]["activities"] == ["CUDA_PROFILER"] and nsys["start"]["body"]["start_step"] == 3
    assert nsys["await"] == "exit" and nsys["traffic"] == {"max_tokens": 12}


def test_the_simulator_is_the_imitated_engine_but_for_its_launcher():
    sim = get_engine("sim", "vllm")
    assert (sim.name, sim.speaks, sim.traces, sim.steps) == ("sim", "vllm", get_engine("vllm").traces,
                                                             get_engine("vllm").steps)
    assert sim.launcher == "python -m harness.sim vllm" and sim.ranks({"tp": 2}) == 2
    assert get_engine("sim").speaks == "sglang"


def test_an_engine_without_a_profiler_of_its_own_allows_only_the_torch_window():
    openai = get_engine("openai")
    assert openai.capture(CaptureSettings("/d", 1)) is None and openai.profile_modes == ("torch", "none")


def test_an_unknown_engine_names_the_known_ones():
    with pytest.raises(InputError, match="sglang, sim, vllm"):
        get_engine("tgi")


def test_registering_an_engine_makes_it_a_valid_playbook_engine():
    from harness.config.playbook import Playbook
    engines.register(engines.Engine(name="tgi-test", launcher="text-generation-launcher", module="",
                                    default_port=80, template="tgi.sh.j2"))
    try:
        pb = Playbook(name="x", hosts="h", engine="tgi-test", model={"path": "/m"}, configs=[{"name": "a"}])
        assert pb.engine == "tgi-test"
    finally:
        engines.base._REGISTRY.pop("tgi-test")


@pytest.mark.parametrize("room", ["lifecycle", "analysis", "config", "remote/agent.py", "plan.py", "executor.py"])
def test_no_room_outside_engines_has_engine_knowledge_in_its_code(room):
    """Engine names may appear in prose (docstrings, comments, descriptions), never as code that
    decides by engine: no string literal equal to an engine's name."""
    path = HARNESS / room
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    names = {e.name for e in engines.real_engines()}
    for file in files:
        for literal in re.findall(r"""(?<![\w.])["']([a-z]+)["']""", file.read_text()):
            assert literal not in names, f"{file.relative_to(HARNESS)} decides by engine: {literal!r}"
