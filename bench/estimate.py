"""Predicted vs measured step time and peak memory of a tiny model on this machine.

Measures the hardware here (snugfit profile-hardware, without collectives), then for
each single-process plan (micro-batch sizes, recompute policies, gradient
accumulation, eager vs SDPA attention): profiles the model (with piece timings on
this CPU), predicts, and measures the same plan run by the runtime's engine
(MemTracker for memory, transients included; best of N steps for time; one thread,
timed in process CPU time so other jobs on a shared machine do not count).
Then 2- and 4-rank plans (sharding, offload, a pipeline, context parallelism, tiled MLPs), one gloo spawn per world
size: memory is each rank's MemoryTracker peak against the model's tracked
prediction (no allocator sees transients on CPU), time the slowest rank's wall
clock. Prints per-plan errors, their median and max, and the Spearman rank
correlation of predicted vs measured step time (over all plans, and per group).

The multi-rank plans include the optimizer setups of full fine-tuning at the memory floor (plan.OptimizerPlan:
8- and 4-bit states, bf16 weights, the step in backward; streamed states); torchao compiles their update on the
first step, which the warm-up step takes.

Targets: time median error <= 10%, rank correlation >= 0.9, memory error <= 5%.
Usage: .venv/bin/python bench/estimate.py [--dim 128] [--layers 4] [--steps 5] [--rounds 2] [--no-multi]
       [--no-single] [--only TEXT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the bench measures this machine into a profile of its own: never the one the user's runs plan with
os.environ.setdefault("SNUGFIT_HARDWARE_PROFILE", str(Path.home() / ".cache" / "snugfit" / "hardware-bench.json"))

import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from snugfit.calibrate.hardware import profile_hardware  # noqa: E402
from snugfit.calibrate.step import measure_single_process  # noqa: E402
from snugfit.hardware import parse_cluster  # noqa: E402
from snugfit.model.decoder import Decoder, ModelConfig  # noqa: E402
from snugfit.model.lora import apply_lora, freeze  # noqa: E402
from snugfit.model.quantize import quantize_base  # noqa: E402
from snugfit.plan.placement import Placement
from snugfit.plan.estimate import estimate  # noqa: E402
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan  # noqa: E402
from snugfit.profile import profile_model  # noqa: E402
from snugfit.runtime.build import build_engine  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig  # noqa: E402
from snugfit.runtime.spawn import run_ranks  # noqa: E402

# (micro-batch, microbatches, activation policy, attention)
PLANS = [
    (1, 1, "keep", "sdpa"),
    (2, 1, "keep", "sdpa"),
    (4, 1, "keep", "sdpa"),
    (8, 1, "keep", "sdpa"),
    (2, 4, "keep", "sdpa"),
    (4, 2, "recompute", "sdpa"),
    (8, 1, "recompute", "sdpa"),
    (4, 1, "selective", "sdpa"),
    (4, 1, "keep", "eager"),
    (4, 2, "selective", "eager"),
]

# (name, dp, pp, block plan, root zero, microbatches, tp, cp[, fine-tuning[, gradient reduction[, optimizer[, ep]]]]);
# micro-batch 2, keep, sdpa. fine-tuning: "lora" (rank 4 adapters, base frozen), "qlora" (the same over NF4 block linears),
# "freeze" (the embedding and the first two blocks frozen), "moe" (a Mixture-of-Experts model: MOE_EXPERTS experts, top
# 2, each as wide as the dense MLP; trained in full); gradient reduction: plan.GRAD_REDUCE (default "step");
# optimizer: plan.OptimizerPlan (default fp32 weights and states, stepped after backward; the root streams its
# states where the blocks do)
MULTI = [
    ("dp2 zero0", 2, 1, BlockPlan(zero=0), 0, 2, 1, 1),
    ("dp2 zero2", 2, 1, BlockPlan(zero=2), 2, 2, 1, 1),
    ("dp2 zero3", 2, 1, BlockPlan(zero=3), 3, 1, 1, 1),
    ("dp2 zero3+offload_opt", 2, 1, BlockPlan(zero=3, placement="host_step"), 1, 2, 1, 1),
    ("dp2 offload_params", 2, 1, BlockPlan(zero=3, placement="params_on_host"), 3, 2, 1, 1),
    ("pp2 1f1b", 1, 2, BlockPlan(), 0, 4, 1, 1),
    ("tp2", 1, 1, BlockPlan(), 0, 4, 2, 1),
    ("dp4 zero3", 4, 1, BlockPlan(zero=3), 3, 2, 1, 1),
    ("dp4 zero2+recompute", 4, 1, BlockPlan(zero=2, activations="recompute"), 2, 2, 1, 1),
    ("dp2 pp2 zero2", 2, 2, BlockPlan(zero=2), 2, 4, 1, 1),
    ("dp2 tp2 zero3", 2, 1, BlockPlan(zero=3), 3, 2, 2, 1),
    ("tp2 pp2", 1, 2, BlockPlan(), 0, 4, 2, 1),
    ("dp2 lora zero3", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "lora"),
    ("dp2 qlora zero3", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "qlora"),
    ("dp2 frozen zero0", 2, 1, BlockPlan(zero=0), 0, 2, 1, 1, "freeze"),
    ("dp2 zero3 reduce/mb", 2, 1, BlockPlan(zero=3), 3, 4, 1, 1, "", "microbatch"),
    ("dp2 zero2+offload_opt reduce/mb", 2, 1, BlockPlan(zero=2, placement="host_step"), 2, 4, 1, 1, "", "microbatch"),
    ("dp2 pp2 zero3 reduce/mb", 2, 2, BlockPlan(zero=3), 3, 4, 1, 1, "", "microbatch"),
    ("dp2 zero3 8-bit states", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "", "step", OptimizerPlan(states="8bit")),
    ("dp2 zero3 4-bit, bf16 weights", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "", "step",
     OptimizerPlan(master_weights="bf16", states="4bit")),
    ("dp2 zero3 step in backward", 2, 1, BlockPlan(zero=3), 3, 1, 1, 1, "", "step", OptimizerPlan(in_backward=True)),
    ("dp2 zero3 states streamed", 2, 1, BlockPlan(zero=3, placement="streamed"), 3, 2, 1, 1),
    ("dp2 zero2 8-bit streamed in bwd/mb", 2, 1, BlockPlan(zero=2, placement="streamed"), 2, 4, 1, 1, "", "microbatch",
     OptimizerPlan(master_weights="bf16", states="8bit", in_backward=True)),
    ("pp2 step in backward/mb", 1, 2, BlockPlan(), 0, 4, 1, 1, "", "microbatch", OptimizerPlan(in_backward=True)),
    # sequences split over cp ranks (Ulysses all-to-alls around attention); MLPs run over the sequence in tiles
    ("cp2 zero3", 1, 1, BlockPlan(zero=3), 3, 2, 1, 2),
    ("dp2 cp2 zero3+recompute", 2, 1, BlockPlan(zero=3, activations="recompute"), 3, 2, 1, 2),
    ("tp2 cp2", 1, 1, BlockPlan(), 0, 2, 2, 2),
    ("cp2 lora zero3 mlp tiles 4", 1, 1, BlockPlan(zero=3, mlp_tiles=4), 3, 2, 1, 2, "lora"),
    ("dp2 zero3 mlp tiles 4", 2, 1, BlockPlan(zero=3, mlp_tiles=4), 3, 2, 1, 1),
    ("dp2 recompute mlp tiles 4", 2, 1, BlockPlan(zero=2, activations="recompute", mlp_tiles=4), 2, 2, 1, 1),
    # Mixture-of-Experts blocks: every expert's weights, gradients and states, the top-k experts' grouped GEMMs
    ("moe", 1, 1, BlockPlan(), 0, 2, 1, 1, "moe"),
    ("dp2 moe zero3", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "moe"),
    ("dp2 moe zero2+recompute", 2, 1, BlockPlan(zero=2, activations="recompute"), 2, 2, 1, 1, "moe"),
    ("pp2 moe 1f1b", 1, 2, BlockPlan(), 0, 4, 1, 1, "moe"),
    # experts split over ep ranks, tokens dispatched by all-to-all (balanced routing in the model)
    ("dp2 ep2 moe zero3", 2, 1, BlockPlan(zero=3), 3, 2, 1, 1, "moe", "step", OptimizerPlan(), 2),
    ("dp4 ep2 moe zero3", 4, 1, BlockPlan(zero=3), 3, 2, 1, 1, "moe", "step", OptimizerPlan(), 2),
    ("dp4 ep4 moe zero3", 4, 1, BlockPlan(zero=3), 3, 2, 1, 1, "moe", "step", OptimizerPlan(), 4),
]
LORA_RANK, FROZEN, MOE_EXPERTS = 4, "embed,blocks:0-1", 4


def configured(cfg: ModelConfig, tune: str) -> ModelConfig:
    """The model a plan's fine-tuning names: the dense one, or its Mixture-of-Experts twin."""
    return replace(cfg, n_experts=MOE_EXPERTS, top_k=2, moe_ffn_dim=cfg.ffn_dim) if tune == "moe" else cfg


