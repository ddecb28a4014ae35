"""LoRA on Mixture-of-Experts experts (model.lora.LoRAExpertWeight) and the trainable parameters by kind: adapters
on the 3-D expert weights of the built-in decoder and of a Hugging Face Qwen3-MoE, equal to a per-expert reference;
all-linear trains them (the router frozen unless named); the plan counts what the run trains; NF4 is refused in one
line; 2 gloo ranks (ZeRO-3, built-in and Qwen3-MoE; a recomputing pipeline) equal one process, within the memory
model; export merges them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.lora import LoRAExpertWeight, apply_lora, merged_state_dict, trainable_by_kind
from snugfit.model.moe import MoEMLP
from tests.distributed import check_update_gradients, run_ranks

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from snugfit.model.hf_model import HFCausalLM  # noqa: E402

CFG = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, n_experts=4, top_k=2, moe_ffn_dim=16)
QWEN3_MOE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.wq = torch.nn.Linear(8, 8, bias=False)
        self.mlp = MoEMLP(8, 4, 2, 8, aux_coef=0.0, shared=None)


def test_counts_by_kind_name_router_experts_and_attention():
    model = torch.nn.ModuleDict({"layer": Block()})
    counts = trainable_by_kind(model)
    assert counts == {"attention": 64, "MLP": 0, "experts": 4 * 16 * 8 + 4 * 8 * 8, "router": 4 * 8, "other": 0}
    model.layer.mlp.requires_grad_(False)
    assert trainable_by_kind(model)["experts"] == 0 and trainable_by_kind(model)["router"] == 0
    # a dense decoder's SwiGLU gate (mlp.gate) is its MLP's, not a router
    dense = Decoder(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16))
    mlp = sum(p.numel() for p in dense.blocks["0"].mlp.parameters())
    assert dense.blocks["0"].mlp.gate is not None and trainable_by_kind(dense)["router"] == 0
    assert trainable_by_kind(dense)["MLP"] == mlp


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **QWEN3_MOE))


def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {"built-in": Decoder(ModelConfig(**CFG)), "qwen3_moe": HFCausalLM(qwen3_moe())}


def _experts_reference(experts: torch.nn.Module, adapters: dict, x: torch.Tensor, chosen: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over the tokens routed to it, by plain matmuls: x W^T + scale (x A^T) B^T for both
    projections (the adapter as the activations see it), weighted and summed per token."""
    base = {n: getattr(experts, "parametrizations")[n].original for n in ("gate_up_proj", "down_proj")}

    def linear(name, h, e):
        a, b, s = adapters[name].lora_a[e], adapters[name].lora_b[e], adapters[name].scale
        return h @ base[name][e].T + s * (h @ a.T) @ b.T

    out = torch.zeros_like(x)
    for e in range(base["down_proj"].shape[0]):
        gate, up = linear("gate_up_proj", x, e).chunk(2, -1)
        y = linear("down_proj", F.silu(gate) * up, e)
        out = out + y * (weights * (chosen == e)).sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("kind, rank", [("built-in", 4), ("built-in", 2), ("qwen3_moe", 4)])
def test_expert_adapters_start_as_the_base_and_equal_a_per_expert_reference(kind, rank):
    model = models()[kind]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens)
    wrapped = apply_lora(model, rank, alpha=8, targets=["all-linear"])
    assert any(n.endswith("experts.gate_up_proj") for n in wrapped) and any(n.endswith("experts.down_proj")
                                                                            for n in wrapped)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)  # B = 0: the base's output exactly
    mlp = model.blocks["0"].mlp if kind == "built-in" else model.blocks["0"].layer.mlp
    experts = mlp.experts
    adapters = {n: experts.parametrizations[n][0] for n in ("gate_up_proj", "down_proj")}
    assert all(isinstance(a, LoRAExpertWeight) for a in adapters.values())
    with torch.no_grad():
        for a in adapters.values():
            a.lora_b.normal_(generator=torch.Generator().manual_seed(2))
    merges = []  # the merged weight W + B A made: transformers' forward reads it, the built-in's never does
    for a in adapters.values():
        a.register_forward_hook(lambda *_: merges.append(1))
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(3))
    if kind == "built-in":
        probs, chosen, weights = mlp.route(x)
        out = mlp(x)
    else:
        _, weights, chosen = mlp.gate(x)
        out = experts(x, chosen, weights)
    ref = _experts_reference(experts, adapters, x, chosen, weights.to(x.dtype))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the built-in: base and low-rank path apart where rank-wide rows fill 16 bytes (fp32 rank 4, not rank 2)
    assert len(merges) == (0 if kind == "built-in" and rank == 4 else 2)
    # merged for export: the base weight plus each expert's B A under the layer's own name
    merged = merged_state_dict(model)
    prefix = "blocks.0.mlp.experts" if kind == "built-in" else "blocks.0.layer.mlp.experts"
    a = adapters["down_proj"]
    torch.testing.assert_close(merged[f"{prefix}.down_proj"],
                               experts.parametrizations["down_proj"].original + a.scale * a.lora_b @ a.lora_a)
    assert not [k for k in merged if "lora" in k or "parametrizations" in k]


