"""The decode roofline: the GLM-5 campaign's numbers, GPU names as nvidia-smi spells them, where the
bandwidth comes from, and how the batch and the KV cache move the bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.analysis.roofline import format_efficiency, gpu_bandwidth, roofline_for
from harness.config.playbook import load_playbook
from harness.results import BenchLevel, RunManifest

REPO = Path(__file__).resolve().parents[2]
GLM5 = {"path": "/models/GLM-5-NVFP4", "active_params_b": 40, "bytes_per_weight": 1.16,
        "kv_bytes_per_token": 44928}


def manifest(model=GLM5, *, gpus_used=8, host=None, smi_name="NVIDIA RTX PRO 6000 Blackwell Server Edition"):
    facts = {"gpus": [{"name": smi_name}] * 8} if smi_name else {"gpus": None}
    return RunManifest.model_validate({"run_id": "r-1", "sweep_id": "s", "config": {"name": "r"}, "status": "ok",
                                       "model": model, "gpus_used": gpus_used,
                                       "host": host or {"name": "blackwell-01"}, "facts": facts})


def level(concurrency=1, itl_p50=97.0, output_per_request=50):
    return BenchLevel(concurrency=concurrency, completed=4, output_tokens=4 * output_per_request,
                      itl_ms={"p50": itl_p50})


def test_the_glm5_campaign_on_eight_blackwells_is_3_24_ms_and_97_ms_measured_reads_3_3_percent():
    roof = roofline_for(manifest(), level(itl_p50=97.0), 16)
    assert round(roof["theoretical_ms"], 2) == 3.24
    assert round(roof["theoretical_tok_s"]) == 309
    assert format_efficiency(roof["efficiency"]) == "3.3%"
    # the GLM-5 campaign's "3.4%" is 3.24 against 95.3 ms
    assert format_efficiency(roofline_for(manifest(), level(itl_p50=95.3))["efficiency"]) == "3.4%"


def test_the_shipped_tp_vs_ep_playbook_carries_the_facts_that_give_3_24_ms():
    pb, _ = load_playbook(REPO / "playbooks" / "tp_vs_ep.yaml")
    roof = roofline_for(manifest(pb.model.model_dump()), level())
    assert round(roof["theoretical_ms"], 2) == 3.24


@pytest.mark.parametrize("name, known", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"), ("NVIDIA A100-SXM4-80GB", "A100 80GB"), ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("AMD Instinct MI300X", "MI300X"), ("H100 SXM", "H100 SXM"),
])
def test_gpus_are_known_by_the_names_nvidia_smi_and_inventories_use(name, known):
    assert gpu_bandwidth(name)[0] == known


def test_an_unknown_gpu_has_no_bandwidth_and_no_roofline():
    assert gpu_bandwidth("NVIDIA H100 PCIe") is None and gpu_bandwidth(None) is None
    assert roofline_for(manifest(smi_name="Tesla K80"), level()) is None


def test_the_inventory_bandwidth_wins_over_the_gpu_name():
    roof = roofline_for(manifest(host={"name": "h", "gpu_bandwidth_gbs": 3584}), level())
    assert roof["bandwidth_gbs"] == 3584 and roof["bandwidth_source"] == "inventory gpu_bandwidth_gbs"
    assert round(roof["theoretical_ms"], 2) == 1.62


def test_nvidia_smi_wins_over_the_inventory_gpu_name_which_is_the_last_resort():
    smi = roofline_for(manifest(host={"name": "h", "gpu": "H200"}), level())
    assert smi["bandwidth_gbs"] == 1792 and smi["bandwidth_source"].startswith("nvidia-smi")
    inventory = roofline_for(manifest(host={"name": "h", "gpu": "H200"}, smi_name=None), level())
    assert inventory["bandwidth_gbs"] == 4800 and inventory["bandwidth_source"].startswith("inventory gpu")


def test_without_model_facts_there_is_no_roofline():
    assert roofline_for(manifest({"path": "/models/x"}), level()) is None


def test_the_bound_splits_over_the_gpus_the_configuration_spans():
    one, eight = (roofline_for(manifest(gpus_used=n), level())["theoretical_ms"] for n in (1, 8))
    assert one == pytest.approx(8 * eight)


def test_a_batch_shares_the_weights_but_reads_every_sequences_kv_cache():
    model = {"active_params_b": 1, "bytes_per_weight": 1, "kv_bytes_per_token": 1e6}
    roof = roofline_for(manifest(model, gpus_used=1, host={"name": "h", "gpu_bandwidth_gbs": 1000}),
                        level(concurrency=8, itl_p50=10, output_per_request=50), prompt_tokens=100)
    assert roof["context_tokens"] == 125  # prompt + half the output: the mean over the decode steps
    assert roof["kv_bytes"] == 8 * 1e6 * 125
    assert roof["theoretical_ms"] == pytest.approx((1e9 + 8 * 1e6 * 125) / 1e12 * 1e3)  # 2 ms a step
    assert roof["theoretical_tok_s"] == pytest.approx(8 * 1000 / 2)
    assert roof["efficiency"] == pytest.approx(2 / 10)


def test_without_a_level_the_bound_is_one_sequence_with_an_empty_context():
    roof = roofline_for(manifest(), None)
    assert roof["concurrency"] == 1 and roof["kv_bytes"] == 0 and roof["efficiency"] is None


@pytest.mark.parametrize("efficiency, text", [(0.0334, "3.3%"), (0.45, "45%"), (0.0004, "0.04%"), (None, "-")])
def test_efficiency_reads_with_enough_digits(efficiency, text):
    assert format_efficiency(efficiency) == text
