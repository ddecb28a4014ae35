"""Hardware catalogue, cluster specs, TOML files, and measuring this machine."""

import pytest

from snugfit.errors import SnugfitError
from snugfit.hardware import GPUS, LocalHardware, get_gpu, load_cluster_toml, load_local, parse_cluster
from snugfit.hardware.catalogue import FSDP_COSTS

REQUIRED = ["V100-32GB", "T4", "A10", "L4", "A100-40GB-PCIe", "A100-40GB-SXM", "A100-80GB-PCIe", "A100-80GB-SXM",
            "RTX3090", "RTX4090", "RTX5090", "H100-PCIe", "H100-SXM", "H200"]


def test_catalogue_has_the_common_gpus_with_sane_figures():
    for name in REQUIRED:
        g = GPUS[name]
        assert g.memory_bytes >= 16 * 2**30 and g.hbm_gbps > 100 and g.tflops["float32"] > 1
        assert g.flops_per_s("bfloat16") >= g.flops_per_s("float32")
    assert get_gpu("h100-80gb").name == "H100-SXM" and get_gpu("V100").flops_per_s("bfloat16") > 0  # fp16 fallback


@pytest.mark.parametrize("spec,world,nodes", [("4xRTX4090", 4, 1), ("2x8xH100-80GB", 16, 2),
                                              ("2xRTX4090+2xRTX3090", 4, 2), ("A10", 1, 1), ("2xcpu", 2, 1)])
def test_cluster_specs(spec, world, nodes):
    cl = parse_cluster(spec)
    assert cl.world_size == world and len(cl.nodes) == nodes


def test_links_follow_the_topology():
    cl = parse_cluster("2x8xH100-80GB")
    assert cl.nodes[0].intra.name == "nvlink4" and cl.inter.name == "ib-ndr"
    assert cl.link_for([0, 7]).name == "nvlink4" and cl.link_for([7, 8]).name == "ib-ndr"
    assert parse_cluster("4xRTX4090").nodes[0].intra.name == "pcie4"
    mixed = parse_cluster("2xRTX4090+2xRTX3090")
    assert mixed.gpu_of(1).name == "RTX4090" and mixed.gpu_of(2).name == "RTX3090"


def test_unknown_names_suggest_close_matches():
    with pytest.raises(SnugfitError, match="RTX4090"):
        parse_cluster("4xRTX4009")
    with pytest.raises(SnugfitError, match="cluster term"):
        parse_cluster("2xA10+")


def test_toml_roundtrip(tmp_path):
    cl = parse_cluster("2xRTX4090+2xRTX3090", inter="eth-100g")
    path = tmp_path / "c.toml"
    path.write_text(cl.to_toml())
    back = load_cluster_toml(path)
    assert back.to_dict() | {"spec": ""} == cl.to_dict() | {"spec": ""}
    assert parse_cluster(str(path)).world_size == 4


def test_profile_hardware_measures_this_machine(tmp_path):
    from snugfit.hardware.measure import profile_hardware

    out = tmp_path / "hw.json"
    local = profile_hardware(out, collectives=False)
    assert local.device.name == "cpu" and local.device.tflops["float32"] > 1e-3
    assert local.host.adam_params_per_s > 1e6 and local.device.hbm_gbps > 0.1
    assert load_local(out) == local == LocalHardware.from_dict(local.to_dict())
    local.host.fsdp = {"2": {"gather": [1e-3, 0.0], "contention": [1.0]}}  # what an older snugfit measured
    local.save(out)
    assert load_local(out) is None  # so it is measured again, not read with costs missing


def test_gloo_collective_bandwidth_and_fsdp_overheads_between_two_processes():
    from snugfit.hardware.measure import measure_collectives

    link, fsdp, together = measure_collectives(2, nbytes=2**20)
    assert link.gbps > 0.01 and 0 < link.latency_s < 1 and 0 < together < 10
    assert set(fsdp) == set(FSDP_COSTS)
    # a gather of a 1 MB unit costs at least the collective's latency (timings beyond that are bench/'s)
    assert link.latency_s / 2 < fsdp["gather"][0] + 1e6 * fsdp["gather"][1] < 0.1
    assert all(fixed >= 0 and per_byte >= 0 for fixed, per_byte in fsdp.values())