@pytest.mark.parametrize("kind", ["built-in", "qwen3_moe"])
def test_all_linear_trains_expert_adapters_and_keeps_the_base_and_router_frozen(kind):
    model = models()[kind]
    apply_lora(model, 4, targets=["all-linear"])
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any("experts.parametrizations.gate_up_proj.original" in n for n in frozen)
    assert any(n.endswith(("mlp.router.weight", "mlp.gate.weight")) for n in frozen)  # the router: not named
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(4))
    losses = []
    for step in range(6):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if step == 1:  # B has moved off zero after one step, so A has a gradient too
            grads = {n: p.grad.abs().sum().item() for n, p in model.named_parameters() if ".experts." in n
                     and p.grad is not None}
            assert len(grads) == 4 * 2 and all(g > 0 for g in grads.values()), grads  # A and B, both weights, 2 blocks
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.01
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    # naming the router trains it whole (it is never adapted)
    named = models()[kind]
    apply_lora(named, 4, targets=["router", "experts"])
    counts = trainable_by_kind(named)
    assert counts["router"] == 2 * 4 * 32 and counts["experts"] > 0 and counts["attention"] == 0


def test_peft_names_reach_the_experts():
    model = models()["qwen3_moe"]
    wrapped = apply_lora(model, 4, targets=["gate_up_proj", "down_proj"])
    assert sorted(n.rpartition(".")[2] for n in wrapped) == ["down_proj"] * 2 + ["gate_up_proj"] * 2
    assert trainable_by_kind(model)["experts"] == 2 * (4 * 4 * (32 + 32) + 4 * 4 * (16 + 32))


def test_gpt_oss_experts_stored_transposed_adapt_in_their_own_layout():
    """gpt-oss keeps its experts E x in x out (with biases and its own gate): the adapter's delta in that layout,
    transformers' forward unchanged at B = 0, and both adapters trained through it."""
    from tests.test_hf_moe import OTHERS

    torch.manual_seed(0)
    model = HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **OTHERS["gpt_oss"])))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens)
    apply_lora(model, 4, targets=["experts"])
    experts = model.blocks["0"].layer.mlp.experts
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
        adapter = experts.parametrizations["gate_up_proj"][0]
        adapter.lora_b.normal_(generator=torch.Generator().manual_seed(2))
        base = experts.parametrizations["gate_up_proj"].original  # E x in x out
        e, x = 1, torch.randn(3, base.shape[1])
        torch.testing.assert_close(x @ experts.gate_up_proj[e], x @ base[e] + adapter.scale * (x @ adapter.lora_a[e].T)
                                   @ adapter.lora_b[e].T)
    model(tokens, tokens).backward()
    assert adapter.lora_a.grad.abs().sum() > 0 and adapter.lora_b.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    qwen3_moe().save_pretrained(path)
    return path


