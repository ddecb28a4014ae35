"""Tensor parallelism on a Hugging Face Llama with grouped-query attention, at 4 gloo ranks, against one process;
a tp2 checkpoint resumed without tensor parallelism. (The built-in decoder's tp plans, 2 and 4 ranks, are in
test_runtime_dp.py beside the other plans.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

pytest.importorskip("transformers")

from snugfit.plan import BlockPlan, Plan  # noqa: E402
from snugfit.runtime.build import build_engine  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig  # noqa: E402
from snugfit.runtime.memory import local  # noqa: E402
from snugfit.runtime.mesh import ParallelDims  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.test_hf import MBS, NMB, SEQ, STEPS, _batches, _fresh, _reference  # noqa: E402

OPTIM = OptimConfig(lr=1e-2, grad_clip=0.5)
Z3 = BlockPlan(zero=3)


def plans() -> dict[str, Plan]:
    """Every plan trains the reference's global batch of 2 x MBS x NMB rows per step."""
    return {
        "dp2_tp2": Plan.uniform(2, dp=2, tp=2, block=Z3, root=Z3, micro_batch_size=MBS, num_microbatches=NMB,
                                seq_len=SEQ),
        "tp2_pp2": Plan.uniform(2, tp=2, pp=2, micro_batch_size=MBS, num_microbatches=2 * NMB, seq_len=SEQ),
        # where the dp2_tp2 checkpoint resumes: no tensor parallelism, other data-parallel layouts
        "dp4": Plan.uniform(2, dp=4, block=Z3, root=Z3, micro_batch_size=MBS, num_microbatches=NMB // 2,
                            seq_len=SEQ),
        "dp2_pp2": Plan.uniform(2, dp=2, pp=2, micro_batch_size=MBS, num_microbatches=NMB, seq_len=SEQ),
    }


def _step(engine, plan: Plan, batch: torch.Tensor, rank: int) -> float:
    rows = plan.micro_batch_size * plan.num_microbatches
    dp_rank = plan.layout.coords(rank)[1]
    return engine.train_step(batch[dp_rank * rows:(dp_rank + 1) * rows]).loss


def _logits_widths(model: nn.Module) -> list[int] | None:
    """Records the vocabulary width of every logits tensor this rank's head computes (None: no head here)."""
    head = getattr(model, "head", None)
    if head is None:
        return None
    widths: list[int] = []
    linear = [m for m in head.modules() if isinstance(m, nn.Linear)][-1]
    linear.register_forward_hook(lambda mod, args, out: widths.append(local(out).shape[-1]))
    return widths


def _run(env, ckpt: str) -> dict[str, list[float]]:
    p, batches, out = plans(), _batches(STEPS), {}
    for name in ("dp2_tp2", "tp2_pp2"):
        engine = build_engine(_fresh(False), p[name], OPTIM, env)
        widths = _logits_widths(engine.model)
        out[name] = [_step(engine, p[name], b, env.rank) for b in batches]
        if widths is not None:  # the rank holds the head (every dp2_tp2 rank, the last stage of tp2_pp2)
            out[f"{name} logits width"] = sorted(set(widths))
        if name == "dp2_tp2":  # the mesh's sub-groups wait as long as the run's default group (120 s), no longer
            groups = ParallelDims.of(p[name], env).world.get_all_groups()
            out["mesh group timeouts"] = sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                                 for g in groups})
            engine = build_engine(_fresh(False), p[name], OPTIM, env)
            for b in batches[:2]:
                _step(engine, p[name], b, env.rank)
            dcp.save(engine.state_dict(), checkpoint_id=ckpt)
    for name in ("dp4", "dp2_pp2"):
        engine = build_engine(_fresh(False), p[name], OPTIM, env)
        state = engine.state_dict()
        dcp.load(state, checkpoint_id=ckpt)
        engine.load_state_dict(state)
        out[name] = [_step(engine, p[name], batches[2], env.rank)]
    return out


def test_llama_gqa_tensor_parallel_matches_one_process_and_resumes_without_it(tmp_path):
    results = run_ranks(_run, 4, str(tmp_path / "tp2"))
    reference = _reference(False, OPTIM)
    vocab = _fresh(False).cfg.vocab_size
    assert all(r.pop("mesh group timeouts") == [120.0] for r in results)  # tests.distributed's timeout_s
    for name in ("dp2_tp2", "tp2_pp2"):  # logits stay split by vocabulary (loss_parallel): never gathered
        holders = [r[f"{name} logits width"] for r in results if f"{name} logits width" in r]
        assert holders and all(w == [vocab // 2] for w in holders), (name, holders)
        for r in results:
            r.pop(f"{name} logits width", None)
    for name, losses in results[0].items():
        assert all(r[name] == losses for r in results), name  # every rank reports the global loss
        want = reference if len(losses) == STEPS else reference[2:]  # resumed: the step after the checkpoint
        assert losses == pytest.approx(want, rel=1e-5), name
