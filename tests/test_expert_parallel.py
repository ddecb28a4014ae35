"""Expert parallelism (runtime.expert_parallel): the built-in MoE decoder trained with its experts split over ep
ranks equals one process in losses, aux losses and gradients (each rank's expert shard against the reference's
slice) at 2 and 4 gloo ranks, ep 2 and 4, with ZeRO-3 and recomputation; the ep groups are plan.RankLayout's; a
checkpoint saved at ep 2 resumes at ep 1 and one saved at ep 1 resumes at ep 2, with the same next-step loss. With
LoRA on every linear and expert weight the experts' adapters split as their weights: the same, and the Qwen3-MoE
folder's adapters at ep 2 equal one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from snugfit.model.decoder import Decoder
from snugfit.plan import BlockPlan, Plan, PlanError
from snugfit.plan.facts import ModelFacts
from snugfit.plan.rules import parts_of, problem
from snugfit.plan.shape import RankLayout, Shape
from snugfit.runtime.build import build_engine
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.optimizer import OptimConfig
from snugfit.train.build import InitWeights
from tests.distributed import check_update_gradients, run_ranks
from tests.test_moe import DIST, MICRO, SEED, SEQ, batches, reference

OPT = OptimConfig(lr=1e-2, grad_clip=0.05)  # small enough that every step clips: the norm must be right
PLANS = {  # name -> Plan.uniform arguments
    "dp2-ep2": dict(dp=2, ep=2),
    "dp2-ep2-zero3-recompute": dict(dp=2, ep=2, block=BlockPlan(zero=3, activations="recompute")),
    "dp2-ep2-zero0": dict(dp=2, ep=2, block=BlockPlan(zero=0)),
    "dp4-ep2-zero3": dict(dp=4, ep=2, block=BlockPlan(zero=3)),
    "dp4-ep2-zero0": dict(dp=4, ep=2, block=BlockPlan(zero=0)),
    "dp4-ep4": dict(dp=4, ep=4),
    "pp2xdp2-ep2-zero3": dict(pp=2, dp=2, ep=2, schedule="1f1b", block=BlockPlan(zero=3)),
    # LoRA on every linear and expert weight (the routers frozen): the experts' adapters split as their weights
    "dp2-ep2-lora": dict(dp=2, ep=2),
    "dp4-ep2-zero3-lora": dict(dp=4, ep=2, block=BlockPlan(zero=3)),
    "dp4-ep4-lora": dict(dp=4, ep=4),
}
RUNS = {2: ["dp2-ep2", "dp2-ep2-zero3-recompute", "dp2-ep2-zero0", "dp2-ep2-lora"],
        4: ["dp4-ep2-zero3", "dp4-ep2-zero0", "dp4-ep4", "pp2xdp2-ep2-zero3", "dp4-ep2-zero3-lora", "dp4-ep4-lora"]}
LORA_RANK = 4


def adapt(model) -> None:
    """The LoRA runs' adapters (name ending -lora): all-linear, experts included, drawn from the runs' seed."""
    from snugfit.model.lora import apply_lora

    apply_lora(model, LORA_RANK, targets=["all-linear"], seed=SEED)


def base_expert(experts) -> torch.Tensor:
    """An experts module's gate_up_proj as held (its frozen base where LoRA adapts it)."""
    if hasattr(experts, "parametrizations"):
        return experts.parametrizations.gate_up_proj.original
    return experts.gate_up_proj


# -- the dispatcher alone: equal to every expert on one rank, also when a rank receives no token --

