"""snugfit's GPU acceptance suite: every runtime technique, memory and time against the models, the offload
comparison, and this GPU against the catalogue, in one script (under 8 minutes on one H100/H200).

(a) every runtime technique on a ~1B built-in Llama (random weights) for a few steps through snugfit's engine:
    replicated, optimizer offload, parameter offload, recompute, selective, activation offload, LoRA, NF4 base
    weights (where torchao is installed), fp16 with loss scaling, the other float dtype (fp32 on a GPU, bf16
    on CPU), and the optimizer setups of full fine-tuning at the memory floor (8-bit states, bf16 master weights
    with stochastic rounding, the step in backward, states streamed from host, and all of them together; torchao
    ones where it is installed); each step's loss against a plain PyTorch reference (the same weights, plain
    forward/backward/AdamW in fp32; NF4: the dequantized weights), within a tolerance per compute dtype (bf16
    weights: bf16's; low-bit states: twice);
(b) the allocator's peak (torch.cuda.max_memory_allocated / max_memory_reserved) against the predicted peak;
(c) measured against predicted step time;
(d) snugfit's plan against FSDP2 full CPU offload under a capped allocator (0.6 x the replicated plan's peak);
(e) this GPU measured as `snugfit profile-hardware` measures it, against its catalogue entry;
(f) the time model's corrections a run's calibration (`[train] replan`) derives on this card for the replicated
    plan, per term, beside the catalogue's figures it corrects;
(g) a built-in MoE decoder (grouped experts, ep 1) replicated, as a row of (a)-(c): losses against the plain
    reference (router aux loss included), memory, and time against the plan's terms (`expert_gemm` apart).

Writes acceptance.json and acceptance.md under $OUT (./ without $OUT) and prints the table.
Usage: python bench/gpu/run.py [--model NAME|config.json] [--seq 1024] [--batch 4] [--steps 3]
       python bench/gpu/run.py --smoke   # the same logic on CPU: tiny model, gloo, no allocator (CI runs it)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from report import save  # noqa: E402 (bench/gpu)

from snugfit.hardware.catalogue import Host, gpu_for_device  # noqa: E402
from snugfit.hardware.cluster import Cluster, make_node  # noqa: E402
from snugfit.model.catalogue import resolve_model  # noqa: E402
from snugfit.model.decoder import Decoder, ModelConfig, rope_table  # noqa: E402
from snugfit.model.lora import apply_lora  # noqa: E402
from snugfit.plan.estimate import estimate  # noqa: E402
from snugfit.plan.explain import summary  # noqa: E402
from snugfit.plan.kernels import attention_rates  # noqa: E402
from snugfit.plan.memory import device_bytes  # noqa: E402
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan  # noqa: E402
from snugfit.plan.search import Constraints, NoPlanError, search  # noqa: E402
from snugfit.profile.cache import profile_model  # noqa: E402
from snugfit.runtime.build import build_engine  # noqa: E402
from snugfit.runtime.compile import compile_seconds  # noqa: E402
from snugfit.runtime.dist import DistEnv, init_distributed  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig, param_groups  # noqa: E402
from snugfit.train.autoplan import local_cluster  # noqa: E402

GIB = 2**30
OUT = Path(os.environ.get("OUT", "."))
BUDGET_FRACTION = 0.6  # (d): of the replicated plan's predicted peak
# On CPU the search offloads nothing (host and device are one memory), so only recomputation saves memory there
SMOKE_BUDGET_FRACTION = 0.9
WARMUP = 2
OPTIM = OptimConfig(lr=1e-4)  # small steps: the losses of a few steps stay comparable across dtypes
LORA_RANK = 8
# Loss tolerance (relative) against the fp32 reference, by compute dtype: fp32 differs by summation order only;
# bf16/fp16 round weights and activations (8 and 11 bits of mantissa); NF4 rounds its base weights again.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
# Llama-3.2-1B's shape with a 32k vocabulary: 1.1B parameters
DEFAULT_MODEL = ModelConfig(arch="llama", vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            ffn_dim=8192, max_seq_len=2048, rope_theta=500000.0)
# Every matrix 64 x 64 (vocabulary and feed-forward too): torchao compiles its optimizer's update once per tensor
# shape (dynamic=False), tens of seconds each on CPU, so one matrix shape and the norms' make the 8-bit and bf16 rows
# compile two updates each, not five
SMOKE_MODEL = ModelConfig(arch="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=256)
# The MoE row (g): a built-in decoder whose MLPs are 16 experts, top 2, and a shared expert (about 0.3B
# parameters, 0.1B active), on one GPU at ep 1: its experts' grouped GEMMs at 1/8 of the tokens each
MOE_MODEL = ModelConfig(arch="llama", vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                        max_seq_len=2048, n_experts=16, top_k=2, moe_ffn_dim=512, n_shared_experts=1)
SMOKE_MOE_MODEL = ModelConfig(arch="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=256,
                              n_experts=4, top_k=2, moe_ffn_dim=32)


@dataclass
class Technique:
    name: str
    block: BlockPlan
    root: BlockPlan
    dtype: str | None = None  # None: the run's compute dtype
    tune: str = ""  # "lora", "qlora" (LoRA over NF4 block linears)
    grad_reduce: str = "step"  # plan.GRAD_REDUCE
    compile: bool = False  # Plan.compile: each block compiled (its first warm-up step compiles)
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)

    @property
    def needs_torchao(self) -> bool:
        return self.tune == "qlora" or self.optimizer.needs_torchao


def techniques(on_gpu: bool) -> list[Technique]:
    other = "float32" if on_gpu else "bfloat16"  # the float dtype the rest of the table does not use
    return [
        Technique("replicated", BlockPlan(), BlockPlan()),
        Technique("optimizer offload", BlockPlan(placement="host_step"), BlockPlan(placement="host_step")),
        Technique("parameter offload", BlockPlan(zero=3, placement="params_on_host"),
                  BlockPlan(zero=3, placement="params_on_host")),
        Technique("recompute", BlockPlan(activations="recompute"), BlockPlan()),
        Technique("selective", BlockPlan(activations="selective"), BlockPlan()),
        Technique("selective, half the matmuls", BlockPlan(activations="selective_half"), BlockPlan()),
        Technique("activation offload", BlockPlan(activations="offload"), BlockPlan()),
        # the fp32 shard accumulates (on one GPU the whole gradient, reduced per microbatch) instead of the
        # unsharded gradient in the reduce dtype
        Technique("ZeRO-3, reduced every microbatch", BlockPlan(zero=3), BlockPlan(zero=3), grad_reduce="microbatch"),
        # long context on one GPU (cp 1): each block's MLP over the sequence in 4 tiles (model.tiled_mlp)
        Technique("tiled MLP, 4 tiles", BlockPlan(mlp_tiles=4), BlockPlan()),
        Technique("LoRA", BlockPlan(), BlockPlan(), tune="lora"),
        Technique("NF4 base (QLoRA)", BlockPlan(), BlockPlan(), tune="qlora"),
        Technique("fp16 + loss scaling", BlockPlan(), BlockPlan(), dtype="float16"),
        Technique(other, BlockPlan(), BlockPlan(), dtype=other),
        # full fine-tuning at the memory floor (plan.OptimizerPlan; the rows use two microbatches, so the step in
        # backward reduces every one)
        Technique("8-bit states", BlockPlan(), BlockPlan(), optimizer=OptimizerPlan(states="8bit")),
        Technique("bf16 master weights", BlockPlan(), BlockPlan(), optimizer=OptimizerPlan(master_weights="bf16")),
        Technique("step in backward", BlockPlan(zero=3), BlockPlan(zero=3), grad_reduce="microbatch",
                  optimizer=OptimizerPlan(in_backward=True)),
        Technique("states streamed", BlockPlan(zero=3, placement="streamed"), BlockPlan(zero=3, placement="streamed")),
        Technique("8-bit streamed in backward, bf16 weights", BlockPlan(zero=3, placement="streamed"),
                  BlockPlan(zero=3, placement="streamed"), grad_reduce="microbatch",
                  optimizer=OptimizerPlan(master_weights="bf16", states="8bit", in_backward=True)),
    ] + ([  # compiled blocks: fused kernels, the partitioner's saved tensors (profile.compiled); NF4's dequantization
        # fuses too (eager QLoRA dispatches ~25 operators more per linear and pass). GPU only: on CPU each compiles
        # for tens of seconds, which tests/test_compile.py spends already
        Technique("replicated, compiled", BlockPlan(), BlockPlan(), compile=True),
        Technique("NF4 base (QLoRA), compiled", BlockPlan(), BlockPlan(), tune="qlora", compile=True),
    ] if on_gpu else [])


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The built-in decoder to train: --model (a catalogue name or config.json), else the default or smoke one."""
    if args.smoke:
        cfg = ModelConfig.from_dict(SMOKE_MODEL.to_dict())
    elif args.model:
        cfg = resolve_model(args.model)
        if isinstance(cfg, dict):
            raise SystemExit(f"{args.model} is a Hugging Face config; this bench trains built-in decoders only "
                             "(gpt2*, llama*, mistral-7b, or a config.json with an 'arch' key)")
    else:
        cfg = ModelConfig.from_dict(DEFAULT_MODEL.to_dict())
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq)
    return cfg


