"""Hardware catalogue, cluster specs, TOML files, and measuring this machine."""

import os
import time

import pytest
import torch

from snugfit.errors import SnugfitError
from snugfit.hardware import (GPU, GPUS, Cluster, Host, LocalHardware, get_gpu, get_link, load_cluster_toml, load_local,
                              parse_cluster)
from snugfit.hardware.catalogue import FSDP_COSTS, MMAP_THRESHOLD_BYTES
from snugfit.hardware.cluster import make_node

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
    assert parse_cluster("4xRTX4090").nodes[0].intra.name == "pcie4-host"  # no peer-to-peer on GeForce Ada
    mixed = parse_cluster("2xRTX4090+2xRTX3090")
    assert mixed.gpu_of(1).name == "RTX4090" and mixed.gpu_of(2).name == "RTX3090"
    uneven = parse_cluster("3xRTX4090+1xRTX3090+2xA10")
    assert [uneven.node_of(r) for r in range(6)] == [0, 0, 0, 1, 2, 2]
    for rank in (-1, 6):
        with pytest.raises(SnugfitError, match="outside a cluster of 6 GPUs"):
            uneven.node_of(rank)


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


def test_a_measured_card_keeps_its_figures_through_a_cluster_file(tmp_path):
    """profile-hardware --toml, then plan --cluster: the card's SM count and generation (GEMMs by tile and wave,
    attention as its generation runs it) and its measured host costs survive; they were dropped, and a measured
    H200 was planned at one flat rate for every GEMM and for attention."""
    card = GPU("NVIDIA H200", 140 * 2**30, {"float32": 50.8, "bfloat16": 711.8}, 3953.9, 5, matmul_efficiency=1.0,
               mem_efficiency=1.0, op_overhead_s=13.6e-6, sac_overhead_s=21e-6, sms=132, arch="hopper",
               attention_tflops=[255.0, 250.0])
    cl = Cluster([make_node(card.name, 1, custom={card.name: card})], get_link("pcie5"), "")
    path = tmp_path / "measured.toml"
    path.write_text(cl.to_toml())
    assert load_cluster_toml(path).gpu_of(0) == card


def test_a_card_profile_hardware_measured_here_is_planned_as_measured():
    """`snugfit train` on a GPU plans with the cached measurement of the card it runs on (rates, attention, host
    step), under the catalogue's name and NVLink, where the catalogue's datasheet figures were all it used."""
    from snugfit.hardware.catalogue import measured_card

    card = GPU("local-cuda", 150109880320, {"bfloat16": 711.8}, 3953.9, 5, matmul_efficiency=1.0, sms=132,
               arch="hopper", attention_tflops=[255.0, 250.0])
    local = LocalHardware(card, Host(adam_params_per_s=1.1e9))
    h200 = measured_card("NVIDIA H200", 150109880320, 132, local)
    assert (h200.name, h200.nvlink, h200.tflops, h200.attention_tflops) == ("H200", "nvlink4", card.tflops, [255, 250])
    assert measured_card("NVIDIA H100 80GB HBM3", 85520809984, 132, local) is None  # another card
    assert measured_card("NVIDIA H200", 150109880320, 132, None) is None  # never measured
    assert measured_card("NVIDIA Mystery 9000", 150109880320, 132, local).name == "NVIDIA Mystery 9000"


def test_profile_hardware_measures_this_machine(tmp_path):
    import snugfit.calibrate.hardware as hardware

    out = tmp_path / "hw.json"
    local = hardware.profile_hardware(out, collectives=False)
    assert local.device.name == "cpu" and local.device.tflops["float32"] > 1e-3
    assert local.host.adam_params_per_s > 1e6 and local.device.hbm_gbps > 0.1
    # what a decoder's step reaches of the loop-measured rates (step_efficiencies, in a process of its own), which
    # flops_per_s and mem_bytes_per_s charge; a positional GPU(...) once made them 1 or 0
    dev = local.device
    assert dev.matmul_efficiency not in (0, 1) and dev.mem_efficiency not in (0, 1)
    assert 1e8 < dev.page_in_bytes_per_s < 1e12  # a 4 KiB page in 4 ns to 40 us
    assert dev.flops_per_s("float32") == pytest.approx(dev.tflops["float32"] * 1e12 * dev.matmul_efficiency)
    assert dev.mem_bytes_per_s() == pytest.approx(dev.hbm_gbps * 1e9 * dev.mem_efficiency)
    assert len(local.device.attention_tflops) == 2 and min(local.device.attention_tflops) > 1e-4
    assert 1e-7 < local.device.op_overhead_s < 1e-3 and 0 <= local.device.sac_overhead_s < 1e-3
    assert load_local(out) == local == LocalHardware.from_dict(local.to_dict())
    assert local.measured_at > time.time() - 600 and 0 <= local.other_load <= 1
    local.host.fsdp = {"2": {"gather": [1e-3, 0.0], "contention": [1.0]}}  # what an older snugfit measured
    local.save(out)
    assert load_local(out) is None  # so it is measured again, not read with costs missing