def dispatch_equals_local(env) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from snugfit.model.moe import MoEMLP
    from snugfit.runtime.expert_parallel import shard_experts

    torch.manual_seed(0)
    mlp = MoEMLP(32, 4, 2, 16, aux_coef=0.0, shared=None)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():  # experts 0 and 1 (rank 0's) win every token: rank 1 receives none
        mlp.router.weight[:, 0] = torch.tensor([5.0, 4.0, -5.0, -5.0])
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(env.rank))
    x[:, 0] = 3.0
    full = {n: p.detach().clone() for n, p in mlp.experts.named_parameters()}
    ref = mlp(x)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in mlp.experts.named_parameters()}
    for g in ref_grads.values():  # the experts' gradient over both ranks' tokens
        torch.distributed.all_reduce(g)
    mlp.zero_grad()
    shard_experts(mlp, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    out = mlp(x)
    out.square().sum().backward()
    held = {n: p.to_local() for n, p in mlp.experts.named_parameters()}
    rows = slice(2 * env.rank, 2 * env.rank + 2)
    return {"out": (out - ref).abs().max().item(), "counts": mlp.route(x)[1].flatten().bincount(minlength=4).tolist(),
            "scale": max(g.abs().max().item() for g in ref_grads.values()),
            "weights": max((held[n] - full[n][rows]).abs().max().item() for n in held),
            "grads": max((p.grad.to_local() - ref_grads[n][rows]).abs().max().item()
                         for n, p in mlp.experts.named_parameters()),
            "rank1_grad": max(p.grad.to_local().abs().max().item() for p in mlp.experts.parameters()) if env.rank else None}


def test_dispatch_equals_every_expert_on_one_rank():
    results = run_ranks(dispatch_equals_local, 2)
    for r in results:
        assert r["counts"][2:] == [0, 0]  # rank 1's experts are chosen by no token
        assert r["out"] < 1e-5 and r["weights"] == 0 and r["grads"] < 1e-6 * r["scale"], r
    assert results[1]["rank1_grad"] == 0, results  # rank 1's experts got no copy, and ran


def make_plan(spec: dict) -> Plan:
    rows = 8 // spec.get("dp", 1)
    return Plan.uniform(DIST.n_layers, micro_batch_size=rows // MICRO, num_microbatches=MICRO, seq_len=SEQ, **spec)


def engine_of(env, plan: Plan, lora: bool = False):
    with torch.device("meta"):
        model = Decoder(DIST)
    if lora:
        adapt(model)
    return build_engine(model, plan, OPT, env, InitWeights(SEED))


def my_rows(plan: Plan, batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch.chunk(plan.dp)[plan.layout.coords(rank)[1]]


def train_and_check(env, name: str, steps: int = 2) -> dict:
    plan, lora = make_plan(PLANS[name]), name.endswith("-lora")
    ref_losses, ref_aux, ref_grads, ref_norm = reference_with_norm(plan, steps, lora)
    engine = engine_of(env, plan, lora)
    dims = ParallelDims.of(plan, env)
    groups = None if plan.ep == 1 else (sorted(dims.ep_mesh.mesh.flatten().tolist()), sorted(dims.expert_shard.mesh.flatten().tolist()),
              plan.layout.ep_group(env.rank), plan.layout.expert_shard_group(env.rank))
    checked, bad = [], []
    update = check_update_gradients(engine, ref_grads, checked, bad)
    losses, auxes, norms = [], [], []
    for batch in batches(steps):
        result = engine.train_step(my_rows(plan, batch, env.rank))
        losses.append(result.loss)
        auxes.append(result.aux_loss)
        norms.append(result.grad_norm)
        engine._update = update
    local = base_expert(next(iter(engine.model.blocks.values())).mlp.experts).to_local().shape[0]
    return {"losses": losses, "ref_losses": ref_losses, "aux": auxes, "ref_aux": ref_aux, "norms": norms,
            "ref_norm": ref_norm, "checked": checked, "bad": bad, "groups": groups, "local_rows": local,
            "peak": balanced_peak(env, plan, lora) if name in MEMORY + LORA_MEMORY else None}


MEMORY = ["dp2-ep2-zero0", "dp2-ep2-zero3-recompute", "dp4-ep2-zero3", "dp4-ep4"]  # test_memory_model_...
LORA_MEMORY = ["dp2-ep2-lora", "dp4-ep4-lora"]  # test_memory_model_holds_each_rank_its_experts


def balanced_peak(env, plan: Plan, lora: bool = False) -> dict:
    """The tracked peak of a step under balanced routing (model.moe.set_balanced), which the planner prices: each
    rank's experts then receive as many copies as it sends."""
    from snugfit.model.moe import set_balanced

    engine = engine_of(env, plan, lora)
    set_balanced(engine.model)
    engine.train_step(my_rows(plan, batches(1)[0], env.rank))
    return engine.memory.peak()


def reference_with_norm(plan: Plan, steps: int, lora: bool = False):
    """test_moe's one-process reference, and its first step's gradient norm (before clipping)."""
    losses, auxes, first = reference(plan, steps, OPT, adapt if lora else None)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in first.values()])).item()
    return losses, auxes, first, norm


def train_runs(env) -> dict:
    return {name: train_and_check(env, name) for name in RUNS[env.world_size]}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for world in RUNS:
        results = run_ranks(train_runs, world)
        out.update({name: [r[name] for r in results] for name in results[0]})
    return out


