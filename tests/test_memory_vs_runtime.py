"""The memory model against what the runtime holds, per rank, for plans run on CPU in 1, 2 and 4 processes.

The runtime's MemoryTracker counts the tensors it holds (parameters, gradients,
optimizer states, saved activations, gathered copies), not transients, so each
rank's tracked peak after a couple of steps is compared with the model's
prediction of exactly that (Prediction.tracked_by_rank), on device and on host.
The whole peak, transients included, is compared in one process, where torch's
MemTracker sees every tensor (test_memory_model; MemTracker cannot run a model
with frozen parameters, so LoRA plans are checked here only).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.lora import apply_lora, trainable_summary
from snugfit.model.quantize import quantize_base
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.profile import ModelProfile, profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, vocab_size=128, max_seq_len=32)
SEQ, MBS, LORA = 32, 2, 4


def _plan(dp: int, block: BlockPlan | None = None, root: BlockPlan | None = None, m: int = 1, mbs: int = MBS,
          blocks: int = CFG.n_layers, **kw) -> Plan:
    return Plan.uniform(blocks, dp=dp, block=block, root=root, micro_batch_size=mbs, num_microbatches=m,
                        seq_len=SEQ, **kw)


# name -> (plan, fine-tuning: "" none, "lora", "qlora" (LoRA over NF4 block linears))
ONE = {
    "keep": (_plan(1), ""),
    "recompute": (_plan(1, BlockPlan(activations="recompute"), BlockPlan()), ""),
    # the matmul outputs selective checkpointing caches out of the saved-tensor hooks' sight, shown to them (a
    # micro-batch large enough for the activations, not the optimizer step's gradients, to set the peak)
    "selective": (_plan(1, BlockPlan(activations="selective"), BlockPlan(), mbs=8), ""),
    "selective_half": (_plan(1, BlockPlan(activations="selective_half"), BlockPlan(), mbs=8), ""),
    # the checkpoints (block inputs) on host: nothing of the blocks held on the device
    "recompute_offload": (_plan(1, BlockPlan(activations="recompute_offload"), BlockPlan()), ""),
    "accumulate": (_plan(1, m=2), ""),
    "offload_optimizer": (_plan(1, BlockPlan(placement="host_step"), BlockPlan()), ""),
    "lora": (_plan(1, m=2), "lora"),
    # frozen weights stored in bf16 once: FSDP2 leaves them out of a zero-0 unit, so no gathered copy
    "lora_bf16": (_plan(1, m=2, compute_dtype="bfloat16"), "lora"),
    "qlora": (_plan(1, m=2), "qlora"),
}
TWO = {
    "zero0": (_plan(2), ""),
    "zero2_accumulate": (_plan(2, BlockPlan(zero=2), m=2), ""),
    "zero3": (_plan(2, BlockPlan(zero=3)), ""),
    "zero3_offload_optimizer": (_plan(2, BlockPlan(zero=3, placement="host_step"), BlockPlan(zero=1)), ""),
    "offload_params": (_plan(2, BlockPlan(zero=3, placement="params_on_host"), BlockPlan(zero=3), m=2), ""),
    "lora_zero3": (_plan(2, BlockPlan(zero=3, activations="recompute"), BlockPlan(zero=2), m=2), "lora"),
    # zero bubble, V: a microbatch is held from its forward to its weight backward (after the input backward)
    "pp2_zbv": (_plan(1, m=4, pp=2, schedule="zbv", blocks=4), ""),
    "lora_zero0": (_plan(2, m=2), "lora"),
    "qlora_zero3": (_plan(2, BlockPlan(zero=3), BlockPlan(zero=2), m=2), "qlora"),
    # pipeline stages count their own activations and are FSDP2 root units of their own
    "pp2_1f1b": (_plan(1, m=4, pp=2, schedule="1f1b"), ""),
    # stage 0 keeps one microbatch, evicting the others to stage 1, which holds them beside its own
    "pp2_bpipe_evict": (_plan(1, m=4, pp=2, schedule="bpipe", evict_bound=1), ""),
    # tensor parallelism: matrices split, norms replicated, the projections' gathered inputs kept whole
    "tp2": (_plan(1, m=2, tp=2), ""),
    "tp2_recompute": (_plan(1, BlockPlan(activations="recompute"), m=2, tp=2), ""),
    "tp2_zero3": (_plan(1, BlockPlan(zero=3), m=2, tp=2), ""),
    # gradients reduced every microbatch: only shards accumulate, on host for offloaded units
    "zero3_reduce_every_microbatch": (_plan(2, BlockPlan(zero=3), BlockPlan(zero=3), m=4, grad_reduce="microbatch"),
                                      ""),
    "zero2_offload_optimizer_reduce_every_microbatch": (
        _plan(2, BlockPlan(zero=2, placement="host_step"), BlockPlan(zero=2), m=4, grad_reduce="microbatch"), ""),
}
# a pipeline stage counts a saved DTensor by its local shard (its own untyped_storage() reports the global size)
FOUR = {
    "tp2_pp2": (_plan(1, m=4, pp=2, tp=2, schedule="1f1b"), ""),
    # pipeline stages keep ZeRO-1/2 units unsharded until the step's last backward; a zero-3 block's copy is
    # held while it runs, and the stage tracker must see it then
    "pp2_dp2_zero2": (_plan(2, BlockPlan(zero=2), BlockPlan(zero=2), m=4, pp=2, schedule="1f1b"), ""),
    "pp2_dp2_zero3_bpipe": (_plan(2, BlockPlan(zero=3), BlockPlan(zero=3), m=4, pp=2, schedule="bpipe"), ""),
    "pp2_dp2_interleaved_zb": (_plan(2, BlockPlan(zero=2, activations="recompute"), BlockPlan(zero=2), m=4, pp=2,
                                     schedule="interleaved_zb", virtual_stages=2, blocks=4), ""),
    "zero3_reduce_every_microbatch": (_plan(4, BlockPlan(zero=3), BlockPlan(zero=3), m=4, grad_reduce="microbatch"),
                                      ""),
    "pp2_dp2_zero2_reduce_every_microbatch": (
        _plan(2, BlockPlan(zero=2), BlockPlan(zero=2), m=4, pp=2, schedule="1f1b", grad_reduce="microbatch"), ""),
    "pp2_dp2_zero3_bpipe_reduce_every_microbatch": (
        _plan(2, BlockPlan(zero=3), BlockPlan(zero=3), m=4, pp=2, schedule="bpipe", grad_reduce="microbatch"), ""),
}


@functools.cache
def _profile(tune: str, dtype: str = "float32", blocks: int = CFG.n_layers) -> ModelProfile:
    return profile_model(replace(CFG, n_layers=blocks), micro_batch_size=MBS, seq_len=SEQ, dtype=dtype,
                         use_cache=False, lora_rank=LORA if tune else None,
                         quantize_base="nf4" if tune == "qlora" else "none")


def tracked_peaks(env: DistEnv, plans: dict[str, tuple[Plan, bool]]) -> dict[str, dict[str, int]]:
    """Each plan's MemoryTracker peak on this rank, over its second step (optimizer states exist by then)."""
    out = {}
    for name, (plan, tune) in plans.items():
        torch.manual_seed(0)
        model = Decoder(replace(CFG, n_layers=len(plan.blocks)))
        if tune:
            apply_lora(model, LORA)
        if tune == "qlora":
            quantize_base(model)
        engine = build_engine(model, plan, OptimConfig(), env)
        batch = torch.randint(0, CFG.vocab_size, (plan.num_microbatches * plan.micro_batch_size, SEQ + 1))
        for _ in range(2):
            engine.train_step(batch)
        out[name] = engine.memory.peak()
    return out


