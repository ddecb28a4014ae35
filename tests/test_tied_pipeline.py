"""Tied embeddings across pipeline stages (runtime.tied_embeddings): the first and last stages each hold the shared
weight, their gradients are summed, and the run equals the one-process model that holds it once.

Each configuration is built as `snugfit train` builds it, on the meta device and filled by the weights' source
(the built-in init drawn per tensor, or a Hugging Face folder read by each rank), so the copies' initial equality is
tested too. Each rank compares its own gradient shards, after the sum and before the update, with a reference it
computes itself. Spawns are the cost, so each world size is one spawn.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.hf import FolderWeights, load_hf
from snugfit.plan import BlockPlan, OptimizerPlan, Placement, Plan, PlanError
from snugfit.plan.estimate import estimate
from snugfit.plan.options import Constraints
from snugfit.plan.search import search
from snugfit.profile import profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.microbatches import split_batch
from snugfit.runtime.optimizer import OptimConfig, make_optimizer
from snugfit.runtime.tied_embeddings import TiedEmbeddings
from snugfit.train.build import InitWeights
from tests.distributed import check_update_gradients, run_ranks

SEQ, MICRO, SEED = 16, 4, 3
# a wide vocabulary: the head's copy is a third of the model, so the memory model's charge for it shows
CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, vocab_size=512, max_seq_len=SEQ, tie_embeddings=True)
OPT = OptimConfig(lr=1e-2, grad_clip=1.0)
TIED = ("embed.tokens.weight", "head.weight")

# name -> Plan.uniform arguments (world = pp x dp)
PLANS = {
    "pp2": dict(pp=2, schedule="1f1b"),
    "pp2-zbv": dict(pp=2, schedule="zbv"),  # 4 stages; rank 0 runs the first and the last: its copies sum in place
    "pp2xdp2": dict(pp=2, dp=2, schedule="1f1b"),
    "pp4": dict(pp=4, schedule="1f1b"),  # ranks 1 and 2 hold no copy
    # the copies sharded over dp (their local shards pair), on host between uses (their gradients too)
    "pp2xdp2-zero3-offload_params": dict(pp=2, dp=2, schedule="1f1b", block=BlockPlan(zero=3),
                                         root=BlockPlan(zero=3, placement=Placement.PARAMS_ON_HOST)),
    # the root's masters and AdamW on host: the copies' gradients are host offload's
    "pp2-offload_optimizer": dict(pp=2, schedule="1f1b", root=BlockPlan(placement=Placement.HOST_STEP)),
}
# which model trains under which plans, at 2 and 4 ranks
RUNS = {2: [("decoder", "pp2"), ("decoder", "pp2-zbv"), ("hf", "pp2"), ("hf", "pp2-zbv"),
            ("decoder", "pp2-offload_optimizer")],
        4: [("decoder", "pp2xdp2"), ("hf", "pp2xdp2"), ("decoder", "pp2xdp2-zero3-offload_params"),
            ("decoder", "pp4")]}


def make_plan(name: str, **kw) -> Plan:
    spec = PLANS[name]
    rows = 8 // spec.get("dp", 1)
    return Plan.uniform(CFG.n_layers, micro_batch_size=rows // MICRO, num_microbatches=MICRO, seq_len=SEQ, **spec,
                        **kw)


def hf_folder(path: str) -> str:
    """A tiny Qwen2 with tied embeddings, saved as a Hugging Face folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def reference_model(folder: str | None):
    if folder is not None:
        return load_hf(folder)
    model = Decoder(CFG)
    model.init_weights(SEED)  # the values InitWeights draws per tensor on the meta device
    return model


def meta_model(folder: str | None):
    """The model as `snugfit train` builds it: on the meta device, with what fills it after sharding."""
    if folder is not None:
        return load_hf(folder, device="meta"), FolderWeights(Path(folder))
    with torch.device("meta"):
        return Decoder(CFG), InitWeights(SEED)


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (8, SEQ + 1), generator=g) for _ in range(steps)]


