"""The search weighs compiling the blocks (plan.compile_choice) where the user leaves it open: taken on GPUs when the
run's steps repay the compilation, never on CPU ranks unless asked, always where asked; and `snugfit plan` says so."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from snugfit.commands import plan as plan_cmd
from snugfit.hardware import parse_cluster
from snugfit.model.decoder import ModelConfig
from snugfit.plan.compile_choice import search_compiled_or_eager
from snugfit.plan.estimate import compile_seconds
from snugfit.plan.options import Constraints
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.profile import profile_model

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=128, max_seq_len=64)
SEQ = 64
GPU = parse_cluster("1xH100-80GB")  # a tiny model on one GPU is host-bound: compiled blocks launch far fewer kernels


@pytest.fixture(scope="module")
def profiles():
    """The model eager and compiled, and which of them each search asked for."""
    made = {c: profile_model(CFG, micro_batch_size=1, seq_len=SEQ, dtype="bfloat16", kernels="gpu", use_cache=False,
                             compile=c) for c in (False, True)}
    asked: list[bool] = []

    def profile_for(compiled: bool):
        asked.append(compiled)
        return made[compiled]
    return profile_for, asked, made


def choose(profiles, cluster=GPU, **kw):
    profile_for, asked, _ = profiles
    asked.clear()
    return search_compiled_or_eager(profile_for, cluster, global_batch=4, alternatives=0, **kw)


def test_compiled_plan_taken_once_the_run_repays_its_compilation(profiles):
    """The choice flips exactly where the steps saved pay for the predicted compile time."""
    first = choose(profiles, compile=None, steps=10**6)
    compiled = first.result.best
    assert compiled.compile and first.profile.compiled and "compile: chosen" in first.note
    eager = choose(profiles, compile=False, steps=10**6).result.best
    assert not eager.compile
    saved = eager.predicted.step_time_s - compiled.predicted.step_time_s
    assert saved > 0
    assert compiled.predicted.compile_s == compile_seconds(compiled, first.profile, GPU) > 0
    repaid = math.ceil(compiled.predicted.compile_s / saved)
    assert f"repaid in {repaid} of the run's" in first.note
    short = choose(profiles, compile=None, steps=repaid)
    assert not short.result.best.compile and not short.profile.compiled
    assert "not chosen" in short.note and f"repaid only after {repaid} steps" in short.note
    assert choose(profiles, compile=None, steps=repaid + 1).result.best.compile


def test_asked_compile_is_taken_and_compared_with_eager(profiles):
    got = choose(profiles, compile=True, steps=1)
    assert got.result.best.compile and "for the best eager plan" in got.note and "repaid in" in got.note
    assert profiles[1] == [False, True]  # the eager side searched for the comparison


def test_eager_only_on_cpu_ranks_or_when_refused(profiles):
    """Neither traces nor searches compiled blocks: CPU ranks run eager unless asked (plan.compile_choice)."""
    for cluster, compile in ((parse_cluster("2xcpu"), None), (GPU, False)):
        got = choose(profiles, cluster=cluster, compile=compile, steps=10**6)
        assert not got.result.best.compile and got.note is None and profiles[1] == [False]
    assert choose(profiles, cluster=parse_cluster("2xcpu"), compile=True, steps=1).result.best.compile


def test_only_the_side_that_fits_is_taken(profiles):
    """Compiled blocks save less for backward (the partitioner's choice): at a budget between the two peaks only
    the compiled plan fits, and it is taken even where its compilation would not be repaid."""
    _, _, made = profiles
    assert made[True].blocks[0].saved_bytes["keep"] < made[False].blocks[0].saved_bytes["keep"]
    fixed = Constraints(dp=1, pp=1, zero=0, recompute="keep", micro_batch=4, offload_optimizer="none").checked(1)
    peaks = [choose(profiles, compile=c, steps=1, constraints=fixed).result.best.predicted.peak_memory_bytes
             for c in (False, True)]
    assert peaks[1] < peaks[0]
    got = choose(profiles, compile=None, steps=1, constraints=fixed, memory_budget=(peaks[0] + peaks[1]) // 2)
    assert got.result.best.compile and got.note == "compile: only compiled blocks fit (no eager plan does)"


def test_compile_seconds_count_each_distinct_graph_once(profiles):
    """Blocks alike in shape and policy share one compiled graph; a second policy is a second graph."""
    _, _, made = profiles
    prof = made[True]
    one = prof.blocks[0].fwd_ops + prof.blocks[0].bwd_ops
    keep = Plan.uniform(CFG.n_layers, block=BlockPlan(activations="keep"), seq_len=SEQ)
    mixed = replace(keep, blocks=[BlockPlan(activations="keep")] * 2 + [BlockPlan(activations="recompute")] * 2)
    per_kernel = GPU.gpu_of(0).compile_kernel_s
    assert compile_seconds(keep, prof, GPU) == pytest.approx(one * per_kernel)
    assert compile_seconds(mixed, prof, GPU) == pytest.approx(2 * one * per_kernel)


def test_plan_command_reports_the_choice(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    plan_cmd.add_parser(ap.add_subparsers())
    path = tmp_path / "tiny.json"
    path.write_text(__import__("json").dumps(CFG.to_dict()))
    base = ["plan", "--model", str(path), "--cluster", "1xH100-80GB", "--seq", str(SEQ), "--global-batch", "4",
            "--profile-cache", str(tmp_path)]
    for extra, line in ((["--steps", "1000000"], "compile: chosen"), (["--steps", "1"], "compile: not chosen")):
        assert plan_cmd.run(ap.parse_args(base + extra)) == 0
        out = capsys.readouterr().out
        assert line in out and ("blocks compiled:" in out) == (line == "compile: chosen")