def one_rank() -> DistEnv:
    """A 1-rank process group through snugfit's init_distributed (NCCL on a GPU, gloo on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)
    return init_distributed()


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor], tune: str) -> Decoder:
    """A fresh model holding a copy of `weights` (built on the meta device: no second random init), tuned."""
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_state_dict({k: v.clone() for k, v in weights.items()}, assign=True)
    if cfg.arch == "llama":
        model.rope = rope_table(cfg)
    if tune:
        apply_lora(model, LORA_RANK, seed=1)
    if tune == "qlora":
        from snugfit.model.quantize import quantize_base

        quantize_base(model)
    return model


def reference_losses(model: Decoder, batch: torch.Tensor, mbs: int, steps: int, device: torch.device) -> list[float]:
    """Plain PyTorch in fp32: forward/backward per microbatch, clip, AdamW (the engine's groups and settings);
    NF4 weights dequantized into plain frozen fp32 tensors."""
    from snugfit.model.moe import begin_step, moe_layers
    from snugfit.model.quantize import dequantized, is_quantized

    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and is_quantized(m.weight):
            m.weight = torch.nn.Parameter(dequantized(m.weight, torch.float32), requires_grad=False)
    model = model.to(device=device, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([g for g in param_groups(params, OPTIM.weight_decay) if g["params"]], lr=OPTIM.lr,
                            betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    batch = batch.to(device)
    micro = batch.split(mbs)
    losses = []
    for _ in range(steps):
        total = 0.0
        if moe_layers(model):  # the routers' aux loss joins each microbatch's backward, as in the engine
            begin_step(model, 1.0 / len(micro), 1.0)
        for mb in micro:
            loss = model(mb[:, :-1], mb[:, 1:]) / len(micro)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def predicted_peak(plan: Plan, on_gpu: bool) -> int:
    """What the measurement is compared with: the allocator's part of the device peak on a GPU (no CUDA
    context, no fragmentation reserve); the MemoryTracker's device total on CPU (no allocator there)."""
    if on_gpu:
        cats = plan.predicted.memory_by_rank[0]
        return device_bytes(cats) - cats.get("reserve", 0)
    return plan.predicted.tracked_by_rank[0]["device.total"]