@pytest.mark.parametrize("name", [n for names in RUNS.values() for n in names])
def test_expert_parallel_matches_single_process(runs, name):
    ep = PLANS[name]["ep"]
    for r in runs[name]:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)
        assert r["norms"][0] == pytest.approx(r["ref_norm"], rel=1e-5)  # each expert counted once
        assert not r["bad"], r["bad"]
        ep_ranks, shard_ranks, want_ep, want_shard = r["groups"]
        assert (ep_ranks, shard_ranks) == (want_ep, want_shard)  # the mesh is plan.RankLayout's
        # E/ep experts per rank, then FSDP2's share of them (zero 0: all of them)
        zero = PLANS[name].get("block", BlockPlan()).zero
        assert r["local_rows"] == DIST.n_experts // ep // (1 if zero == 0 else len(want_shard))
    checked = set().union(*(r["checked"] for r in runs[name]))
    if name.endswith("-lora"):  # each rank's experts' adapters, its E/ep of them; no base nor router trained
        adapters = {f"blocks.1.mlp.experts.parametrizations.{w}.0.lora_{ab}" for w in ("gate_up_proj", "down_proj")
                    for ab in "ab"}
        assert adapters | {"blocks.0.attn.q.lora_b"} <= checked, checked
        assert not [n for n in checked if n.endswith("original") or "router" in n], checked
        return
    assert {"blocks.0.mlp.router.weight", "blocks.1.mlp.router.weight", "blocks.1.mlp.experts.gate_up_proj",
            "blocks.1.mlp.experts.down_proj"} <= checked


def _predicted(name: str) -> dict:
    from snugfit.hardware import parse_cluster
    from snugfit.plan.estimate import estimate
    from snugfit.profile import profile_model

    plan = make_plan(PLANS[name])
    lora = dict(lora_rank=LORA_RANK, lora_targets="all-linear") if name.endswith("-lora") else {}
    prof = profile_model(DIST, micro_batch_size=plan.micro_batch_size, seq_len=SEQ, use_cache=False, **lora)
    return estimate(plan, prof, parse_cluster(f"{plan.world_size}xcpu")).tracked_by_rank


@pytest.mark.parametrize("name", MEMORY + LORA_MEMORY)
def test_memory_model_holds_each_rank_its_experts(runs, name):
    """Each rank's parameters and optimizer states as the memory model predicts: its E/ep experts' (then FSDP2's
    share of them) beside the dense weights' shard (plan.piece_memory.ep_parts); under LoRA its experts' frozen
    base and their adapters' E/ep (then FSDP2's share)."""
    pred = _predicted(name)
    for rank, r in enumerate(runs[name]):
        for kind in ("device.parameters", "device.optimizer"):
            assert r["peak"][kind] == pytest.approx(pred[rank][kind], rel=0.01), (rank, kind)


@pytest.mark.parametrize("name", MEMORY)
def test_memory_model_peak_per_rank(runs, name):
    """The tracked peak of each rank within 5% of the memory model's (zero 3: the running block's copy whole and
    what FSDP2 prefetches of the next, its own unit, not its experts': piece_memory.prefetched_part)."""
    pred = _predicted(name)
    for rank, r in enumerate(runs[name]):
        assert r["peak"]["device.total"] == pytest.approx(pred[rank]["device.total"], rel=0.05), rank


def test_rank_layout_ep_groups():
    layout = RankLayout(pp=2, dp=4, ep=2)
    assert layout.ep_group(5) == [4, 5] and layout.expert_shard_group(5) == [5, 7]
    assert layout.ep_group(2) == [2, 3] and layout.expert_shard_group(2) == [0, 2]


# -- the rules: what the model and the layout must have for ep, named in one line before ranks start --

def _problem(ep: int, n_experts: int) -> str | None:
    return problem(parts_of(Shape(ep=ep, dp=6), model=ModelFacts(n_experts=n_experts, top_k=min(2, n_experts))))


def test_ep_on_a_dense_model_is_refused_in_one_line():
    message = _problem(2, 0)
    assert "this model is dense; use ep 1" in message and "\n" not in message


def test_ep_that_does_not_divide_the_experts_is_refused_in_one_line():
    message = _problem(3, 8)
    assert "ep 3 does not divide the model's 8 experts" in message and "\n" not in message


def test_an_ep_that_fits_the_model_is_allowed():
    assert _problem(2, 8) is None and _problem(1, 8) is None and _problem(1, 0) is None