def reference(folder: str | None, plan: Plan, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each step's loss (mean over all microbatches of all dp ranks) and the first step's gradients,
    the tied weight's under both names."""
    model = reference_model(folder)
    opt = make_optimizer(list(model.parameters()), OPT, plan.optimizer)  # the engine's AdamW, one unit
    losses, first = [], None
    for batch in batches(steps):
        micro = [mb for rows in batch.chunk(plan.dp) for mb in split_batch(rows, plan)]
        total = 0.0
        for mb in micro:
            loss = model(*mb) / len(micro)
            loss.backward()
            total += loss.item()
        losses.append(total)
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
            first["head.weight"] = first["embed.tokens.weight"]
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.grad_clip)
        opt.step()
        opt.zero_grad()
    return losses, first


def rows_of(env, plan: Plan, batch: torch.Tensor) -> torch.Tensor:
    return batch.chunk(plan.dp)[plan.layout.coords(env.rank)[1]]


def train_and_check(env, name: str, folder: str | None, steps: int = 2) -> dict:
    """`steps` steps of a configuration on this rank; the first's gradients checked against the reference."""
    plan = make_plan(name)
    ref_losses, ref_grads = reference(folder, plan, steps)
    model, weights = meta_model(folder)
    engine = build_engine(model, plan, OPT, env, weights)
    checked, bad = [], []
    update = check_update_gradients(engine, ref_grads, checked, bad)
    losses = []
    for i, batch in enumerate(batches(steps)):
        losses.append(engine.train_step(rows_of(env, plan, batch)).loss)
        engine._update = update
    return {"losses": losses, "ref_losses": ref_losses, "checked": checked, "bad": bad, "peak": engine.memory.peak()}


def train_runs(env, folder: str) -> dict:
    return {f"{kind}-{name}": train_and_check(env, name, folder if kind == "hf" else None)
            for kind, name in RUNS[env.world_size]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return hf_folder(str(tmp_path_factory.mktemp("qwen2-tied")))


@pytest.fixture(scope="module")
def runs(folder) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for world in RUNS:
        results = run_ranks(train_runs, world, folder)
        out.update({name: [r[name] for r in results] for name in results[0]})
    return out


@pytest.mark.parametrize("name", [f"{kind}-{plan}" for runs in RUNS.values() for kind, plan in runs])
def test_tied_pipeline_matches_single_process(runs, name):
    for r in runs[name]:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)  # the later steps: the copies stayed equal
        assert not r["bad"], r["bad"]
    checked = set().union(*(r["checked"] for r in runs[name]))
    assert set(TIED) <= checked, "both copies' gradients checked"


@functools.cache
def tied_profile(micro_batch_size: int):
    return profile_model(CFG, micro_batch_size=micro_batch_size, seq_len=SEQ, use_cache=False)


@pytest.mark.parametrize("name", [plan for runs in RUNS.values() for kind, plan in runs if kind == "decoder"])
def test_memory_model_charges_what_each_rank_holds(runs, name):
    """Each rank's tracked peak of the last step, device and host, as the memory model predicts it: the head's
    copy of the tied weight, its gradient and its optimizer states on the last stage's rank (the first's too in a
    V)."""
    plan = make_plan(name)
    pred = estimate(plan, tied_profile(plan.micro_batch_size), parse_cluster(f"{plan.world_size}xcpu"))
    for rank, r in enumerate(runs[f"decoder-{name}"]):
        for place in ("device", "host"):
            want, got = pred.tracked_by_rank[rank][f"{place}.total"], r["peak"][f"{place}.total"]
            assert got == pytest.approx(want, rel=0.05), f"rank {rank} {place}: {got} vs {want}"


# -- every plan the search returns builds and steps --

