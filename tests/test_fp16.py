"""float16 training with dynamic loss scaling, at 1 and 2 ranks (FSDP2, and an offloaded optimizer unit).

An overflow is forced on the second step by writing inf into one rank's gradient
shard: every rank must skip that step (no parameter moves), halve the scale,
count it as an overflow, and train on. The 2-rank run equals the 1-rank run to
fp16 precision (activations are fp16 in both; rel 5e-3).
"""

from __future__ import annotations

import pytest
import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)
SEQ, MBS, STEPS, OVERFLOW_AT = 16, 2, 4, 1


def _run(env, dp: int) -> dict:
    from torch.distributed.tensor import DTensor

    from snugfit.runtime.build import build_engine

    torch.manual_seed(0)
    plan = Plan.uniform(CFG.n_layers, dp=dp, block=BlockPlan(zero=2), root=BlockPlan(zero=2, placement="host_step"),
                        micro_batch_size=MBS, num_microbatches=2 // dp, seq_len=SEQ, compute_dtype="float16")
    engine = build_engine(Decoder(CFG), plan, OptimConfig(lr=1e-2), env)
    update, step = engine._update, [0]

    def overflow_once(loss):
        if step[0] == OVERFLOW_AT and env.rank == 0:  # one shard of one rank: the global norm must catch it
            g = next(p.grad for p in engine.model.parameters() if p.grad is not None)
            (g.to_local() if isinstance(g, DTensor) else g).fill_(float("inf"))
        step[0] += 1
        return update(loss)

    engine._update = overflow_once
    batch = torch.randint(0, CFG.vocab_size, (2 * MBS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    out = {"losses": [], "skipped": [], "overflow": [], "scales": [], "moved": []}
    rows = 2 * MBS // dp
    for _ in range(STEPS):  # one batch over and over: its loss must fall
        if engine.host is not None:
            engine.host.wait()
        before = [p.detach().float().clone() for p in engine.model.parameters()]
        res = engine.train_step(batch[env.rank * rows:(env.rank + 1) * rows])
        if engine.host is not None:
            engine.host.wait()
        out["moved"].append(any(not torch.equal(b, p.detach().float())
                                for b, p in zip(before, engine.model.parameters())))
        out["losses"].append(res.loss)
        out["skipped"].append(res.skipped)
        out["overflow"].append(res.overflow)
        out["scales"].append(engine.loss_scale)
    return out


def _two(env) -> dict:
    return _run(env, 2)


def test_float16_overflow_is_skipped_counted_and_training_goes_on():
    from snugfit.runtime.dist import DistEnv

    one = _run(DistEnv(), 1)
    two = run_ranks(_two, 2)
    for r in [one, *two]:
        assert r["overflow"] == [i == OVERFLOW_AT for i in range(STEPS)]
        assert r["skipped"] == r["overflow"]
        assert r["moved"] == [i != OVERFLOW_AT for i in range(STEPS)]  # the skipped step moved nothing
        assert r["scales"][OVERFLOW_AT] == r["scales"][0] / 2 == r["scales"][-1]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    for r in two:
        assert r["losses"] == pytest.approx(one["losses"], rel=5e-3)
    assert one["losses"][-1] < one["losses"][0]