def measure(model: Decoder, plan: Plan, env: DistEnv, batch: torch.Tensor, steps: int) -> dict:
    """Train `plan` for WARMUP + steps steps: every step's loss, the timed steps' median and the peak memory.

    Step times are the gaps between consecutive step ends (device synchronised), so a
    host optimizer step that overlaps the next forward is counted as the runtime runs it.
    """
    on_gpu = env.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    engine = build_engine(model, plan, OPTIM, env)
    losses = []
    compiled_before = compile_seconds()  # the first warm-up step compiles a compiled plan's blocks
    for i in range(WARMUP):
        engine.track_memory = i == WARMUP - 1  # the last warm-up: the tracker's peak, optimizer states included
        losses.append(engine.train_step(batch).loss)
    tracked = engine.memory.peak()["device.total"]
    engine.track_memory = False
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    ends = [time.perf_counter()]
    for _ in range(steps):
        losses.append(engine.train_step(batch).loss)
        sync()
        ends.append(time.perf_counter())
    if engine.host is not None:
        engine.host.wait()
    times = [b - a for a, b in zip(ends, ends[1:])]
    return {"losses": losses, "step_times_s": times, "measured_step_s": statistics.median(times),
            "measured_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else tracked,
            "measured_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else None,  # fragmentation too
            "measured_tracked_bytes": tracked, "measured_compile_s": compile_seconds() - compiled_before}


