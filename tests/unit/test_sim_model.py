"""The simulated engine's latency model: the GLM-5 campaign's numbers by default, and each flag moving them."""

from __future__ import annotations

import pytest

from harness.sim import flags
from harness.sim.knobs import KnobError, from_env, parse_faults
from harness.sim.model import LatencyModel


def model(engine: str, *args: str) -> LatencyModel:
    argv = ["--model-path", "m", *args] if engine == "sglang" else ["serve", "m", *args]
    return LatencyModel(flags.sim_config(engine, flags.parse(engine, argv)))


BASE_FLAGS = ("--tp-size", "8", "--kv-cache-dtype", "fp8_e4m3")


def test_the_default_scale_is_the_glm5_campaigns_tp8_measurement():
    m = model("sglang", *BASE_FLAGS)
    assert m.itl_ms(1) == pytest.approx(97.0, abs=0.1)
    assert m.ttft_ms(16) == pytest.approx(175.0, abs=0.5)
    assert m.step_ms(1)["copy"] / m.itl_ms(1) == pytest.approx(0.69, abs=0.01)


def test_an_unquantized_kv_cache_skips_the_cast_and_is_about_30ms():
    assert model("sglang", "--tp-size", "8").itl_ms(1) == pytest.approx(30.0, abs=0.1)
    assert "copy" not in {k.category for k in model("sglang", "--tp-size", "8").step_kernels()}


@pytest.mark.parametrize("faster", [("--enable-mscclpp",), ("--ep-size", "8"), ("--enable-two-batch-overlap",),
                                    ("--enable-torch-compile",)])
def test_communication_and_fusion_flags_help_a_little(faster):
    base = model("sglang", *BASE_FLAGS).itl_ms(1)
    assert 0.9 * base < model("sglang", *BASE_FLAGS, *faster).itl_ms(1) < base


@pytest.mark.parametrize("engine,eager", [("sglang", ("--disable-cuda-graph",)),
                                          ("sglang", ("--cuda-graph-backend-decode", "disabled")),
                                          ("vllm", ("--enforce-eager",)), ("vllm", ("-O0",)),
                                          ("vllm", ("-cc.cudagraph_mode=NONE",))])
def test_running_without_cuda_graphs_costs_launch_overhead(engine, eager):
    assert model(engine, *eager).itl_ms(1) > model(engine).itl_ms(1) + 10


def test_fewer_gpus_make_each_step_slower():
    assert model("sglang", "--tp-size", "4").itl_ms(1) > model("sglang", "--tp-size", "8").itl_ms(1)
    assert model("vllm", "-tp", "4").itl_ms(1) > model("vllm", "-tp", "8").itl_ms(1)


def test_vllm_expert_parallel_spans_tp_times_dp():
    assert model("vllm", "-tp", "4", "-dp", "2", "-ep").config.ep == 8
    assert model("vllm", "-tp", "4", "-dp", "2").config.ep == 1


def test_batching_grows_itl_sub_linearly_and_prompts_grow_ttft():
    m = model("sglang", *BASE_FLAGS)
    assert m.itl_ms(1) < m.itl_ms(8) < m.itl_ms(64) < 8 * m.itl_ms(1)
    assert m.ttft_ms(1000) > m.ttft_ms(16)


def test_the_kernels_of_a_step_add_up_to_its_busy_time():
    m = model("sglang", *BASE_FLAGS)
    busy = sum(k.us for k in m.step_kernels(4)) / 1000
    assert busy == pytest.approx(m.itl_ms(4) - m.step_ms(4)["idle"], rel=0.01)


def test_knobs_read_the_environment_and_name_a_bad_value():
    k = from_env({"HARNESS_SIM_TIME_SCALE": "0.1", "HARNESS_SIM_FAULT": "crash_after=3,profile_500"})
    assert k.time_scale == 0.1 and k.startup_s == pytest.approx(0.2)
    assert k.faults.crash_after == 3 and k.faults.profile_500 and not k.faults.never_healthy
    with pytest.raises(KnobError, match="HARNESS_SIM_FAULT"):
        parse_faults("explode")
    with pytest.raises(KnobError, match="HARNESS_SIM_TIME_SCALE"):
        from_env({"HARNESS_SIM_TIME_SCALE": "fast"})


@pytest.mark.parametrize("raw,every", [(None, None), ("", None), ("0", None), ("1", 1), ("2", 2)])
def test_empty_text_every_reads_a_whole_number_and_zero_is_off(raw, every):
    env = {} if raw is None else {"HARNESS_SIM_EMPTY_TEXT_EVERY": raw}
    assert from_env(env).empty_text_every == every


@pytest.mark.parametrize("raw", ["two", "1.5", "-2"])
def test_empty_text_every_names_a_bad_value(raw):
    with pytest.raises(KnobError, match="HARNESS_SIM_EMPTY_TEXT_EVERY"):
        from_env({"HARNESS_SIM_EMPTY_TEXT_EVERY": raw})