def _check(measured: list[dict[str, dict[str, int]]], plans: dict[str, tuple[Plan, bool]]) -> None:
    for name, (plan, tune) in plans.items():
        cluster = parse_cluster(f"{plan.world_size}xcpu" if plan.world_size > 1 else "cpu")
        pred = estimate(plan, _profile(tune, plan.compute_dtype, len(plan.blocks)), cluster)
        for rank, peaks in enumerate(measured):
            for place in ("device", "host"):
                want, got = pred.tracked_by_rank[rank][f"{place}.total"], peaks[name][f"{place}.total"]
                assert got == pytest.approx(want, rel=0.05), f"{name} rank {rank} {place}: {got} vs {want}"
            if plan.grad_reduce == "microbatch":  # the gradients, too, are the shards the model counts
                for key in ("device.gradients", "host.gradients"):
                    want, got = pred.tracked_by_rank[rank].get(key, 0), peaks[name][key]
                    assert got == pytest.approx(want, rel=0.05), f"{name} rank {rank} {key}: {got} vs {want}"


def test_tracked_peak_matches_the_model_in_one_process():
    _check([tracked_peaks(DistEnv(), ONE)], ONE)


def test_tracked_peak_matches_the_model_per_rank_at_2_ranks():
    _check(run_ranks(tracked_peaks, 2, TWO), TWO)


def test_tracked_peak_matches_the_model_per_rank_at_4_ranks():
    _check(run_ranks(tracked_peaks, 4, FOUR), FOUR)


def test_lora_profile_counts_trainable_parameters():
    model = Decoder(CFG)
    apply_lora(model, LORA)
    summary = trainable_summary(model)
    assert [p.num_trainable for p in _profile("lora").pieces] == [
        summary[p.name]["trainable"] for p in _profile("lora").pieces]
    assert _profile("lora").blocks[0].trainable == 4 * 2 * LORA * CFG.dim  # q, k, v, o: A and B
