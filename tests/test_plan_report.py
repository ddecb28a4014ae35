"""What `snugfit plan` prints is exact: the verdict names the binding limit, every report shows the peak rank's
memory by category, the start-up peak and the host memory against its RAM (said to be assumed where it is), the
gradients under their own name, offload on one rank as offload, no float noise as a phase, and a tie broken
openly. Synthetic profiles: torch-free and fast."""

from __future__ import annotations

from dataclasses import replace

from snugfit.hardware import parse_cluster
from snugfit.hardware.cluster import with_host_ram
from snugfit.plan.estimate import estimate
from snugfit.plan.explain import (
    format_result, memory_lines, phases_line, summary, verdict_line, why_not_the_fastest,
)
from snugfit.plan.memory import device_bytes
from snugfit.plan.plan import BlockPlan, Plan, Prediction
from snugfit.plan.search import search
from tests.test_memory_model import synthetic_profile
from tests.test_search import MODELS

GiB = 2**30


def _plan(n=8, **kw) -> Plan:
    kw.setdefault("root", BlockPlan(zero=kw["block"].zero) if "block" in kw else None)
    return Plan.uniform(n, seq_len=1024, compute_dtype="bfloat16", **kw)


def test_the_verdict_names_the_binding_limit_gpu_or_host():
    prof = synthetic_profile()
    plan = _plan(dp=2, block=BlockPlan(zero=3, placement="params_on_host"))
    roomy = estimate(plan, prof, parse_cluster("2xRTX4090"))
    assert roomy.fits and verdict_line(roomy).startswith("fits: peak ")
    host = roomy.host_memory
    small_host = with_host_ram(parse_cluster("2xRTX4090"), int(host["startup"] / 0.9) - 2**20)  # start-up over
    pred = estimate(plan, prof, small_host)
    line = verdict_line(pred)
    assert not pred.fits and line.startswith("does NOT fit: host memory is the limit: node 0 needs "), line
    assert f"{pred.host_memory['startup'] / GiB:.1f} GiB at start-up" in line and "the GPUs fit: peak" in line
    small_gpu = estimate(plan, prof, parse_cluster("2xRTX4090"), memory_budget_bytes=2**20)
    line = verdict_line(small_gpu)
    assert line.startswith("does NOT fit: GPU memory is the limit: peak ") and "over by" in line, line
    assert "host memory" not in line


def test_a_searched_plan_shows_its_memory_by_category_start_up_and_host_as_the_what_if_does():
    cluster = parse_cluster("2xRTX4090")
    res = search(MODELS["small"], cluster, global_batch=8, alternatives=0)
    text = format_result(res, cluster)
    pred = res.best.predicted
    peak_rank = max(pred.memory_by_rank, key=device_bytes)
    header = next(line for line in text.splitlines() if line.strip().startswith("rank "))
    for cat, value in peak_rank.items():
        assert cat in header and f"{value / GiB:.3f}" in text, cat
    assert f"{device_bytes(peak_rank) / GiB:.3f}" in text
    lines = memory_lines(pred)
    assert all(line in text for line in lines)
    what_if = estimate(res.best, MODELS["small"].scaled(1), cluster)  # a what-if of the same plan: the same lines
    assert memory_lines(what_if) == lines
    assert any(line.startswith("start-up peak: device ") for line in lines)
    host = next(line for line in lines if line.startswith("host memory per node: "))
    assert "(90% of 256 GiB RAM, assumed: --host-ram to change)" in host  # a catalogue cluster's default
    given = estimate(res.best, MODELS["small"].scaled(1), with_host_ram(cluster, 64 * GiB))
    assert [line for line in memory_lines(given) if line.startswith("host")][0].endswith("(90% of 64 GiB RAM)")