def searched_plans(world: int) -> list[Plan]:
    """The search's plans for the tied model at `world` CPU ranks (the best and its alternatives), and with two
    pipeline stages fixed where the world allows, so pipelines are among them."""
    prof = profile_model(CFG, micro_batch_size=1, seq_len=SEQ, use_cache=False)
    cluster = parse_cluster(f"{world}xcpu")
    plans = []
    for constraints in [Constraints()] + ([Constraints(pp=2)] if world > 1 else []):
        result = search(prof, cluster, global_batch=8, constraints=constraints, alternatives=3)
        plans += [result.best, *result.alternatives]
    return plans


def step_each(env, plans: list[Plan]) -> list[float]:
    """One step of each plan, from the same initial weights and batch: the global loss."""
    batch = batches(1)[0]
    out = []
    for plan in plans:
        model, weights = meta_model(None)
        engine = build_engine(model, plan, OPT, env, weights)
        out.append(engine.train_step(rows_of(env, plan, batch)).loss)
        del engine  # one pipeline engine at a time: live ones would share the gloo pairs
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_searched_plan_for_a_tied_model_builds_and_steps(world):
    plans = searched_plans(world)
    assert world == 1 or any(p.pp > 1 for p in plans)
    ref_loss = reference(None, plans[0], 1)[0][0]  # a global batch of 8 rows, whatever the split
    for rank_losses in run_ranks(step_each, world, plans):
        assert rank_losses == pytest.approx([ref_loss] * len(plans), rel=1e-5)


# -- a checkpoint resumes under another pipeline split --

PP1 = Plan.uniform(CFG.n_layers, micro_batch_size=2, num_microbatches=MICRO, seq_len=SEQ)


def save_at(env, plan: Plan, ckpt: str) -> list[float]:
    """Two steps, a checkpoint, then the next step: its loss is what a resumed run must give."""
    model, weights = meta_model(None)
    engine = build_engine(model, plan, OPT, env, weights)
    data = batches(3)
    for batch in data[:2]:
        engine.train_step(rows_of(env, plan, batch))
    dcp.save(engine.state_dict(), checkpoint_id=ckpt)
    dist.barrier()
    return [engine.train_step(rows_of(env, plan, data[2])).loss]


def resume_at(env, plan: Plan, ckpt: str) -> list[float]:
    model, weights = meta_model(None)
    engine = build_engine(model, plan, OPT, env, weights)
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    engine.load_state_dict(state)
    return [engine.train_step(rows_of(env, plan, batches(3)[2])).loss]


@pytest.mark.parametrize("saved,resumed", [("pp2", "pp1"), ("pp1", "pp2")])
def test_checkpoint_resumes_under_another_pipeline_split(tmp_path, saved, resumed):
    plans, ckpt = {"pp1": (PP1, 1), "pp2": (make_plan("pp2"), 2)}, str(tmp_path / saved)
    continued = run_ranks(save_at, plans[saved][1], plans[saved][0], ckpt)[0]
    after = run_ranks(resume_at, plans[resumed][1], plans[resumed][0], ckpt)
    for loss in after:
        assert loss == pytest.approx(continued, rel=1e-5)
    assert continued[0] == pytest.approx(reference(None, PP1, 3)[0][2], rel=1e-5)  # as the uninterrupted run
    whole = replace(PP1, shape=replace(PP1.shape, micro_batch_size=8, num_microbatches=1))
    with torch.no_grad():  # guards the comparison: untrained weights give another loss on that batch (by 1e-3)
        untrained = reference_model(None)(*split_batch(batches(3)[2], whole)[0]).item()
    assert untrained != pytest.approx(continued[0], rel=1e-4)


def test_stepping_in_backward_is_refused_before_the_copies_diverge():
    plan = make_plan("pp2", optimizer=OptimizerPlan(in_backward=True))
    with pytest.raises(PlanError, match="in_backward"):
        TiedEmbeddings.of(Decoder(CFG), plan, DistEnv())