def tuned(cfg: ModelConfig, tune: str) -> Decoder:
    """The model as the plan's fine-tuning runs it (same seed for every rank)."""
    torch.manual_seed(0)
    model = Decoder(configured(cfg, tune))
    if tune == "freeze":
        freeze(model, FROZEN)
    elif tune in ("lora", "qlora"):
        apply_lora(model, LORA_RANK)
    if tune == "qlora":
        quantize_base(model)
    return model
MULTI_MBS = 2


def multi_plan(layers: int, seq: int, dp: int, pp: int, block: BlockPlan, root_zero: int, m: int, tp: int, cp: int,
               grad_reduce: str, optimizer: OptimizerPlan, ep: int) -> Plan:
    return Plan.uniform(layers, dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, block=block,
                        root=BlockPlan(zero=root_zero, placement="streamed" if block.placement.streams_states
                                       else Placement.DEVICE),
                        micro_batch_size=MULTI_MBS, num_microbatches=m, seq_len=seq, grad_reduce=grad_reduce,
                        optimizer=optimizer)


def run_multi(env, cfg: ModelConfig, plans: dict[str, tuple[Plan, str]],
              steps: int) -> dict[str, tuple[int, int, list[float]]]:
    """name -> (tracked device peak, host peak, step wall times) on this rank; a plan that fails is left out."""
    torch.set_num_threads(1)
    out = {}
    for name, (plan, tune) in plans.items():
        try:
            engine = build_engine(tuned(cfg, tune), plan, OptimConfig(), env)
        except Exception as err:  # noqa: BLE001 - reported, the other plans still run
            print(f"rank {env.rank}: {name} not run: {err}")
            continue
        batch = torch.randint(0, cfg.vocab_size, (plan.num_microbatches * MULTI_MBS, plan.seq_len + 1))
        engine.track_memory = False  # its saved-tensor hooks cost time: on for the memory step only
        engine.train_step(batch)  # warm-up: optimizer states exist from here on
        engine.track_memory = True
        engine.train_step(batch)
        peak = engine.memory.peak()
        engine.track_memory = False
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.train_step(batch)
            times.append(time.perf_counter() - t0)
        out[name] = (peak["device.total"], peak["host.total"], times)
    return out