def test_gradients_made_in_the_first_backward_are_called_gradients():
    """A full fine-tune's one microbatch: the gradients the later pieces made before the peak (in the first
    backward) were counted in `working` (328 MB here, of which 4 MB is the block's own working memory), while the
    tracker (--json's tracked_by_rank) calls them gradients."""
    prof = synthetic_profile(saved=2**20)  # little to save: the peak is in backward, under the gradients
    plan = _plan(block=BlockPlan(zero=0), num_microbatches=1)
    cats = estimate(plan, prof, parse_cluster("1xA100-80GB")).memory_by_rank[0]
    assert cats["working"] == 4 * 2**20  # the block's input/output and working peak (synthetic_profile's hidden)
    assert cats["gradients"] == 8 * 10_000_000 * 4 + 1_000_000 * 4  # every block's and the head's, fp32
    assert "reduce_buffers" not in cats  # one rank, nothing sharded: it runs without FSDP2 (Plan.runs_unwrapped)
    assert device_bytes(cats) - cats["reserve"] == 328_000_000 + 656_000_000 + 4_000_000 + 4 * 2**20 \
        + 324_000_000  # the same total as before: parameters, states, buffers, working, gradients


def test_one_rank_says_offload_not_a_zero_stage():
    offloaded = BlockPlan(zero=3, placement="params_on_host")
    one = _plan(dp=1, block=offloaded, root=offloaded)
    text = summary(one)
    assert "ZeRO" not in text and "8 x parameter offload + activations kept" in text and "root: parameter offload" \
        in text
    two = _plan(dp=2, block=BlockPlan(zero=3, placement="params_on_host"))
    assert "ZeRO-3 + parameter offload" in summary(two)


def test_figures_below_the_printed_precision_are_not_shown():
    pred = Prediction(step_time_s=7.194, time_by_phase={"compute": 7.19, "bubble": 4.441e-16, "optimizer": 0.004})
    assert phases_line(pred) == "step time by phase (s): compute 7.19, optimizer 0.004"
    plan = _plan(dp=1)
    assert estimate(plan, synthetic_profile(), parse_cluster("1xA100-80GB")).time_by_phase["bubble"] == 0.0


def test_a_tie_is_broken_openly():
    """Plans the time model cannot tell apart (3 significant digits) go to the one holding less memory; a
    runner-up listed below a chosen plan it beats by a rounding says why."""
    cluster = parse_cluster("2xRTX4090")
    res = search(MODELS["small"], cluster, global_batch=8, alternatives=2)
    assert "within rounding" not in format_result(res, cluster)
    best = res.best.predicted  # a runner-up like the best, a rounding faster: only memory can have put it below
    faster = replace(res.best, predicted=replace(best, step_time_s=best.step_time_s * 0.999,
                                                 tokens_per_s=best.tokens_per_s / 0.999))
    res.alternatives = [faster, *res.alternatives]
    text = format_result(res, cluster)
    assert (f"within rounding of the fastest ({faster.predicted.tokens_per_s:,.0f} tokens/s below); chosen for less "
            "memory") in text
    bpipe = replace(faster, shape=replace(faster.shape, schedule="bpipe"))
    assert why_not_the_fastest(res.best, bpipe).endswith("chosen for no BPipe")
    zbv = replace(faster, shape=replace(faster.shape, schedule="zbv"))
    split = why_not_the_fastest(res.best, zbv)  # search.SPLIT_MARGIN, not a rounding
    assert split.startswith("within 1% of the fastest (") and "split backward" in split, split


def test_the_local_machine_is_planned_with_its_real_ram(monkeypatch):
    """`snugfit train` (and `snugfit plan --nproc N`) plan the ranks of this machine: its RAM as the system reports
    it, not assumed, even before `snugfit profile-hardware` measured the rest of it."""
    import torch

    import snugfit.hardware.cluster as cluster_module
    from snugfit.hardware.catalogue import host_ram
    from snugfit.train.autoplan import cluster_here

    monkeypatch.setattr(cluster_module, "load_local", lambda: None)  # nothing measured yet
    for cluster in (parse_cluster("2xcpu"), cluster_here(torch.device("cpu"), 2, 2)):
        host = cluster.nodes[0].host
        assert host.ram_bytes == host_ram() > 0 and not host.ram_assumed
    assert parse_cluster("2xRTX4090").nodes[0].host.ram_assumed  # a catalogue cluster: 256 GiB, assumed
