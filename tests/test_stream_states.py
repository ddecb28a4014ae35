"""Streamed optimizer states (BlockPlan.stream_states) and the step in backward (OptimizerPlan.in_backward) against
host AdamW and the plain step, at 1 and 2 ranks (ZeRO-3), and the memory tracker against the model for them.

With clipping off, every way of updating is the same AdamW on the same gradients: host offload's update on the
host, the device's after backward, the device's with states streamed from host, and each unit's in backward. Their
weights after a few steps agree within float tolerance (the fused kernels are the same on CPU; the gradients of a
unit stepped in backward are its reduced shard, as after backward).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, OptimizerPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.plan.search import search
from snugfit.profile import profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=16)
SEQ, BATCH, STEPS = 16, 4, 3
IN_BACKWARD = OptimizerPlan(in_backward=True)
# name -> (block decision, root decision, optimizer setup); "host" is the reference
UPDATES = {
    "host": (BlockPlan(placement="host_step"), BlockPlan(placement="host_step"), OptimizerPlan()),
    "device": (BlockPlan(), BlockPlan(), OptimizerPlan()),
    "streamed": (BlockPlan(placement="streamed"), BlockPlan(placement="streamed"), OptimizerPlan()),
    "in_backward": (BlockPlan(), BlockPlan(), IN_BACKWARD),
    "streamed_in_backward": (BlockPlan(placement="streamed"), BlockPlan(placement="streamed"), IN_BACKWARD),
    "host_in_backward": (BlockPlan(placement="host_step"), BlockPlan(placement="streamed"), IN_BACKWARD),
}


def plan_for(dp: int, name: str, pp: int = 1) -> Plan:
    """ZeRO-3 over dp; with a pipeline, each rank's two microbatches reduced as they come (the step in backward
    needs it)."""
    block, root, optimizer = UPDATES[name]
    zero = 3 if dp > 1 else 0
    m = 2 if pp > 1 else 1
    return Plan.uniform(CFG.n_layers, dp=dp, pp=pp, block=BlockPlan(**{**vars(block), "zero": zero}),
                        root=BlockPlan(**{**vars(root), "zero": zero}), micro_batch_size=BATCH // dp // m,
                        num_microbatches=m, seq_len=SEQ, optimizer=optimizer,
                        grad_reduce="microbatch" if pp > 1 else "step")


def run(env: DistEnv, pp: int = 1) -> dict:
    """Each update's full weights after STEPS steps, and the tracker's peak of its second step."""
    dp, out = env.world_size // pp, {}
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    for name in UPDATES:
        torch.manual_seed(0)
        plan = plan_for(dp, name, pp)
        engine = build_engine(Decoder(CFG), plan, OptimConfig(lr=1e-2, grad_clip=0.0), env)
        dp_rank = plan.layout.coords(env.rank)[1]
        peak = None
        for step, batch in enumerate(batches):
            engine.train_step(batch[dp_rank * BATCH // dp:(dp_rank + 1) * BATCH // dp])
            peak = engine.memory.peak() if step == 1 else peak
        if engine.host is not None:
            engine.host.wait()
        state = engine.state_dict()["model"]  # host masters where they are (a pipeline rank: its stages' only)
        # numpy, not tensors: a spawned rank's tensors come back through shared memory gone with the rank
        out[name] = {"weights": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().numpy()
                                 .copy() for k, v in state.items()}, "peak": peak}
    return out


def check(per_rank: list[dict], dp: int) -> None:
    ref = per_rank[0]["host"]["weights"]
    for name in UPDATES:
        for key, want in ref.items():
            got = per_rank[0][name]["weights"][key]
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (name, key, abs(got - want).max())
    prof = profile_model(CFG, micro_batch_size=BATCH // dp, seq_len=SEQ, dtype="float32", use_cache=False)
    for name in UPDATES:
        pred = estimate(plan_for(dp, name), prof, parse_cluster(f"{dp}xcpu" if dp > 1 else "cpu"))
        for rank, results in enumerate(per_rank):
            for place in ("device", "host"):
                want, got = pred.tracked_by_rank[rank][f"{place}.total"], results[name]["peak"][f"{place}.total"]
                assert got == pytest.approx(want, rel=0.05), f"{name} rank {rank} {place}: {got} vs {want}"


def test_streamed_states_and_the_step_in_backward_match_host_adamw_at_1_rank():
    try:
        check([run(DistEnv())], 1)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_streamed_states_and_the_step_in_backward_match_host_adamw_at_2_ranks():
    check(run_ranks(run, 2), 2)


def test_the_step_in_backward_and_streamed_states_through_a_pipeline_at_4_ranks():
    """pp 2 x dp 2 (ZeRO-3), 1F1B, every microbatch reduced: each unit steps after its last microbatch's
    backward, whichever order the schedule runs them in; the weights are host AdamW's."""
    per_rank = run_ranks(run, 4, 2)
    for name in UPDATES:
        for first in (0, 2):  # the first rank of each pipeline rank holds its stage's weights
            for key, want in per_rank[first]["host"]["weights"].items():
                got = per_rank[first][name]["weights"][key]
                assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (name, key, abs(got - want).max())


def test_the_search_never_streams_states_on_cpu_ranks():
    """On CPU ranks host and device are one memory: nothing to stream to, even where nothing else fits."""
    prof = profile_model(CFG, micro_batch_size=1, seq_len=SEQ, dtype="float32", use_cache=False)
    for spec, budget in (("cpu", None), ("2xcpu", None), ("2xcpu", 400_000)):
        try:
            res = search(prof, parse_cluster(spec), global_batch=4, memory_budget=budget, alternatives=3)
        except Exception as e:  # noqa: BLE001 - nothing fits: then nothing was chosen either
            assert "fits" in str(e)
            continue
        for plan in [res.best, *res.alternatives]:
            assert not any(b.stream_states for b in [plan.root, *plan.blocks])
