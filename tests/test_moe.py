"""The built-in Mixture-of-Experts MLP (model.moe): equal to a per-expert loop in forward and gradients, its aux loss
the hand-computed value with its gradient reaching the router, and the decoder with experts trained equal to one
process at 2 and 4 gloo ranks, context parallelism included (each cp rank routes its chunk of the sequences; the
aux loss counts the experts' tokens over the cp group)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.moe import MoEMLP, begin_step, step_aux_loss
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.profile import profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.microbatches import split_batch
from snugfit.runtime.optimizer import OptimConfig, make_optimizer
from snugfit.train.build import InitWeights
from tests.distributed import check_update_gradients, run_ranks

CFG = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, n_experts=4, top_k=2, moe_ffn_dim=16)


def _reference(mlp: MoEMLP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-expert loop over each token's top-k experts, and the aux loss written out."""
    probs = (x @ mlp.router.weight.T).softmax(-1)
    top, idx = probs.topk(mlp.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(mlp.n_experts):
        gate, up = (x @ mlp.experts.gate_up_proj[e].T).chunk(2, -1)
        y = (F.silu(gate) * up) @ mlp.experts.down_proj[e].T
        out = out + y * (top * (idx == e)).sum(-1, keepdim=True)
    frac = torch.stack([(idx == e).sum() for e in range(mlp.n_experts)]).float() / idx.numel()
    return out, mlp.aux_coef * mlp.n_experts * (frac * probs.mean(0)).sum()


def test_moe_mlp_equals_a_per_expert_loop_and_its_aux_loss_reaches_the_router():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**CFG, n_shared_experts=1))
    mlp = model.blocks["0"].mlp
    x = torch.randn(3, 8, 32)
    g = torch.randn(3, 8, 32)
    out = mlp(x)
    (out * g).sum().backward()  # backward adds the aux loss's gradient
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad()
    ref, aux = _reference(mlp, x.reshape(-1, 32))
    ref = ref + mlp.shared(x.reshape(-1, 32))
    torch.testing.assert_close(out.reshape(-1, 32), ref, rtol=1e-5, atol=1e-6)
    # the same upstream gradient as above, plus the aux loss's
    ((ref.reshape(out.shape) * g).sum() + aux).backward()
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert mlp.router.weight.grad.abs().sum() > 0
    # the aux value by hand: 1 at balanced routing, times the layer's coefficient share
    assert abs(aux.item() / (0.01 / 2) - 1) < 0.5
    assert mlp._aux_sum is not None and torch.allclose(mlp._aux_sum, aux.detach())


def test_aux_loss_is_hand_computed():
    mlp = MoEMLP(8, 4, 2, 8, aux_coef=0.5, shared=None)
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    counts = torch.tensor([1, 1, 1, 1])  # each expert got one of the four (token, slot) pairs
    # E * sum_e f_e P_e = 4 * (0.25 * 0.25 * 4) = 1
    assert abs(mlp.aux_loss(probs, counts).item() - 0.5 * 1.0) < 1e-6
    counts = torch.tensor([2, 2, 0, 0])
    assert abs(mlp.aux_loss(probs, counts).item() - 0.5 * 4 * (0.5 * 0.25 + 0.5 * 0.25)) < 1e-6


def test_step_weights_and_reports_the_aux_loss():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**CFG))
    tokens = torch.randint(0, 64, (2, 16))
    begin_step(model, 0.5, 1.0)
    for half in tokens.split(1):
        model(half, half).backward()
    aux = step_aux_loss(model)
    assert aux is not None and 0 < aux.item() < 0.05  # about router_aux_coef (0.01) at near-balanced routing
    assert model.cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert model.cfg.num_params(active=True) < model.cfg.num_params()


# -- the decoder with experts trains equal to one process: ZeRO-3, recomputation, a pipeline, pp x dp --

SEQ, MICRO, SEED = 16, 2, 3
DIST = ModelConfig(**{**CFG, "max_seq_len": SEQ, "n_shared_experts": 1})
OPT = OptimConfig(lr=1e-2, grad_clip=1.0)
PLANS = {  # name -> Plan.uniform arguments
    "dp2-zero3": dict(dp=2, block=BlockPlan(zero=3)),
    "dp2-recompute": dict(dp=2, block=BlockPlan(activations="recompute")),
    "pp2": dict(pp=2, schedule="1f1b"),  # the first stage's routers get their aux gradient without a loss there
    "pp2xdp2-zero3": dict(pp=2, dp=2, schedule="1f1b", block=BlockPlan(zero=3)),
    "cp2-zero3": dict(cp=2, block=BlockPlan(zero=3)),
    "ep2xcp2": dict(cp=2, ep=2),  # the expert groups within the cp ranks: the experts split over the sequence's
    "dp2xcp2-recompute": dict(dp=2, cp=2, block=BlockPlan(zero=3, activations="recompute")),
}
RUNS = {2: ["dp2-zero3", "dp2-recompute", "pp2", "cp2-zero3", "ep2xcp2"], 4: ["pp2xdp2-zero3", "dp2xcp2-recompute"]}


def make_plan(name: str) -> Plan:
    spec = PLANS[name]
    rows = 8 // spec.get("dp", 1)
    return Plan.uniform(DIST.n_layers, micro_batch_size=rows // MICRO, num_microbatches=MICRO, seq_len=SEQ, **spec)


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, DIST.vocab_size, (8, SEQ + 1), generator=g) for _ in range(steps)]