def test_a_step_s_operators_are_timed_by_their_roofline_kind():
    """step_efficiencies' timer charges each operator's seconds to the work the profile counts for it
    (profile.record.op_cost): a linear layer's FLOPs, a memory-bound operator's bytes read and written."""
    from snugfit.calibrate.hardware import _OpTimer

    x, w = torch.randn(64, 32), torch.randn(16, 32)
    timer = _OpTimer()
    with timer:
        y = torch.nn.functional.linear(x, w)
        z = y + y
        z.view(-1)
    # linear's transpose and the views move nothing; the add reads two inputs and writes one output
    assert [(kind, work) for kind, work, _, _ in timer.ops if kind != "none"] == [
        ("gemm", 2 * 64 * 16 * 32), ("memory", 3 * z.numel() * 4)]
    assert {work for kind, work, _, _ in timer.ops if kind == "none"} == {0}
    assert timer.totals("gemm")[1] > 0 and timer.totals("memory")[1] > 0


def test_an_operator_s_fresh_bytes_are_the_large_tensors_it_allocates():
    """What the profile counts as paged in (profile.record.op_cost's fresh_bytes): the new tensors of
    MMAP_THRESHOLD_BYTES or more an operator returns; not smaller ones, views, or tensors written in place."""
    from snugfit.profile.record import op_cost

    aten = torch.ops.aten
    big, small = torch.ones(MMAP_THRESHOLD_BYTES // 4), torch.ones(MMAP_THRESHOLD_BYTES // 8)
    doubled = aten.mul.Tensor(big, 2)
    assert op_cost(aten.mul.Tensor, (big, 2), {}, doubled).fresh_bytes == MMAP_THRESHOLD_BYTES
    assert op_cost(aten.add_.Tensor, (doubled, 1), {}, aten.add_.Tensor(doubled, 1)).fresh_bytes == 0
    assert op_cost(aten.view.default, (doubled, [-1]), {}, aten.view.default(doubled, [-1])).fresh_bytes == 0
    assert op_cost(aten.mul.Tensor, (small, 2), {}, aten.mul.Tensor(small, 2)).fresh_bytes == 0
    # a matmul's output counts as any other's
    a, b = torch.ones(1024, 64), torch.ones(64, MMAP_THRESHOLD_BYTES // 4 // 1024)
    assert op_cost(aten.mm.default, (a, b), {}, aten.mm.default(a, b)).fresh_bytes == MMAP_THRESHOLD_BYTES


# a run's start: the threshold fixed before any large block was freed (glibc's own rises with each one freed, and
# then serves them from its heap)
_FAULTS = """
import json, resource, torch
from snugfit.hardware.catalogue import MMAP_THRESHOLD_BYTES
from snugfit.runtime.host_alloc import return_freed_host_memory
assert return_freed_host_memory()
live = [torch.ones(MMAP_THRESHOLD_BYTES // 4) for _ in range(8)]
del live[::2]  # freed between live ones, as a step frees its activations
faults = []
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = [torch.ones(MMAP_THRESHOLD_BYTES // 4) for _ in range(4)]
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
    del again
print(json.dumps(min(faults)))
"""


def test_large_tensors_are_paged_in_afresh():
    """What the time model's page-in charge stands on (OpCost.fresh_bytes, GPU.page_in_bytes_per_s): with the host
    allocator as snugfit's ranks run it, each new tensor of MMAP_THRESHOLD_BYTES or more faults in every page it
    writes, step after step, though blocks as large were freed just before."""
    import json
    import subprocess
    import sys

    if "[always]" in _read("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("transparent huge pages fault 2 MiB at a time")
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        pytest.skip("the host allocator is not glibc's, or the user set its threshold")
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) >= 0.95 * MMAP_THRESHOLD_BYTES // os.sysconf("SC_PAGE_SIZE")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def test_probes_are_timed_by_the_clock_a_bench_chooses():
    """bench/speed.py --cpu-time times the machine's probes in CPU time (use_clock), which other jobs on a shared
    machine do not stretch; the wall clock otherwise."""
    from snugfit.calibrate import timers

    ticks = iter(range(0, 100, 5))
    try:
        timers.use_clock(lambda: float(next(ticks)))
        assert timers.best_time(lambda: None, 3) == 5.0
    finally:
        timers.use_clock(time.perf_counter)
    assert timers._clock[0] is time.perf_counter


def test_gloo_collective_bandwidth_and_fsdp_overheads_between_two_processes():
    from snugfit.calibrate.local_ranks import measure_collectives

    link, fsdp, together = measure_collectives(2, nbytes=2**20)
    assert link.gbps > 0.01 and 0 < link.latency_s < 1 and 0 < together < 10
    assert set(fsdp) == set(FSDP_COSTS)
    # a gather of a 1 MB unit costs at least the collective's latency (timings beyond that are bench/'s)
    assert link.latency_s / 2 < fsdp["gather"][0] + 1e6 * fsdp["gather"][1] < 0.1
    assert all(fixed >= 0 and per_byte >= 0 for fixed, per_byte in fsdp.values())


GiB = 2**30


@pytest.mark.parametrize("device_name, memory_gib, entry", [
    ("NVIDIA H100 80GB HBM3", 79.1, "H100-SXM"),
    ("NVIDIA H100 PCIe", 79.6, "H100-PCIe"),
    ("NVIDIA H200", 139.8, "H200"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB-SXM"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB-SXM"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100-40GB-PCIe"),
    ("NVIDIA A100 80GB PCIe", 79.2, "A100-80GB-PCIe"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090"),
    ("NVIDIA GeForce RTX 3090", 23.7, "RTX3090"),
    ("NVIDIA GeForce RTX 5090", 31.4, "RTX5090"),
    ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"),
    ("Tesla T4", 14.6, "T4"),
    ("NVIDIA A10", 22.0, "A10"),
    ("NVIDIA L4", 22.0, "L4"),
    # other cards than any entry: measured, never taken for a neighbour
    ("NVIDIA GeForce RTX 3090 Ti", 23.7, None),
    ("NVIDIA A10G", 22.0, None),
    ("Tesla V100-PCIE-32GB", 31.7, None),  # the catalogue's V100s are the NVLink (SXM2) parts
    ("NVIDIA H100 PCIe", 94.0, None),  # memory that contradicts the entry (a 94 GB part)
])
def test_torch_device_names_find_their_catalogue_entry(device_name, memory_gib, entry):
    from snugfit.hardware.catalogue import gpu_for_device
    gpu = gpu_for_device(device_name, int(memory_gib * GiB))
    assert (gpu.name if gpu else None) == entry


def test_an_unknown_card_is_measured_from_its_properties():
    from snugfit.calibrate.hardware import measure_accelerator
    gpu, link = measure_accelerator("NVIDIA Mystery 9000", dev="cpu", size=128)
    assert gpu.name == "NVIDIA Mystery 9000"
    assert set(gpu.tflops) >= {"float32", "float16", "bfloat16"} and all(t > 0 for t in gpu.tflops.values())
    assert gpu.hbm_gbps > 0 and link.gbps > 0
    assert gpu.matmul_efficiency == 1.0  # measured rates are what kernels reach, not a datasheet's
    assert len(gpu.attention_tflops) == 2 and min(gpu.attention_tflops) > 0  # whatever kernel SDPA picks there
    # its PCIe generation from the measured link: the node's offload link is then a catalogue one (a measured
    # card used to get generation 0, and planning for it failed on 'unknown link pcie0')
    node = make_node(gpu.name, 1, custom={gpu.name: gpu})
    assert gpu.pcie_gen in (3, 4, 5) and node.pcie.name == f"pcie{gpu.pcie_gen}"


@pytest.mark.parametrize("accelerator", [False, True])
def test_collectives_are_measured_in_processes_of_the_fork_server(monkeypatch, accelerator):
    """Never a fork of this process: a forked child of a threaded torch process deadlocked in a futex (the test
    suite), and one of a process whose autograd ran on a GPU dies ('Unable to handle autograd's threading in
    combination with fork-based multiprocessing': profile-hardware on an H200)."""
    import torch.multiprocessing as mp

    from snugfit.calibrate.local_ranks import measure_collectives

    methods = []

    def start_processes(*args, start_method, **kwargs):
        methods.append(start_method)
        raise RuntimeError("not started")

    monkeypatch.setattr(mp, "start_processes", start_processes)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    with pytest.raises(RuntimeError, match="not started"):
        measure_collectives(2)
    assert methods == ["forkserver"]


def test_gpus_without_peer_access_disable_nccl_p2p(monkeypatch):
    from snugfit.runtime.dist import disable_p2p_without_peer_access, missing_peer_access
    assert missing_peer_access(4, lambda a, b: True) is None
    assert missing_peer_access(4, lambda a, b: {a, b} != {1, 3}) == (1, 3)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert not disable_p2p_without_peer_access(2, lambda a, b: True)
    assert "NCCL_P2P_DISABLE" not in os.environ
    assert disable_p2p_without_peer_access(2, lambda a, b: False)
    assert os.environ["NCCL_P2P_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")  # the user's own setting wins
    assert not disable_p2p_without_peer_access(2, lambda a, b: False)


def test_gpus_without_peer_access_talk_through_host_memory_in_the_cluster_model(tmp_path):
    """So the time model charges what NCCL does with NCCL_P2P_DISABLE=1: each byte crosses PCIe twice."""
    consumer, workstation = parse_cluster("2xRTX4090").nodes[0], parse_cluster("2xRTX-A6000").nodes[0]
    assert consumer.intra.name == "pcie4-host" and workstation.intra.name == "pcie4"
    assert consumer.intra.gbps == workstation.intra.gbps / 2
    assert consumer.pcie.name == "pcie4"  # offload traffic still goes straight to host
    path = tmp_path / "gaming.toml"
    path.write_text(parse_cluster("2xRTX4090").to_toml())
    assert parse_cluster(str(path)).nodes[0].intra.name == "pcie4-host"
    custom = tmp_path / "custom.toml"
    custom.write_text('[[gpu]]\nname = "X"\nmemory_gib = 24\ntflops = { bfloat16 = 100 }\nhbm_gbps = 900\n'
                      'pcie_gen = 4\np2p = false\n\n[[node]]\ngpu = "X"\ncount = 2\n')
    cl = parse_cluster(str(custom))
    assert cl.nodes[0].intra.name == "pcie4-host" and "p2p = false" in cl.to_toml()


def test_a_cluster_file_defines_gpus_and_host_the_catalogue_lacks(tmp_path):
    path = tmp_path / "lab.toml"
    path.write_text("""
[host]
ram_gib = 512
cores = 64

[[gpu]]
name = "LabCard"
memory_gib = 40
tflops = { float32 = 30, bfloat16 = 120 }
hbm_gbps = 1200
pcie_gen = 5

[[node]]
gpu = "LabCard"
count = 4
""")
    cluster = parse_cluster(str(path))
    gpu, node = cluster.gpu_of(0), cluster.nodes[0]
    assert (gpu.name, gpu.memory_bytes, gpu.flops_per_s("bfloat16")) == ("LabCard", 40 * 2**30, 120e12 * 0.6)
    assert (node.host.ram_bytes, node.host.cores, node.pcie.name, cluster.world_size) == (512 * 2**30, 64, "pcie5", 4)
    again = tmp_path / "again.toml"
    again.write_text(cluster.to_toml())
    assert load_cluster_toml(again).gpu_of(3) == gpu  # to_toml writes the [[gpu]] table back
    path.write_text('[[gpu]]\nname = "X"\n[[node]]\ngpu = "X"\n')
    with pytest.raises(SnugfitError, match="lacks memory_gib, tflops, hbm_gbps, pcie_gen"):
        parse_cluster(str(path))


@pytest.mark.parametrize("spec", ["4xA6000", "8xMI300X", "2xL40S", "8xH800", "4xH100-NVL", "2xRTX4080"])
def test_common_cards_plan_from_the_catalogue(spec):
    from snugfit.plan.search import search
    from tests.test_search import synth

    res = search(synth(8, 1024), parse_cluster(spec), global_batch=8, alternatives=0)
    assert res.best.predicted.fits and res.best.predicted.tokens_per_s > 0


def test_a_profile_without_the_one_thread_figure_is_measured_again(tmp_path, monkeypatch):
    """Local ranks run one thread each: a cached CPU profile that does not say how much slower that is, is stale."""
    from snugfit.hardware.catalogue import hardware_cache_path

    monkeypatch.setenv("SNUGFIT_HARDWARE_PROFILE", str(tmp_path / "bench.json"))
    assert hardware_cache_path() == tmp_path / "bench.json"  # a bench keeps its own, apart from the user's
    local = LocalHardware(get_gpu("cpu"), Host(cores=2), {})
    local.save(tmp_path / "bench.json")
    assert load_local() is None
    local.host.thread_slowdown = 1.8
    local.save(tmp_path / "bench.json")
    assert load_local().host.thread_slowdown == 1.8


def test_cpu_ranks_compute_at_one_thread_each():
    from dataclasses import replace

    from snugfit.plan.cpu_ranks import cpu_share

    node = parse_cluster("2xcpu").nodes[0]
    node = replace(node, host=replace(node.host, cores=2, fsdp={}, thread_slowdown=1.8))
    assert cpu_share(node) == pytest.approx(1.8)  # 2 ranks on 2 cores: no crowding, but one thread each
    assert cpu_share(replace(node, count=1)) == 1.0  # one process runs with every thread


def test_one_process_runs_on_the_local_accelerator(monkeypatch):
    """`snugfit train` without torchrun on a GPU machine trained on the CPU (seen on an H200): the one-process
    environment took DistEnv's default device instead of the local accelerator."""
    from snugfit.runtime import dist as dist_mod

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(dist_mod, "pick_device", lambda local_rank: torch.device("meta"))
    env = dist_mod.init_distributed()
    assert env.device == torch.device("meta") and env.world_size == 1


def test_other_processes_work_is_seen_as_load():
    """hardware.load.OtherLoad: a process spinning beside this one shows as others' share of the cores (one of
    this machine's cores: above the share that makes a measurement provisional)."""
    import subprocess
    import sys

    from snugfit.hardware.load import BUSY_SHARE, OtherLoad

    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        with OtherLoad() as load:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert load.share > min(BUSY_SHARE, 0.8 / (os.cpu_count() or 1))


def test_a_measurement_taken_under_load_is_taken_again_once_the_machine_is_quiet(tmp_path, monkeypatch):
    """A profile measured while other jobs kept the cores busy describes them: load_local drops it when the
    machine is quiet now (the next run measures again), and keeps it while the load lasts; a profile measured on a
    quiet machine is kept either way."""
    import snugfit.hardware.catalogue as catalogue

    gpu = GPU("cpu", 8 * 2**30, {"float32": 0.1}, 10.0, 0, None, "gloo-loopback")
    host = Host(ram_bytes=8 * 2**30, cores=2, thread_slowdown=1.0)
    for measured_under, now, kept in ((0.6, 0.05, False), (0.6, 0.7, True), (0.05, 0.05, True), (0.05, 0.9, True)):
        path = tmp_path / f"hw_{measured_under}_{now}.json"
        LocalHardware(gpu, host, other_load=measured_under, measured_at=time.time()).save(path)
        monkeypatch.setattr(catalogue, "other_load_now", lambda: now)
        assert (load_local(path) is not None) == kept, (measured_under, now)


def test_a_name_that_stands_for_several_cards_says_which_it_took(tmp_path, capsys):
    """'8xA100' plans the 80 GB SXM card: `snugfit plan` says so in its first lines, and what else the name could
    mean; a name of one card says nothing."""
    import json

    from snugfit.cli import main
    from snugfit.hardware.cluster import card_note
    from snugfit.model.decoder import ModelConfig

    assert parse_cluster("2xA100+1xRTX4090").notes == (card_note("A100"),)
    assert "H100-SXM" in card_note("H100-80GB") and "H100-PCIe" in card_note("H100-80GB")
    assert card_note("A100-80GB-SXM") is card_note("RTX4090") is card_note("H200") is None
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32).to_dict()))
    assert main(["plan", "--model", str(model), "--cluster", "8xA100", "--seq", "32", "--global-batch", "8",
                 "--profile-cache", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[:3]
    assert any("A100 is taken as the A100-80GB-SXM" in line and "A100-40GB-PCIe" in line for line in first), first