def run_plan(name: str, model: Decoder, plan: Plan, env: DistEnv, batch: torch.Tensor, steps: int) -> dict:
    """Predictions and measurements of one plan; a run the allocator stops is reported, not fatal."""
    pred = plan.predicted
    row = {"plan": summary(plan), "predicted_step_s": pred.step_time_s, "predicted_tokens_per_s": pred.tokens_per_s,
           "predicted_peak_bytes": predicted_peak(plan, env.device.type == "cuda"),
           "predicted_tracked_bytes": pred.tracked_by_rank[0]["device.total"], "predicted_phases_s": pred.time_by_phase,
           "predicted_compile_s": pred.compile_s}
    print(f"running {name}: {row['plan']}", flush=True)
    try:
        row.update(measure(model, plan, env, batch, steps))
        row["measured_tokens_per_s"] = plan.tokens_per_step / row["measured_step_s"]
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0]}"
    free_memory(env)
    return row


def guarded(section: str, work, report: dict):
    """Run one part of the suite; an exception becomes an error entry (with its traceback in the JSON) instead of
    ending the run, so one GPU-path bug does not cost the other rows of a leased machine's single run."""
    try:
        return work()
    except Exception as err:  # noqa: BLE001 - reported per row, and the script exits 1
        trace = traceback.format_exc()
        print(trace, file=sys.stderr, flush=True)
        report.setdefault("errors", []).append({"section": section, "error": f"{type(err).__name__}: {err}",
                                                "traceback": trace})
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def free_memory(env: DistEnv) -> None:
    gc.collect()  # FSDP2 modules hold reference cycles; free this plan's memory before the next
    if env.device.type == "cuda":
        torch.cuda.empty_cache()


