"""The memory model's gradient bytes at each FSDP2 reduce against a probe of the live tensors (2 gloo ranks).

The probe wraps FSDP2's reduce-scatter copy-in, the moment a unit's unsharded gradients and its reduce-scatter
input are both alive, and sums what every FSDP2 parameter holds then: unsharded, accumulated and sharded
gradients, and the reduce-scatter inputs kept.
"""

from __future__ import annotations

import pytest
import torch

from snugfit.model import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from tests.distributed import run_ranks

CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, vocab_size=512, max_seq_len=16)
MBS, SEQ = 2, 16
PLANS = {  # name -> (block plan, root plan, microbatches)
    "zero3": (BlockPlan(zero=3), BlockPlan(zero=3), 1),
    "zero3-accumulated": (BlockPlan(zero=3), BlockPlan(zero=3), 2),
    "zero2": (BlockPlan(zero=2), BlockPlan(zero=1), 1),
    "zero0": (BlockPlan(zero=0), BlockPlan(zero=0), 1),
    "offload-optimizer": (BlockPlan(zero=2, placement="host_step"), BlockPlan(zero=2), 1),
}


def _plan(name: str) -> Plan:
    block, root, nmb = PLANS[name]
    return Plan.uniform(CFG.n_layers, dp=2, micro_batch_size=MBS, num_microbatches=nmb, seq_len=SEQ, block=block,
                        root=root)


def _probe(env) -> dict[str, list[tuple[int, int]]]:
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    from torch.distributed.fsdp import FSDPModule

    from snugfit.runtime.build import build_engine
    from snugfit.runtime.optimizer import OptimConfig

    real = collectives.foreach_reduce_scatter_copy_in
    out = {}
    try:
        for name in PLANS:
            plan = _plan(name)
            torch.manual_seed(0)
            engine = build_engine(Decoder(CFG), plan, OptimConfig(), env)
            groups = [m._get_fsdp_state()._fsdp_param_group for m in engine.model.modules()
                      if isinstance(m, FSDPModule)]
            params = [fp for g in groups if g is not None for fp in g.fsdp_params]
            comm = engine.model._get_fsdp_state()._comm_ctx
            seen = out[name] = []

            def copy_in(unsharded_grads, reduce_scatter_input, world_size, params=params, comm=comm, seen=seen):
                real(unsharded_grads, reduce_scatter_input, world_size)
                live = {id(g): g.nbytes for g in unsharded_grads}
                for fp in params:
                    for g in (getattr(getattr(fp, "_unsharded_param", None), "grad", None),
                              fp.unsharded_accumulated_grad, fp.sharded_param.grad):
                        if g is not None:
                            g = getattr(g, "_local_tensor", g)
                            live[id(g)] = g.nbytes
                kept = sum(s.reduce_scatter_input.nbytes for s in comm.reduce_scatter_states)
                seen.append((sum(live.values()), reduce_scatter_input.nbytes + kept))

            collectives.foreach_reduce_scatter_copy_in = copy_in
            batch = torch.randint(0, CFG.vocab_size, (MBS * plan.num_microbatches, SEQ + 1))
            engine.train_step(batch)
            collectives.foreach_reduce_scatter_copy_in = real
            if engine.host is not None:
                engine.host.wait()
    finally:
        collectives.foreach_reduce_scatter_copy_in = real
    return out


@pytest.fixture(scope="module")
def probed():
    return run_ranks(_probe, 2)


@pytest.mark.parametrize("name", list(PLANS))
def test_gradient_bytes_at_each_reduce_match_the_live_tensors(probed, name):
    from snugfit.plan.piece_memory import device_saved, rank_stages
    from snugfit.plan.reduce_memory import reduce_moments
    from snugfit.profile.cache import profile_model

    plan = _plan(name)
    prof = profile_model(CFG, micro_batch_size=MBS, seq_len=SEQ, use_cache=False)
    stages = rank_stages(plan, prof, 0)
    moments = reduce_moments(plan, stages, {sp.piece.name: device_saved(sp) for sps in stages.values() for sp in sps})
    assert [m.unit for m in moments] == ["block.2", "block.1", "block.0", "embed"]
    for rank in probed:
        measured = rank[name]
        assert len(measured) == len(moments)
        for m, (gradients, reduce_input) in zip(moments, measured):
            assert m.gradients == pytest.approx(gradients, rel=0.05), m
            assert m.reduce_input == pytest.approx(reduce_input, rel=0.05), m