def test_ep_that_does_not_divide_the_data_parallel_ranks_is_refused_in_one_line():
    message = problem(parts_of(Shape(ep=4, dp=2, cp=3)))
    assert "ep 4 does not divide the dp x cp ranks (2 x 3)" in message and "\n" not in message
    with pytest.raises(PlanError, match="does not divide the dp x cp"):
        Plan.uniform(2, dp=2, ep=4, seq_len=SEQ).validate(n_blocks=2, world_size=2)


# -- checkpoints across ep --

def resume_across_ep(env, root: str, lora: bool) -> dict:
    """Train a step under plan a, save, train the next step; then build plan b, load, train the same next step
    (with LoRA: the adapters, the experts' ones split over ep, are what the step trained)."""
    out = {}
    for a, b in (("ep2", "ep1"), ("ep1", "ep2")):
        plans = {"ep2": make_plan(dict(dp=2, ep=2, block=BlockPlan(zero=3))), "ep1": make_plan(dict(dp=2))}
        first, second = batches(2)
        engine = engine_of(env, plans[a], lora)
        engine.train_step(my_rows(plans[a], first, env.rank))
        path = f"{root}/{a}"
        dcp.save(engine.state_dict(), checkpoint_id=path)
        went_on = engine.train_step(my_rows(plans[a], second, env.rank)).loss
        resumed = engine_of(env, plans[b], lora)
        state = resumed.state_dict()
        dcp.load(state, checkpoint_id=path)
        resumed.load_state_dict(state)
        out[f"{a}->{b}"] = (went_on, resumed.train_step(my_rows(plans[b], second, env.rank)).loss)
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_checkpoint_resumes_under_another_ep(tmp_path, lora):
    for r in run_ranks(resume_across_ep, 2, str(tmp_path), lora):
        for key, (went_on, resumed) in r.items():
            assert resumed == pytest.approx(went_on, rel=1e-5), key


def test_ep_on_hugging_face_experts_is_refused_in_one_line():
    facts = ModelFacts(n_experts=8, top_k=2, attention="gpt_oss", expert_splits=False)
    message = problem(parts_of(Shape(ep=2, dp=2), model=facts))
    assert "not gpt_oss's Hugging Face ones yet; use ep 1" in message and "\n" not in message


def test_ep_with_adapters_is_allowed():
    assert problem(parts_of(Shape(ep=2, dp=2), model=ModelFacts(n_experts=8, top_k=2, adapters=True))) is None


# -- the CLI: --ep reaches the plan, and a bad one is one line before any rank --

TINY_MOE = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-experts", "4", "--moe-ffn-dim", "16",
            "--vocab-size", "64", "--seq", "16", "--global-batch", "4"]