def multi_rows(args, cfg: ModelConfig) -> list[tuple[str, float, float, int, int]]:
    """(name, predicted s, measured s, predicted tracked bytes, measured bytes) per plan; the worst rank's memory."""
    profiles: dict[str, object] = {}

    def profile(tune: str):
        if tune not in profiles:
            profiles[tune] = profile_model(
                configured(cfg, tune), micro_batch_size=MULTI_MBS, seq_len=args.seq, measure_on="cpu", repeats=args.steps,
                use_cache=False, clock=time.process_time, lora_rank=LORA_RANK if tune in ("lora", "qlora") else None,
                frozen=FROZEN if tune == "freeze" else None, quantize_base="nf4" if tune == "qlora" else "none")
        return profiles[tune]

    rows = []
    defaults = ("", "step", OptimizerPlan(), 1)  # fine-tuning, gradient reduction, optimizer, expert parallel
    specs = [(name, dp, pp, b, rz, m, tp, cp, *rest, *defaults[len(rest):])
             for name, dp, pp, b, rz, m, tp, cp, *rest in MULTI if any(part in name for part in args.only.split(","))]
    for world in sorted({dp * pp * tp * cp for _, dp, pp, _, _, _, tp, cp, *_ in specs}):
        plans = {name: (multi_plan(args.layers, args.seq, dp, pp, b, rz, m, tp, cp, reduce, opt, ep), tune)
                 for name, dp, pp, b, rz, m, tp, cp, tune, reduce, opt, ep in specs if dp * pp * tp * cp == world}
        # every plan of this world in one call: past run_ranks' default deadline on a loaded machine
        per_rank = run_ranks(run_multi, world, cfg, plans, args.steps, timeout_s=3600)
        for name, (plan, tune) in plans.items():
            if any(name not in r for r in per_rank):
                continue
            pred = estimate(plan, profile(tune), parse_cluster(f"{world}xcpu"))
            step = min(max(r[name][2][i] for r in per_rank) for i in range(args.steps))
            errs = [(t["device.total"], r[name][0]) for t, r in zip(pred.tracked_by_rank, per_rank)]
            errs += [(t["host.total"], r[name][1]) for t, r in zip(pred.tracked_by_rank, per_rank) if r[name][1]]
            pm, mm = max(errs, key=lambda e: abs(e[0] / e[1] - 1))
            rows.append((name, pred.step_time_s, step, pm, mm))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan and round (best is kept)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all plans (best is kept)")
    ap.add_argument("--no-multi", action="store_true", help="single-process plans only")
    ap.add_argument("--no-single", action="store_true", help="multi-rank plans only")
    ap.add_argument("--only", default="", help="multi-rank plans whose name holds one of these (comma-separated)")
    args = ap.parse_args()
    # One thread, timed by process CPU time: other jobs on a shared machine then do not
    # show up in either the profile's piece times or the measured steps.
    torch.set_num_threads(1)
    clock = time.process_time
    local = profile_hardware()  # collectives and FSDP2 overheads between two ranks too
    print(f"hardware: fp32 {local.device.tflops['float32'] * 1e3:.1f} GFLOP/s, copy {local.device.hbm_gbps:.1f} GB/s, "
          f"host optimizer step {local.host.adam_params_per_s / 1e6:.0f} M params/s")
    cluster = parse_cluster("cpu")
    print(f"{'plan (mbs x m ...)':>26} | {'pred s':>8} {'meas s':>8} {'err':>6} | "
          f"{'pred MiB':>9} {'meas MiB':>9} {'err':>6}")
    # Rounds over all plans: each plan's profile timing and measured step are taken at
    # several moments, and the best of each kept, so a burst of load hits neither alone.
    best: dict[int, list] = {}
    for _ in range(0 if args.no_single else args.rounds):
        for i, (mbs, m, policy, attention) in enumerate(PLANS):
            cfg = ModelConfig(arch="llama", dim=args.dim, n_layers=args.layers, n_heads=4, vocab_size=1024,
                              max_seq_len=args.seq, attention=attention)
            prof = profile_model(cfg, micro_batch_size=mbs, seq_len=args.seq, measure_on="cpu",
                                 repeats=args.steps, use_cache=False, clock=clock)
            plan = Plan.uniform(args.layers, block=BlockPlan(activations=policy), root=BlockPlan(),
                                micro_batch_size=mbs, num_microbatches=m, seq_len=args.seq)
            pred = estimate(plan, prof, cluster)
            meas = measure_single_process(cfg, plan, steps=args.steps, clock=clock, track_memory=i not in best)
            row = best.setdefault(i, [pred.step_time_s, meas.step_time_s, pred.peak_memory_bytes, meas.peak_bytes])
            row[0], row[1] = min(row[0], pred.step_time_s), min(row[1], meas.step_time_s)
    rows = [(f"{mbs}x{m} {policy} {attention}", *best[i]) for i, (mbs, m, policy, attention) in enumerate(PLANS)
            if i in best]
    single = len(rows)
    if not args.no_multi:
        rows += multi_rows(args, ModelConfig(arch="llama", dim=args.dim, n_layers=args.layers, n_heads=4,
                                             vocab_size=1024, max_seq_len=args.seq))
    for k, (name, pt, mt, pm, mm) in enumerate(rows):
        if k == single:
            print("-- multi-rank: tracked memory, worst rank --")
        print(f"{name:>26} | {pt:>8.4f} {mt:>8.4f} {pt / mt - 1:>+6.1%} | "
              f"{pm / 2**20:>9.2f} {mm / 2**20:>9.2f} {pm / mm - 1:>+6.1%}")
    return summarize(rows, single)


