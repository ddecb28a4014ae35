"""Collectives as NCCL runs them: bus bandwidth per link, rings and trees, and what overlapping them costs."""

import pytest

from snugfit.hardware import get_link, parse_cluster
from snugfit.plan.timing import (
    collective_time, nccl_sm_share, overlap_exposed, ring_time, tree_time,
)

GB = 1e9


def test_rings_run_at_nccl_bus_bandwidth_not_the_line_rate():
    nvlink = get_link("nvlink4")  # 450 GB/s line rate, 370 GB/s busbw
    assert ring_time("all_gather", GB, 8, nvlink) == pytest.approx(7 * 3e-6 + 7 / 8 * GB / 370e9)
    assert ring_time("all_reduce", GB, 8, nvlink) == pytest.approx(14 * 3e-6 + 14 / 8 * GB / 370e9)
    # gloo and Ethernet: no NCCL figure, the link's own rate (the CPU path's formula, unchanged)
    gloo = get_link("gloo-loopback")
    assert collective_time("all_reduce", GB, 2, gloo) == pytest.approx(2 * gloo.latency_s + GB / (gloo.gbps * 1e9))


def test_across_nodes_each_gpu_brings_its_nic_up_to_the_nodes_own_links():
    a100 = parse_cluster("8x8xA100-80GB")  # 8 HDR NICs per node (23 GB/s busbw each), NVLink 230 GB/s
    all64 = a100.link_for(list(range(64)))
    assert (all64.name, all64.nodes, all64.bus_gbps) == ("ib-hdr", 8, pytest.approx(8 * 23.0))
    assert a100.link_for(list(range(0, 64, 8))).bus_gbps == 23.0  # one rank per node: one NIC
    assert a100.link_for([0, 1]).name == "nvlink3" and a100.link_for([0, 1]).nodes == 1
    h100 = parse_cluster("2x8xH100")  # 8 x 46 = 368 GB/s of NDR NICs, under NVLink's 370
    assert h100.link_for(list(range(16))).bus_gbps == pytest.approx(368.0)
    eth = parse_cluster("2x2xRTX4090")  # one Ethernet NIC per node: no rails, the link's rate
    assert eth.link_for([0, 1, 2, 3]).bus_gbps == 0.0
    assert collective_time("all_gather", GB, 4, eth.link_for([0, 1, 2, 3])) == pytest.approx(
        3 * 20e-6 + 0.75 * GB / 2.8e9)


def test_tree_beats_ring_for_small_all_reduces_across_many_nodes_and_loses_for_large_ones():
    link = parse_cluster("128x8xA100-80GB").link_for(list(range(1024)))
    small, large = 1e6, 1e9
    # tree: up and down a chain of 7 inside the node and log2(128) = 7 network hops, at min(0.9 x 184, 80) GB/s
    assert tree_time(small, 1024, link) == pytest.approx(2 * (7 + 7) * 3e-6 + 2 * small / 80e9)
    assert tree_time(small, 1024, link) < ring_time("all_reduce", small, 1024, link) / 10
    assert collective_time("all_reduce", small, 1024, link) == tree_time(small, 1024, link)
    assert collective_time("all_reduce", large, 1024, link) == ring_time("all_reduce", large, 1024, link)
    # inside a node, and for gathers, NCCL rings
    nvlink = get_link("nvlink3")
    assert collective_time("all_reduce", small, 8, nvlink) == ring_time("all_reduce", small, 8, nvlink)
    assert collective_time("all_gather", small, 1024, link) == ring_time("all_gather", small, 1024, link)


def test_overlap_hides_a_shorter_collective_at_the_cost_of_nccls_sms_and_exposes_the_excess():
    h100 = parse_cluster("H100").gpu_of(0)
    share = nccl_sm_share(h100, get_link("nvlink4"))
    assert share == pytest.approx(16 / 132)  # 370 GB/s at 24 GB/s a channel: 16 channels, an SM each
    assert nccl_sm_share(h100, get_link("pcie5")) == pytest.approx(2 / 132)  # PCIe: NCCL's 2 channels
    toll = share / (1 - share)  # compute on the SMs NCCL leaves
    assert overlap_exposed(1.0, 3.0, share) == pytest.approx(toll)
    assert overlap_exposed(3.0, 1.0, share) == pytest.approx(2.0 + toll)
    assert overlap_exposed(3.0, 1.0, 0.0) == 2.0 and overlap_exposed(1.0, 3.0, 0.0) == 0.0
    # CPU ranks: nothing overlaps, no toll
    assert nccl_sm_share(parse_cluster("cpu").gpu_of(0), get_link("gloo-loopback")) == 0.0