def test_plan_takes_ep(capsys):
    import json

    from snugfit.cli import main

    assert main(["plan", *TINY_MOE, "--cluster", "2xcpu", "--ep", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["ep"] == 2 and plan["predicted"]["time_by_phase"]["ep_comm"] > 0  # the all-to-alls
    assert main(["plan", *TINY_MOE, "--cluster", "2xcpu", "--ep", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ep 4 does not divide the 2 ranks" in err[0], err


def test_the_search_weighs_the_ep_degrees_the_experts_allow():
    from snugfit.plan.candidates import ep_degrees
    from snugfit.plan.options import Constraints
    from snugfit.profile import profile_model

    prof = profile_model(DIST, micro_batch_size=1, seq_len=SEQ, use_cache=False)
    assert ep_degrees(prof, 8, Constraints()) == [1, 2, 4]  # 8 does not divide the 4 experts
    assert ep_degrees(prof, 6, Constraints()) == [1, 2]
    assert ep_degrees(prof, 4, Constraints(ep=2)) == [2]
    dense = profile_model(replace(DIST, n_experts=0), micro_batch_size=1, seq_len=SEQ, use_cache=False)
    assert ep_degrees(dense, 4, Constraints()) == [1]


def test_a_hugging_face_moe_model_is_refused_ep_before_any_rank():
    """The launch's own facts (runtime.tensor_parallel.model_facts) name a Hugging Face model's experts and whether
    ep runs them (transformers' fused SwiGLU experts of plan.facts.EXPERT_PARALLEL_HF), so build_engine refuses
    the others (gpt-oss: biases, a clamped SwiGLU) as the planner does."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from snugfit.model.hf_model import HFCausalLM
    from snugfit.runtime.tensor_parallel import model_facts
    from tests.test_hf_moe import OTHERS, hf_moe

    facts = model_facts(HFCausalLM(hf_moe("qwen3_moe")))
    assert (facts.n_experts, facts.top_k, facts.expert_splits) == (4, 2, True)
    gpt_oss = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **OTHERS["gpt_oss"]))
    facts = model_facts(HFCausalLM(gpt_oss))
    assert facts.n_experts == 4 and not facts.expert_splits
    assert "Hugging Face ones yet; use ep 1" in Plan.uniform(2, dp=2, ep=2, seq_len=SEQ).rule_broken(facts)
    assert model_facts(Decoder(DIST)).expert_splits


# -- Hugging Face experts (transformers 5's fused 3-D experts) through the same dispatcher --

HF_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_dispatched_hugging_face_experts_equal_transformers(arch):
    pytest.importorskip("transformers")
    from snugfit.model.hf_model import HFCausalLM
    from snugfit.runtime.expert_parallel import DispatchedExperts, hf_experts
    from tests.test_hf_moe import hf_moe

    model = HFCausalLM(hf_moe(arch))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(tokens, tokens)
    found = hf_experts(model)
    assert len(found) == len(model.blocks)
    for parent, name in found:
        setattr(parent, name, DispatchedExperts(getattr(parent, name)))
    assert model(tokens, tokens).item() == pytest.approx(ref.item(), rel=1e-6)


def _hf_ep_ranks(env, folder: str) -> dict:
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    from snugfit.model.hf import FolderWeights, load_hf
    from tests.test_hf_moe import MBS as HF_MBS, NMB, SEQ as HF_SEQ, _batches, _one_process

    optim = OptimConfig(lr=1e-2, grad_clip=0.5)
    model = load_hf(folder, device="meta")
    plan = Plan.uniform(2, dp=2, ep=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3), micro_batch_size=HF_MBS,
                        num_microbatches=NMB, seq_len=HF_SEQ)
    engine = build_engine(model, plan, optim, env, weights=FolderWeights(Path(folder)))
    rows = HF_MBS * NMB
    losses = [engine.train_step(b[env.rank * rows:(env.rank + 1) * rows]).loss for b in _batches()]
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
             for k, v in model.state_dict().items()}
    held = model.blocks["0"].layer.mlp.experts.gate_up_proj.to_local().shape[0]
    return {"losses": losses, "state": state, "held": held,
            "ref": _one_process(folder, optim) if env.rank == 0 else None}


def test_hugging_face_qwen3_moe_at_ep_2_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_hf_moe import hf_moe, write

    write(hf_moe("qwen3_moe"), tmp_path / "base", "per-expert")
    results = run_ranks(_hf_ep_ranks, 2, str(tmp_path / "base"))
    ref_losses, ref_state = results[0]["ref"]
    assert results[0]["held"] == 2  # 4 experts over ep 2, then ZeRO-3 over the one rank holding the same ones
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # equal weights after two AdamW steps: equal gradients (AdamW divides a tiny gradient's float-order noise by
    # its own size: 2 of 4096 expert weights moved 2.6e-6 apart, a 4000th of a step of lr 1e-2)
    for name, t in results[0]["state"].items():
        torch.testing.assert_close(torch.from_numpy(t), torch.from_numpy(ref_state[name]), rtol=1e-5, atol=1e-5,
                                   msg=name)


def _hf_lora_ep_ranks(env, folder: str) -> dict:
    from tests.test_moe_lora import _hf_steps

    plan = Plan.uniform(2, dp=2, ep=2, block=BlockPlan(zero=3), micro_batch_size=2, num_microbatches=2, seq_len=16)
    return {"losses": _hf_steps(env, folder, plan), "ref": _hf_steps(None, folder, plan) if env.rank == 0 else None}


def test_hugging_face_qwen3_moe_expert_adapters_at_ep_2_match_one_process(tmp_path):
    """LoRA on every linear and expert weight of the Qwen3-MoE folder (test_moe_lora's three steps, whose adapters'
    updates move the losses well beyond the tolerance), the experts and their adapters split over ep 2."""
    pytest.importorskip("transformers")
    from tests.test_moe_lora import qwen3_moe

    qwen3_moe().save_pretrained(tmp_path)
    results = run_ranks(_hf_lora_ep_ranks, 2, str(tmp_path))
    for r in results:
        assert r["losses"] == pytest.approx(results[0]["ref"], rel=1e-5)