def summarize(rows: list[tuple[str, float, float, int, int]], single: int) -> int:
    t_abs = [abs(pt / mt - 1) for _, pt, mt, _, _ in rows]
    m_abs = [abs(pm / mm - 1) for *_, pm, mm in rows]
    rho = spearmanr([r[1] for r in rows], [r[2] for r in rows]).statistic
    for label, part in (("single", rows[:single]), ("multi", rows[single:])):
        if len(part) > 2:
            rho_part = spearmanr([r[1] for r in part], [r[2] for r in part]).statistic
            print(f"Spearman ({label}-process plans): {rho_part:.3f}")
    print(f"time:   median |error| {statistics.median(t_abs):.1%}, max {max(t_abs):.1%}, Spearman {rho:.3f} "
          f"over {len(rows)} plans")
    print(f"memory: median |error| {statistics.median(m_abs):.1%}, max {max(m_abs):.1%}")
    # PipelineEngine's MemoryTracker does not count its stages' activations yet (runtime/pipeline.py)
    dp_only = [e for e, r in zip(m_abs, rows) if " pp" not in f" {r[0]}"]
    print(f"memory without pipeline plans: median |error| {statistics.median(dp_only):.1%}, max {max(dp_only):.1%} "
          f"over {len(dp_only)} plans")
    ok = statistics.median(t_abs) <= 0.10 and rho >= 0.9 and max(m_abs) <= 0.05
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
