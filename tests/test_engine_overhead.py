"""The engine costs what a plain loop costs: on one process with nothing to shard it runs without FSDP2, in fp32
and below (runtime.precision casts the compute copies once a step), and dispatches about the operators a plain
PyTorch loop dispatches. Operator counts are the same on any hardware, so the bar holds here what a GPU run shows
(docs/gpu.md: 18.4k operators a step against a plain loop's 13.7k when FSDP2 wrapped every unit)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from snugfit.calibrate.ops import count_ops
from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.profile import profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig, make_adamw

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=64)
OPT = OptimConfig(lr=1e-2)
SEQ, MBS, M = 32, 2, 2


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (MBS * M, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def plain_step(dtype: torch.dtype):
    """A plain loop: fp32 weights, autocast below fp32, fused AdamW, clip_grad_norm_."""
    torch.manual_seed(0)
    model = Decoder(CFG)
    opt = make_adamw(list(model.parameters()), OPT)

    def step(b: torch.Tensor) -> None:
        for mb in b.split(MBS):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(mb[:, :-1], mb[:, 1:]) / M
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def engine(dtype: str, zero: int = 0):
    plan = Plan.uniform(CFG.n_layers, block=BlockPlan(zero=zero), micro_batch_size=MBS, num_microbatches=M,
                        seq_len=SEQ, compute_dtype=dtype)
    torch.manual_seed(0)
    return build_engine(Decoder(CFG), plan, OPT, DistEnv()), plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_process_dispatches_what_a_plain_loop_does(dtype):
    eng, plan = engine(dtype)
    assert plan.runs_unwrapped and not any(isinstance(m, FSDPModule) for m in eng.model.modules())
    eng.track_memory = False  # as the trainer runs the steps it does not log
    plain = plain_step(getattr(torch, dtype))
    b = batch()
    for _ in range(2):  # optimizer states exist, caches warm
        eng.train_step(b)
        plain(b)
    ours, theirs = count_ops(lambda: eng.train_step(b)).count, count_ops(lambda: plain(b)).count
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_mixed_precision_without_fsdp2_trains_as_fsdp2_did():
    """The compute copies cast once a step (fp32 masters, fp32 gradient accumulation) do FSDP2's mixed precision:
    the same losses as a one-rank ZeRO-3 plan, which FSDP2 wraps; the tracker counts the copies as buffers, as the
    memory model predicts them."""
    losses = {}
    for zero in (0, 3):
        eng, plan = engine("bfloat16", zero)
        losses[zero] = [eng.train_step(batch(s)).loss for s in range(3)]
        if zero == 0:
            peak = eng.memory.peak()
            pred = estimate(plan, profile_model(CFG, micro_batch_size=MBS, seq_len=SEQ, dtype="bfloat16"),
                            parse_cluster("cpu")).tracked_by_rank[0]
            assert peak["device.buffers"] == pytest.approx(pred["device.buffers"], rel=0.05)
            assert peak["device.total"] == pytest.approx(pred["device.total"], rel=0.05)
            assert eng.cast.copies is None  # dropped before the optimizer ran
    assert losses[0] == losses[3]


FROZEN = "blocks:0-1"  # of CFG's 4 blocks


def _frozen_run(env: DistEnv, root_zero: int) -> tuple[list[float], list[bool]]:
    """Two steps of a model whose first two blocks are frozen, over this rank's rows of the same batches."""
    from snugfit.model.lora import freeze

    plan = Plan.uniform(CFG.n_layers, dp=env.world_size, block=BlockPlan(zero=0), root=BlockPlan(zero=root_zero),
                        micro_batch_size=MBS // env.world_size, num_microbatches=M, seq_len=SEQ)
    torch.manual_seed(0)
    model = Decoder(CFG)
    freeze(model, FROZEN)
    eng = build_engine(model, plan, OPT, env)
    rows = MBS // env.world_size  # of each microbatch, this rank's
    losses = [eng.train_step(batch(s).view(M, MBS, -1)[:, env.rank * rows:(env.rank + 1) * rows].reshape(M * rows, -1))
              .loss for s in range(2)]
    return losses, [isinstance(b, FSDPModule) for b in eng.model.blocks.values()]


@pytest.mark.parametrize("root_zero", [0, 3])
def test_frozen_blocks_run_without_fsdp2(root_zero):
    """A zero-0 block frozen whole has nothing for FSDP2 to gather, reduce or cast: at 2 ranks it is no FSDP2 unit
    (nor is it managed by the root unit, sharded or not), and training matches one process's."""
    from tests.distributed import run_ranks

    reference, _ = _frozen_run(DistEnv(), 0)
    for losses, units in run_ranks(_frozen_run, 2, root_zero):
        assert units == [False, False, True, True]
        assert losses == pytest.approx(reference, rel=1e-5)
