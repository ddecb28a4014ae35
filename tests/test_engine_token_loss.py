"""The step loss is the mean over every target token of the global batch, whatever the split.

Instruction batches mask each row's prompt and padding, so microbatches and
ranks hold different numbers of target tokens. Every engine -- accumulation in
one process, data parallelism, pipelines, both -- must give the loss and the
gradients of one forward over the whole global batch (a token mean), and plain
text must keep the per-microbatch mean it always had.
"""

from __future__ import annotations

import pytest
import torch

from snugfit.data.instruct import IGNORE
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.microbatches import loss_divisors
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
SEQ, ROWS = 16, 8
PROMPTS = [1, 14, 3, 12, 0, 15, 6, 10]  # prompt length per row: 15 targets down to 1
PADDING = [0, 0, 5, 0, 9, 0, 2, 0]  # masked padding at the end of some rows

# name -> Plan.uniform arguments; each for a global batch of ROWS rows
PLANS = {
    1: {"accumulate-4": dict(micro_batch_size=2, num_microbatches=4),
        "accumulate-8": dict(micro_batch_size=1, num_microbatches=8)},
    2: {"dp2-zero3": dict(dp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3)),
        "pp2-1f1b": dict(pp=2, schedule="1f1b", micro_batch_size=2, num_microbatches=4),
        "pp2-bpipe": dict(pp=2, schedule="bpipe", micro_batch_size=2, num_microbatches=4)},
    4: {"dp4-zero2": dict(dp=4, micro_batch_size=1, num_microbatches=2, block=BlockPlan(zero=2)),
        "pp2xdp2-1f1b": dict(pp=2, dp=2, schedule="1f1b", micro_batch_size=1, num_microbatches=4)},
}


def instruct_batch() -> torch.Tensor:
    """(ROWS, 2, SEQ + 1): tokens, and targets masked on each row's prompt and padding."""
    tokens = torch.randint(0, CFG.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    targets = tokens.clone()
    for row, (prompt, pad) in enumerate(zip(PROMPTS, PADDING)):
        targets[row, : prompt + 1] = IGNORE  # position 0 is never a target
        targets[row, SEQ + 1 - pad:] = IGNORE
    return torch.stack([tokens, targets], dim=1)


def fresh_model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CFG)


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One forward over the whole global batch: the token-mean loss and its gradients."""
    batch = instruct_batch()
    model = fresh_model()
    loss = model(batch[:, 0, :-1], batch[:, 1, 1:])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _step(env: DistEnv, world: int) -> dict:
    """Every plan for this world size: eval and one step on this rank's rows, checked against the reference."""
    from snugfit.runtime.build import build_engine

    ref_loss, ref_grads = reference()
    out = {}
    for name, spec in PLANS[world].items():
        plan = Plan.uniform(CFG.n_layers, seq_len=SEQ, **spec)
        engine = build_engine(fresh_model(), plan, OptimConfig(grad_clip=0.0), env)
        bad: list[str] = []
        update = engine._update

        def check_grads(loss, engine=engine, bad=bad, update=update):  # the reduced gradients the update steps on
            for n, p in engine.model.named_parameters():
                try:
                    torch.testing.assert_close(_full(p.grad), ref_grads[n], rtol=1e-5, atol=1e-6)
                except AssertionError as err:
                    bad.append(f"{n}: {err}")
            return update(loss)

        engine._update = check_grads
        rows, dp_rank = ROWS // plan.dp, env.rank % plan.dp
        rank_batch = instruct_batch()[dp_rank * rows:(dp_rank + 1) * rows]
        out[name] = {"eval": engine.eval_loss(rank_batch), "loss": engine.train_step(rank_batch).loss, "bad": bad,
                     "ref": ref_loss}
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        for name, res in r.items():
            assert res["loss"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-6), name
            assert res["eval"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-6), name
            assert not res["bad"], (name, res["bad"])


def test_the_batch_is_unbalanced():
    """Averaging microbatch means would weight these tokens unequally: far from the token mean."""
    batch = instruct_batch()
    counts = (batch[:, 1, 1:] != IGNORE).sum(1)
    assert counts.max() >= 10 * counts.min() > 0
    model = fresh_model()
    with torch.no_grad():
        halves = [model(b[:, 0, :-1], b[:, 1, 1:]).item() for b in batch.split(ROWS // 2)]
    assert abs(sum(halves) / 2 - reference()[0]) > 1e-3


def test_one_process_accumulation_equals_full_batch():
    try:
        _check([_step(DistEnv(), 1)])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_full_batch(world):
    _check(run_ranks(_step, world, world))


def test_plain_text_keeps_the_microbatch_mean():
    """Every position a target: each microbatch's mean is divided by the microbatch count, exactly as before."""
    plan = Plan.uniform(2, micro_batch_size=2, num_microbatches=3, seq_len=SEQ)
    tokens = torch.randint(0, CFG.vocab_size, (6, SEQ + 1))
    assert loss_divisors(tokens, plan) == [3.0] * 3
    assert loss_divisors(torch.stack([tokens, tokens], dim=1), plan) == [3.0] * 3  # unmasked pairs count the same