def test_plan_counts_by_kind_what_the_run_trains(folder, tmp_path, capsys):
    from snugfit.cli import main
    from snugfit.config import build_config
    from snugfit.model.lora import trainable_summary
    from snugfit.train.build import build_model

    args = ["plan", "--model", str(folder), "--seq", "16", "--global-batch", "2", "--cluster", "1xcpu",
            "--lora-rank", "4", "--lora-targets", "all-linear", "--profile-cache", str(tmp_path / "profiles")]
    assert main(args + ["--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["model"]
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg = build_config(None, {"model.name": str(folder), "lora_rank": 4, "lora_targets": "all-linear"})
    model = build_model(cfg)
    trained = trainable_by_kind(model)
    assert planned["trainable"] == trainable_summary(model)["total"]["trainable"] == sum(trained.values())
    assert planned["trainable_by_kind"] == trained and trained["experts"] > 0 and trained["router"] == 0
    assert (f"trainable by kind: attention {trained['attention']:,}, MLP 0, experts {trained['experts']:,}, "
            "router 0, other 0") in out


def test_nf4_experts_are_refused_in_one_line(folder, tmp_path, capsys):
    from snugfit.cli import main

    rc = main(["plan", "--model", str(folder), "--seq", "16", "--global-batch", "2", "--cluster", "1xcpu",
               "--lora-rank", "4", "--quantize-base", "nf4", "--profile-cache", str(tmp_path / "profiles")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: NF4 does not quantize expert weights") and "without --quantize-base nf4" in err


def test_trained_expert_adapters_export_merged_and_transformers_reloads_them(tmp_path):
    from snugfit.train.export import export_checkpoint, load_checkpoint_model
    from snugfit.train.loop import train
    from tests.test_train import tiny

    torch.manual_seed(0)  # the byte tokenizer's vocabulary
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **{**QWEN3_MOE, "vocab_size": 256})
                                     ).save_pretrained(tmp_path / "base")
    train(tiny(tmp_path / "run", **{"model.name": str(tmp_path / "base"), "steps": 2, "seq_len": 16, "lr": 0.05,
                                    "lora_rank": 4, "lora_targets": "all-linear"}))
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    tuned = load_checkpoint_model(step).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(export_checkpoint(step, tmp_path / "exported")).eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, tuned(x), rtol=1e-5, atol=1e-5)
        experts = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(reloaded.get_parameter(experts), base.get_parameter(experts))  # adapters merged


# -- 2 gloo ranks (data parallel with ZeRO-3; a pipeline recomputing) equal one process, the built-in decoder with
# expert adapters --

SEED, STEPS = 3, 3
DIST = ModelConfig(**{**CFG, "n_shared_experts": 1})


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, DIST.vocab_size, (8, 17), generator=g) for _ in range(STEPS)]


def _hf_steps(env, folder: str, plan) -> list[float]:
    """Expert adapters on the Qwen3-MoE folder: one process over the whole batches (env None), or this rank's
    half under `plan`, the model sharded on meta and each rank reading its rows."""
    from pathlib import Path

    from snugfit.model.hf import FolderWeights, load_hf
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.optimizer import OptimConfig, make_optimizer

    optim = OptimConfig(lr=5e-2, grad_clip=1.0)  # the adapters' steps move the losses well beyond the tolerance
    model = load_hf(folder, device="cpu" if env is None else "meta", seed=SEED)
    apply_lora(model, 4, targets=["all-linear"], seed=SEED)
    batches = [b % 128 for b in _batches()]
    if env is not None:
        engine = build_engine(model, plan, optim, env, weights=FolderWeights(Path(folder), SEED))
        return [engine.train_step(b.chunk(2)[env.rank]).loss for b in batches]
    trained = [p for p in model.parameters() if p.requires_grad]
    opt, losses = make_optimizer(trained, optim, plan.optimizer), []
    for batch in batches:
        losses.append(_accumulate(model, batch, plan))
        torch.nn.utils.clip_grad_norm_(trained, optim.grad_clip)
        opt.step()
        opt.zero_grad()
    return losses


def _accumulate(model, batch: torch.Tensor, plan) -> float:
    """One process's step before its update: `batch` split as two dp ranks and their microbatches would, each
    microbatch's share of the loss backpropagated; the step's loss."""
    from snugfit.model.moe import begin_step
    from snugfit.runtime.microbatches import split_batch

    micro = [mb for rows in batch.chunk(2) for mb in split_batch(rows, plan)]
    begin_step(model, 1.0 / len(micro), 1.0)
    total = 0.0
    for mb in micro:
        loss = model(*mb) / len(micro)
        loss.backward()
        total += loss.item()
    return total