def check_techniques(args, cfg: ModelConfig, env: DistEnv, cluster: Cluster, measured: Cluster | None, dtype: str,
                     report: dict) -> None:
    """(a), (b), (c): each technique's losses against the reference, its memory and its time against the models
    (on the catalogue's GPU and, where (e) measured it, on the measured one); report["techniques"] grows by one
    row per technique and is saved after each."""
    on_gpu = env.device.type == "cuda"
    torch.manual_seed(0)
    weights = Decoder(cfg).state_dict()
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    mbs = max(1, args.batch // 2)  # two microbatches: gradient accumulation in every row
    rows = report["techniques"] = []
    for t in techniques(on_gpu):
        row: dict = {"technique": t.name}
        if t.needs_torchao and importlib.util.find_spec("torchao") is None:
            extra = "qlora" if t.tune == "qlora" else "optim"
            rows.append({**row, "skipped": f"torchao is not installed (pip install -e \".[{extra}]\")"})
            continue
        rows.append(row)
        row.update(guarded(t.name, lambda: check_technique(t, args, cfg, env, cluster, measured, dtype, weights,
                                                           batch, mbs), report))
        free_memory(env)
        save(report, OUT)


def check_moe(args, env: DistEnv, cluster: Cluster, measured: Cluster | None, dtype: str, report: dict) -> None:
    """(g): the MoE decoder replicated (ep 1), a row of report["techniques"] as (a)-(c) make them."""
    cfg = ModelConfig.from_dict((SMOKE_MOE_MODEL if args.smoke else MOE_MODEL).to_dict())
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq)
    t = Technique(f"MoE, {cfg.n_experts} experts top {cfg.top_k}, ep 1", BlockPlan(), BlockPlan())
    torch.manual_seed(0)
    weights = Decoder(cfg).state_dict()
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    row: dict = {"technique": t.name}
    report["techniques"].append(row)
    row.update(guarded(t.name, lambda: check_technique(t, args, cfg, env, cluster, measured, dtype, weights, batch,
                                                       max(1, args.batch // 2)), report))
    free_memory(env)
    save(report, OUT)


def check_technique(t: Technique, args, cfg: ModelConfig, env: DistEnv, cluster: Cluster, measured: Cluster | None,
                    dtype: str, weights: dict[str, torch.Tensor], batch: torch.Tensor, mbs: int) -> dict:
    """One technique's row: its plan's predictions, its measurements, and its losses against the reference."""
    on_gpu = env.device.type == "cuda"
    plan = Plan.uniform(cfg.n_layers, block=t.block, root=t.root, micro_batch_size=mbs,
                        num_microbatches=args.batch // mbs, seq_len=args.seq, compute_dtype=t.dtype or dtype,
                        grad_reduce=t.grad_reduce, compile=t.compile, optimizer=t.optimizer)
    prof = profile_model(cfg, micro_batch_size=mbs, seq_len=args.seq, dtype=plan.compute_dtype,
                         lora_rank=LORA_RANK if t.tune else None, kernels="gpu" if on_gpu else "cpu",
                         quantize_base="nf4" if t.tune == "qlora" else "none", compile=t.compile)
    on_measured = estimate(plan, prof, measured).step_time_s if measured is not None else None
    estimate(plan, prof, cluster)
    row = {"predicted_measured_step_s": on_measured,
           **run_plan(t.name, build(cfg, weights, t.tune), plan, env, batch, args.steps)}
    if "error" not in row:
        ref = reference_losses(build(cfg, weights, t.tune), batch, mbs, len(row["losses"]), env.device)
        rel = max(abs(a / b - 1) for a, b in zip(row["losses"], ref))
        weights_dtype = "bfloat16" if t.optimizer.master_weights == "bf16" else plan.compute_dtype
        tol = max(TOLERANCE[plan.compute_dtype], TOLERANCE[weights_dtype]) * (
            2 if t.tune == "qlora" or t.optimizer.states in ("8bit", "4bit") else 1)
        row.update(reference_losses=ref, loss_error=rel, loss_tolerance=tol, loss_ok=rel <= tol)
    return row


def full_offload(profile, cluster: Cluster, batch: int, budget: int) -> Plan:
    """The fastest FSDP2 full CPU offload plan that fits: activations kept if they fit, else recomputed."""
    for acts in ("keep", "recompute"):
        try:
            return search(profile, cluster, global_batch=batch, memory_budget=budget, alternatives=0,
                          constraints=Constraints(zero=3, offload_params=True, recompute=acts)).best
        except NoPlanError:
            continue
    raise SystemExit(f"FSDP2 full CPU offload fits nowhere in {budget / GIB:.3g} GiB; lower --seq or --batch")


def offload_comparison(args, cfg: ModelConfig, env: DistEnv, cluster: Cluster, dtype: str) -> dict:
    """(d): under an allocator capped below the replicated plan's need, snugfit's plan against FSDP2 full offload."""
    on_gpu = env.device.type == "cuda"
    device_mem = torch.cuda.get_device_properties(env.device).total_memory if on_gpu else cluster.gpu_of(0).memory_bytes
    profile = profile_model(cfg, micro_batch_size=1, seq_len=args.seq, dtype=dtype, kernels="gpu" if on_gpu else "cpu")
    replicated = Plan.uniform(cfg.n_layers, micro_batch_size=1, num_microbatches=args.batch, seq_len=args.seq,
                              compute_dtype=dtype)
    need = estimate(replicated, profile, cluster).peak_memory_bytes
    share = SMOKE_BUDGET_FRACTION if args.smoke else BUDGET_FRACTION
    budget = min(int(share * need), device_mem)
    fraction = budget / device_mem
    if on_gpu:
        torch.cuda.set_per_process_memory_fraction(fraction, env.device)
    torch.manual_seed(0)
    weights = Decoder(cfg).state_dict()
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    plans = {"snugfit": search(profile, cluster, global_batch=args.batch, memory_budget=budget, alternatives=0).best,
             "full offload": full_offload(profile, cluster, args.batch, budget)}
    rows = {name: run_plan(name, build(cfg, weights, ""), plan, env, batch, args.steps) for name, plan in plans.items()}
    if on_gpu:
        torch.cuda.set_per_process_memory_fraction(1.0, env.device)
    speedup = {"predicted": rows["full offload"]["predicted_step_s"] / rows["snugfit"]["predicted_step_s"]}
    if not any("error" in r for r in rows.values()):
        speedup["measured"] = rows["full offload"]["measured_step_s"] / rows["snugfit"]["measured_step_s"]
    return {"replicated_peak_bytes": need, "budget_bytes": budget, "memory_fraction": fraction if on_gpu else None,
            "plans": rows, "speedup": speedup}


def hardware_check(env: DistEnv) -> tuple[dict, Cluster]:
    """(e): this device measured as profile-hardware measures it, against the catalogue's figures for it; and the
    one-GPU cluster of those measurements (the host's optimizer step too), which every plan is also predicted on."""
    from snugfit.calibrate.hardware import host_ram, host_step_params_per_s, measure_accelerator

    on_gpu = env.device.type == "cuda"
    name = torch.cuda.get_device_name(env.device) if on_gpu else "cpu"
    listed = gpu_for_device(name, torch.cuda.get_device_properties(env.device).total_memory) if on_gpu else None
    measured, pcie = measure_accelerator(name, env.device.type, size=4096 if on_gpu else 256)
    host = Host(ram_bytes=host_ram(), cores=os.cpu_count() or 1,
                adam_params_per_s=host_step_params_per_s(staged=torch.bfloat16 if on_gpu else None))
    figures = ("tflops", "hbm_gbps", "op_overhead_s", "sac_overhead_s", "attention_tflops")
    out = {"device": name, "catalogue": listed.name if listed else None,
           "measured": {**{k: getattr(measured, k) for k in figures}, "pcie_gbps": pcie.gbps,
                        "host_step_params_per_s": host.adam_params_per_s}}
    if listed is not None:  # the catalogue states datasheet peaks; the time model applies its efficiencies on top
        out["ratio_to_catalogue"] = {
            **{f"tflops_{d}": t / listed.tflops[d] for d, t in measured.tflops.items() if listed.tflops.get(d)},
            "hbm": measured.hbm_gbps / listed.hbm_gbps}
        out["catalogue_efficiency"] = {"matmul": listed.matmul_efficiency, "memory": listed.mem_efficiency}
        # what the model takes for attention without a measurement: flash attention's published rates (head dim 128)
        out["published_attention_tflops"] = [r / 1e12 for r in attention_rates(listed, "bfloat16", 128)]
    card = replace(measured, name=f"measured {name}")  # a GPU entry, even for the CPU of --smoke
    node = make_node(card.name, 1, host=host, custom={card.name: card})
    return out, Cluster([node], node.intra, card.name)


def corrections_check(args, cfg: ModelConfig, env: DistEnv, cluster: Cluster, dtype: str) -> dict:
    """(f): a traced and a profiled step of the replicated plan after two warm-up steps (train.calibration, as a
    run's replan takes them), attributed to the time model's terms (plan.corrections)."""
    from snugfit.plan.corrections import derive
    from snugfit.train.calibration import calibration_steps

    mbs = max(1, args.batch // 2)
    plan = Plan.uniform(cfg.n_layers, micro_batch_size=mbs, num_microbatches=args.batch // mbs, seq_len=args.seq,
                        compute_dtype=dtype)
    prof = profile_model(cfg, micro_batch_size=mbs, seq_len=args.seq, dtype=dtype,
                         kernels="gpu" if env.device.type == "cuda" else "cpu")
    predicted = estimate(plan, prof, cluster)
    torch.manual_seed(0)
    engine = build_engine(Decoder(cfg), plan, OPTIM, env)
    engine.track_memory = False
    g = torch.Generator().manual_seed(3)
    batches = (torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g) for _ in iter(int, 1))
    for _ in range(WARMUP):
        engine.train_step(next(batches))
    corrections = derive(calibration_steps(engine, batches, 0, 1), predicted.time_by_phase, False)
    gpu = cluster.gpu_of(0)
    return {"plan": summary(plan), "predicted_step_s": predicted.step_time_s, "corrections": corrections.factors,
            "measured_terms_s": corrections.measured, "predicted_terms_s": corrections.predicted,
            "catalogue": {"tflops": gpu.tflops, "hbm_gbps": gpu.hbm_gbps, "op_overhead_s": gpu.op_overhead_s}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="built-in decoder: catalogue name (gpt2*, llama*, mistral-7b) or config.json")
    ap.add_argument("--seq", type=int, help="sequence length (default 1024; smoke 128)")
    ap.add_argument("--batch", type=int, help="global batch in sequences, two microbatches (default 4; smoke 8)")
    ap.add_argument("--steps", type=int, help="timed steps per plan after 2 warm-up steps (default 3; smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo: checks the logic without a GPU")
    args = ap.parse_args()
    args.seq = args.seq or (128 if args.smoke else 1024)
    args.batch = args.batch or (8 if args.smoke else 4)
    args.steps = args.steps or (1 if args.smoke else 3)
    t0 = time.perf_counter()
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA starts, which nothing has asked for yet
        torch.set_num_threads(1)
    env = one_rank()
    on_gpu = env.device.type == "cuda"
    if not (on_gpu or args.smoke):
        raise SystemExit("no CUDA GPU here; run with --smoke to check the logic on CPU")
    if on_gpu:  # the fp32 rows and reference compare summation order, not TF32's 10-bit mantissa
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cfg = model_config(args)
    dtype = "bfloat16" if on_gpu else "float32"
    cluster = local_cluster(env)  # the catalogue's entry for this GPU, else the GPU measured now
    params = profile_model(cfg, micro_batch_size=1, seq_len=args.seq, dtype=dtype).num_params()
    print(f"{cluster.gpu_of(0).name}, {params:,} parameters, seq {args.seq}, global batch {args.batch}, {dtype}")
    report = {"device": torch.cuda.get_device_name(env.device) if on_gpu else "cpu", "cluster": cluster.spec,
              "model": cfg.to_dict(), "params": params, "seq_len": args.seq, "global_batch": args.batch,
              "dtype": dtype}
    checked = guarded("hardware", lambda: hardware_check(env), report)  # first: each plan is predicted on it too
    report["hardware"], measured = checked if isinstance(checked, tuple) else (checked, None)
    free_memory(env)
    check_techniques(args, cfg, env, cluster, measured, dtype, report)
    check_moe(args, env, cluster, measured, dtype, report)
    report["offload_comparison"] = guarded("offload comparison",
                                           lambda: offload_comparison(args, cfg, env, cluster, dtype), report)
    report["corrections"] = guarded("corrections", lambda: corrections_check(args, cfg, env, cluster, dtype), report)
    free_memory(env)
    report["elapsed_s"] = time.perf_counter() - t0
    print(save(report, OUT), f"wrote {OUT / 'acceptance.json'} and {OUT / 'acceptance.md'}", sep="\n")
    dist.destroy_process_group()
    failed = [r["technique"] for r in report["techniques"] if r.get("loss_ok") is False or "error" in r]
    return 1 if failed or report.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
