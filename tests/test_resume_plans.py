"""Resume under another plan: a checkpoint saved by 2 ranks with ZeRO-3 continues on 1 or 4 ranks, or as a pipeline.

Acceptance: on CPU, the losses after resuming equal those of an uninterrupted
run under the new plan (rel 1e-5: other world sizes reduce in other orders).

Every run trains on the same fixed global batches b0..b3 (8 rows each); data-
parallel rank r takes rows [r*B/dp, (r+1)*B/dp), every stage of a pipeline the
whole rows of its data-parallel rank. The 2-rank ZeRO-3 run (plan A) saves after
b0, b1. Under each new plan N: an uninterrupted run trains b0..b3, and a fresh
engine loads the checkpoint and trains b2, b3; their losses on b2, b3 must match.
Spawns are the cost, so each world size is one spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from snugfit.train.build import RunData
from tests.distributed import run_ranks

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, max_seq_len=16)
OPT = OptimConfig(lr=1e-2, grad_clip=1.0)
SEQ, GLOBAL_BATCH, STEPS, SAVED_AFTER = 16, 8, 4, 2


def make_plan(dp: int = 1, pp: int = 1, zero: int = 0, **kw) -> Plan:
    nmb = 4 if pp > 1 else 2  # a pipeline needs num_microbatches >= pp; more keeps its bubble small
    plan = Plan.uniform(CFG.n_layers, dp=dp, pp=pp, block=BlockPlan(zero=zero), micro_batch_size=GLOBAL_BATCH // (dp * nmb),
                        num_microbatches=nmb, seq_len=SEQ, **kw)
    assert plan.global_batch == GLOBAL_BATCH
    return plan


SAVED = make_plan(dp=2, zero=3)  # plan A: the checkpoint's
NEW = {
    "1rank-dp1-zero0": make_plan(dp=1, zero=0),
    "4ranks-dp4-zero3": make_plan(dp=4, zero=3),
    "2ranks-pp2-1f1b": make_plan(pp=2, schedule="1f1b"),
}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def engine_for(env: DistEnv, plan: Plan):
    torch.manual_seed(0)  # same initial weights on every rank and in every run
    return build_engine(Decoder(CFG), plan, OPT, env)


def train(engine, env: DistEnv, plan: Plan, steps: list[torch.Tensor]) -> list[float]:
    rows = GLOBAL_BATCH // plan.dp
    dp_rank = env.rank % plan.dp  # ranks are stage * dp + dp_rank
    out = []
    for batch in steps:
        result = engine.train_step(batch[dp_rank * rows:(dp_rank + 1) * rows])
        assert not result.skipped
        out.append(result.loss)
    return out


def validation_loss(engine, env: DistEnv, plan: Plan) -> float:
    """The checkpoint's validation loss as the trainer takes it (train.build.RunData.eval_batches: each
    data-parallel rank its part of the same held-out batches)."""
    val = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH * 3 * (SEQ + 1),), generator=torch.Generator().manual_seed(9))
    batches = RunData(val.numpy(), val.numpy(), instruct=False).eval_batches(plan, 2, plan.layout.coords(env.rank)[1])
    return sum(engine.eval_loss(b) for b in batches) / len(batches)


def save_plan_a(env: DistEnv, ckpt: str) -> dict:
    """Plan A on 2 ranks: b0, b1, checkpoint (and its validation loss), then b2, b3 (its own continuation, for
    reference)."""
    data = batches()
    engine = engine_for(env, SAVED)
    losses = train(engine, env, SAVED, data[:SAVED_AFTER])
    dcp.save(engine.state_dict(), checkpoint_id=ckpt)
    dist.barrier()  # the checkpoint is complete before anyone loads it
    val = validation_loss(engine, env, SAVED)
    return {"losses": losses + train(engine, env, SAVED, data[SAVED_AFTER:]), "val": val}


def under_new_plan(env: DistEnv, plan: Plan, ckpt: str) -> dict:
    """Uninterrupted b0..b3 under `plan`, and a fresh engine resumed from the checkpoint (its validation loss)
    on b2, b3."""
    data = batches()
    uninterrupted = train(engine_for(env, plan), env, plan, data)
    engine = engine_for(env, plan)
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    engine.load_state_dict(state)
    val = validation_loss(engine, env, plan)
    return {"uninterrupted": uninterrupted, "val": val, "resumed": train(engine, env, plan, data[SAVED_AFTER:])}


def two_rank_work(env: DistEnv, ckpt: str) -> dict:
    return {"saved": save_plan_a(env, ckpt), "2ranks-pp2-1f1b": under_new_plan(env, NEW["2ranks-pp2-1f1b"], ckpt)}


def four_rank_work(env: DistEnv, ckpt: str) -> dict:
    return {"4ranks-dp4-zero3": under_new_plan(env, NEW["4ranks-dp4-zero3"], ckpt)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Per-rank results by name; the 4-rank and 1-rank runs need the checkpoint the 2-rank spawn writes."""
    ckpt = str(tmp_path_factory.mktemp("resume") / "plan_a")
    out: dict[str, list] = {}
    two = run_ranks(two_rank_work, 2, ckpt)
    out["saved"] = [r["saved"]["losses"] for r in two]
    out["saved-val"] = [r["saved"]["val"] for r in two]
    out["2ranks-pp2-1f1b"] = [r["2ranks-pp2-1f1b"] for r in two]
    out["4ranks-dp4-zero3"] = [r["4ranks-dp4-zero3"] for r in run_ranks(four_rank_work, 4, ckpt)]
    out["1rank-dp1-zero0"] = run_ranks(under_new_plan, 1, NEW["1rank-dp1-zero0"], ckpt)
    return out


def test_plan_a_ranks_agree(runs):
    saved = runs["saved"]
    assert saved[0] == saved[1]  # every rank reports the same global loss


def test_resumed_state_is_not_the_initial_one(runs):
    """Guards the comparison below: untrained weights would give a clearly different loss on b2."""
    torch.manual_seed(0)
    batch = batches()[SAVED_AFTER]
    with torch.no_grad():
        untrained = Decoder(CFG)(batch[:, :-1], batch[:, 1:]).item()
    assert runs["saved"][0][SAVED_AFTER] != pytest.approx(untrained, rel=1e-4)


@pytest.mark.parametrize("name", list(NEW))
def test_resume_matches_uninterrupted_run_under_new_plan(runs, name):
    for rank in runs[name]:
        expected = rank["uninterrupted"][SAVED_AFTER:]
        assert rank["resumed"] == pytest.approx(expected, rel=1e-5), (name, rank)
    first = runs[name][0]
    assert all(r == first for r in runs[name])  # the global loss is the same on every rank


@pytest.mark.parametrize("name", list(NEW))
def test_new_plan_reproduces_plan_a(runs, name):
    """Same weights, data and optimizer: any plan's losses track plan A's, before and after the save point."""
    for rank in runs[name]:
        assert rank["uninterrupted"] == pytest.approx(runs["saved"][0], rel=1e-5), name
        assert rank["resumed"] == pytest.approx(runs["saved"][0][SAVED_AFTER:], rel=1e-5), name


def test_a_checkpoint_s_validation_loss_is_the_same_under_every_plan(runs):
    """The same weights on the same held-out examples: dp 2 (where it was saved), one rank, a 2-stage pipeline and
    dp 4 give one validation loss (it differed between --nproc 1 and 2 while the set was sized per rank)."""
    saved = runs["saved-val"][0]
    assert runs["saved-val"][1] == saved
    for name in NEW:
        assert [r["val"] for r in runs[name]] == pytest.approx([saved] * len(runs[name]), rel=1e-5), name