def _two_ranks(env, folder: str) -> dict:
    from snugfit.plan import BlockPlan, Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.optimizer import OptimConfig, make_optimizer
    from snugfit.train.build import InitWeights

    optim = OptimConfig(lr=1e-2, grad_clip=1.0)
    plan = Plan.uniform(DIST.n_layers, dp=2, block=BlockPlan(zero=3), micro_batch_size=2, num_microbatches=2,
                        seq_len=16)
    ref = Decoder(DIST)
    ref.init_weights(SEED)
    apply_lora(ref, 4, targets=["all-linear"], seed=SEED)
    opt = make_optimizer([p for p in ref.parameters() if p.requires_grad], optim, plan.optimizer)
    ref_losses, first = [], None
    for batch in _batches():
        ref_losses.append(_accumulate(ref, batch, plan))
        first = first or {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], optim.grad_clip)
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        model = Decoder(DIST)
    apply_lora(model, 4, targets=["all-linear"], seed=SEED)
    engine = build_engine(model, plan, optim, env, InitWeights(SEED))
    checked, bad = [], []
    update = check_update_gradients(engine, first, checked, bad)
    losses = []
    for batch in _batches():
        losses.append(engine.train_step(batch.chunk(2)[env.rank]).loss)
        engine._update = update
    peak = engine.memory.peak()
    # a pipeline of 2 stages, one block each, recomputing, over the whole batch (the same 4 microbatches)
    with torch.device("meta"):
        model = Decoder(DIST)
    apply_lora(model, 4, targets=["all-linear"], seed=SEED)
    piped_plan = Plan.uniform(DIST.n_layers, pp=2, schedule="1f1b", block=BlockPlan(activations="recompute"),
                              micro_batch_size=2, num_microbatches=4, seq_len=16)
    engine = build_engine(model, piped_plan, optim, env, InitWeights(SEED))
    piped = [engine.train_step(batch).loss for batch in _batches()]
    return {"losses": losses, "ref": ref_losses, "checked": checked, "bad": bad, "peak": peak,
            "plan": plan.to_dict(), "piped": piped, "hf": _hf_steps(env, folder, plan), "hf_ref": _hf_steps(
                None, folder, plan) if env.rank == 0 else None}


def test_expert_adapters_at_two_ranks_equal_one_process(folder):
    from snugfit.hardware import parse_cluster
    from snugfit.plan import Plan
    from snugfit.plan.estimate import estimate
    from snugfit.profile import profile_model

    results = run_ranks(_two_ranks, 2, str(folder))
    # the Qwen3-MoE folder's experts, adapted through transformers' own forward (the merged weight), under ZeRO-3
    assert results[0]["hf"] == results[1]["hf"] == pytest.approx(results[0]["hf_ref"], rel=1e-5)
    # the memory model's peak per rank, from a profile that counts the expert adapters as trainable
    plan = Plan.from_dict(results[0]["plan"])
    prof = profile_model(DIST, micro_batch_size=2, seq_len=16, use_cache=False, lora_rank=4, lora_targets="all-linear")
    assert sum(p.num_trainable for p in prof.pieces) == sum(prof.trainable_by_kind.values())
    assert prof.trainable_by_kind["experts"] == 2 * 4 * 4 * (32 + 32 + 16 + 32)  # 2 blocks, 4 experts, rank 4: A, B
    pred = estimate(plan, prof, parse_cluster("2xcpu"))
    for rank, r in enumerate(results):
        want, got = pred.tracked_by_rank[rank]["device.total"], r["peak"]["device.total"]
        assert got == pytest.approx(want, rel=0.05), f"rank {rank}: {got} vs {want}"
    for r in results:
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5)
        assert r["piped"] == pytest.approx(r["ref"], rel=1e-5)
        assert not r["bad"], r["bad"]
        assert {"blocks.0.mlp.experts.parametrizations.gate_up_proj.0.lora_b",
                "blocks.1.mlp.experts.parametrizations.down_proj.0.lora_b"} <= set(r["checked"])
        assert not [n for n in r["checked"] if n.endswith("original")]  # the experts' base: no gradient