def reference(plan: Plan, steps: int, opt_cfg: OptimConfig = OPT, adapt=None
              ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process over every rank's microbatches: losses, aux losses, the first step's (trained) gradients.
    adapt: called on the model after its init (LoRA)."""
    model = Decoder(DIST)
    model.init_weights(SEED)
    if adapt is not None:
        adapt(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trained, opt_cfg, plan.optimizer)
    losses, auxes, first = [], [], None
    for batch in batches(steps):
        micro = [mb for rows in batch.chunk(plan.dp) for mb in split_batch(rows, replace(plan, shape=replace(plan.shape, cp=1)))]
        begin_step(model, 1.0 / len(micro), 1.0)
        total = 0.0
        for mb in micro:
            loss = model(*mb) / len(micro)
            loss.backward()
            total += loss.item()
        losses.append(total)
        auxes.append(step_aux_loss(model).item())
        first = first or {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(trained, opt_cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return losses, auxes, first


def train_and_check(env, name: str, steps: int = 2) -> dict:
    plan = make_plan(name)
    ref_losses, ref_aux, ref_grads = reference(plan, steps)
    with torch.device("meta"):
        model = Decoder(DIST)
    engine = build_engine(model, plan, OPT, env, InitWeights(SEED))
    checked, bad = [], []
    update = check_update_gradients(engine, ref_grads, checked, bad)
    losses, auxes = [], []
    for batch in batches(steps):
        result = engine.train_step(batch.chunk(plan.dp)[plan.layout.coords(env.rank)[1]])
        losses.append(result.loss)
        auxes.append(result.aux_loss)
        engine._update = update
    return {"losses": losses, "ref_losses": ref_losses, "aux": auxes, "ref_aux": ref_aux, "checked": checked,
            "bad": bad, "peak": engine.memory.peak()}


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
def test_moe_decoder_matches_single_process(runs, name):
    for r in runs[name]:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        # summed over stages, averaged over dp; pipelining's shape-inference forward not counted
        assert r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)
        assert not r["bad"], r["bad"]
    checked = set().union(*(r["checked"] for r in runs[name]))
    assert {"blocks.0.mlp.router.weight", "blocks.1.mlp.experts.gate_up_proj"} <= checked


def test_memory_model_charges_the_experts(runs):
    """The tracked peak of each rank under ZeRO-3 as the memory model predicts (every expert's parameters,
    gradients and states; the dispatch buffers in the block's working peak)."""
    plan = make_plan("dp2-zero3")
    prof = profile_model(DIST, micro_batch_size=plan.micro_batch_size, seq_len=SEQ, use_cache=False)
    pred = estimate(plan, prof, parse_cluster("2xcpu"))
    for rank, r in enumerate(runs["dp2-zero3"]):
        want, got = pred.tracked_by_rank[rank]["device.total"], r["peak"]["device.total"]
        assert got == pytest.approx(want, rel=0.05), f"rank {rank}: {got} vs {want}"


# -- the planner: total against active parameters --

@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9), ("olmoe-1b-7b", 6.9e9, 1.3e9)])
def test_catalogue_moe_sizes(name, total, active):
    from snugfit.model.catalogue import MODELS

    cfg = MODELS[name]
    assert cfg.num_params() == pytest.approx(total, rel=0.02)
    assert cfg.num_params(active=True) == pytest.approx(active, rel=0.02)


def test_profile_counts_every_expert_and_computes_the_active_ones():
    """Memory counts all experts' parameters; the profiled FLOPs are those of the top_k experts (and the router):
    an MoE model's blocks compute about what a dense model of the active width does."""
    moe = ModelConfig(**{**CFG, "max_seq_len": SEQ})
    dense = ModelConfig(**{k: v for k, v in CFG.items() if k not in ("n_experts", "top_k", "moe_ffn_dim", "max_seq_len")},
                        max_seq_len=SEQ, ffn_dim=2 * 16)  # top_k experts' width
    p_moe, p_dense = (profile_model(c, micro_batch_size=2, seq_len=SEQ, use_cache=False) for c in (moe, dense))
    assert p_moe.num_params() == moe.num_params() == sum(p.numel() for p in Decoder(moe).parameters())
    block_moe, block_dense = p_moe.blocks[0], p_dense.blocks[0]
    matmuls = lambda p: sum(2 * m * n * k for m, n, k in p.gemms)  # noqa: E731
    assert matmuls(block_moe) == pytest.approx(matmuls(block_dense) + 2 * 2 * SEQ * 32 * 4, rel=1e-6)  # + router
    assert len(block_moe.gemms) == len(block_dense.gemms) + 1 + 2 * 4 - 3  # q k v o, router, E x (gate_up, down)
    assert block_moe.fwd_flops == pytest.approx(block_dense.fwd_flops, rel=0.05)
    assert moe.flops_per_token(SEQ) == pytest.approx(dense.flops_per_token(SEQ), rel=0.05)


def test_plan_summary_gives_active_parameters():
    cfg = ModelConfig(**{**CFG, "max_seq_len": SEQ})
    summary = profile_model(cfg, micro_batch_size=1, seq_len=SEQ, use_cache=False).summary()
    assert summary["parameters"] == cfg.num_params() and summary["active"] == cfg.num_params(active=True)
