"""Hugging Face Mixture-of-Experts folders (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE with its shared expert): loaded
from both checkpoint layouts, equal to transformers' own forward; planned; exported as transformers saves them;
trained at 2 gloo ranks (ZeRO-3, each rank reading its experts' rows; a 2-stage pipeline) equal to one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from snugfit.errors import SnugfitError  # noqa: E402
from snugfit.model.hf import FolderWeights, load_hf, save_hf  # noqa: E402
from snugfit.model.hf_layout import checkpoint_layout, read_region  # noqa: E402
from snugfit.model.hf_model import HFCausalLM  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.test_hf import LLAMA, tokens  # noqa: E402

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "mixtral": {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**LLAMA, **MOE, "num_experts": 4, "head_dim": 8},
    "olmoe": {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 0, "pad_token_id": 0},
    "qwen2_moe": {**LLAMA, **MOE, "num_experts": 4, "shared_expert_intermediate_size": 48},
}


def hf_moe(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIGS[arch])).eval()


def per_expert(hf) -> dict[str, torch.Tensor]:
    """The hub's layout, written by hand from the fused state dict: one matrix per expert (Mixtral's
    block_sparse_moe.experts.e.w1/w3/w2, the others' mlp.experts.e.gate_proj/up_proj/down_proj)."""
    mixtral = hf.config.model_type == "mixtral"
    out = {}
    for name, t in hf.state_dict().items():
        t = t.contiguous()
        stem = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
        if name.endswith("experts.gate_up_proj"):
            base, f = stem.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                out[f"{base}{e}.{gate}.weight"] = t[e, :f].clone()
                out[f"{base}{e}.{up}.weight"] = t[e, f:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{stem.removesuffix('down_proj')}{e}.{'w2' if mixtral else 'down_proj'}.weight"] = t[e].clone()
        else:
            out[stem] = t
    return out


def write(hf, folder, layout: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sd = per_expert(hf) if layout == "per-expert" else {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(str(folder))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_both_layouts_load_equal_to_transformers_forward(arch, tmp_path):
    hf = hf_moe(arch)
    x = tokens()
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        expect, loss = hf(input_ids=x).logits, hf(input_ids=x, labels=x).loss.item()
    for layout in ("fused", "per-expert"):
        write(hf, tmp_path / layout, layout)
        model = load_hf(tmp_path / layout).eval()
        with torch.no_grad():
            assert torch.equal(model(x), expect), layout
            assert model(x, targets).item() == loss  # the LM loss: HF's default forward adds no router loss


def test_transformers_saves_the_per_expert_layout(tmp_path):
    hf = hf_moe("mixtral")
    hf.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(per_expert(hf))


def test_a_region_reads_across_experts_and_the_gate_up_boundary(tmp_path):
    hf = hf_moe("qwen3_moe")
    write(hf, tmp_path, "per-expert")
    weights = FolderWeights(tmp_path)
    model = load_hf(tmp_path, device="meta")
    layout = weights.layout(model)
    full = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    region = (slice(1, 3), slice(20, 45), slice(3, 32))  # experts 1-2, rows across gate (0-31) and up (32-63)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        got = read_region(layout["model.layers.1.mlp.experts.gate_up_proj"], region, f.get_slice, tuple(full.shape))
    assert torch.equal(got, full[region])
    assert set(checkpoint_layout(weights.index, "Qwen3MoeForCausalLM", "qwen3_moe")) == {
        n for n, _ in hf.named_parameters()}
    del layout["model.layers.1.mlp.experts.gate_up_proj"].members["mlp.experts.*.up_proj.weight"][-1]
    with pytest.raises(SnugfitError, match=r"holds \[3, 4\] tensors .* the model 4 experts"):
        model.to_empty(device="cpu")
        weights.fill(model, torch.device("cpu"))


def test_export_reloads_in_transformers(tmp_path):
    model = HFCausalLM(hf_moe("qwen2_moe"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # trained: no longer transformers' init
    save_hf(model, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, model(x))
    assert torch.equal(load_hf(tmp_path)(x), model(x))


def test_plan_profiles_experts_in_float32():
    from snugfit.profile.cache import profile_model

    cfg = hf_moe("qwen3_moe").config.to_dict()
    prof = profile_model(cfg, micro_batch_size=2, seq_len=32, use_cache=False)
    t, d, f, kv = 2 * 32, 32, 32, 16  # tokens; q and o 32 wide, k and v 16: 4 heads, 2 kv heads, head_dim 8
    attn = 2 * t * d * (2 * d + 2 * kv) + 4 * 2 * 4 * 32 * 32 * 8 * 0.5  # projections + causal SDPA
    experts = t * 2 * (2 * d * 2 * f + 2 * f * d)  # each token through its top 2: gate_up then down
    assert prof.blocks[0].fwd_flops == attn + 2 * t * d * 4 + experts  # + the router


# -- two ranks, ZeRO-3, against one process --

STEPS, MBS, NMB, SEQ = 2, 2, 2, 16


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 128, (2 * MBS * NMB, SEQ + 1), generator=torch.Generator().manual_seed(s))
            for s in range(STEPS)]


def _one_process(folder: str, optim) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = load_hf(folder)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    losses = []
    for batch in _batches():
        total = 0.0
        for mb in batch.split(MBS):
            loss = model(mb[:, :-1], mb[:, 1:]) / (2 * NMB)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _two_ranks(env, folder: str) -> dict:
    from torch.distributed.tensor import DTensor

    from snugfit.plan import BlockPlan, Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.optimizer import OptimConfig

    optim = OptimConfig(lr=1e-2, grad_clip=0.5)
    model = load_hf(folder, device="meta")  # sharded on meta, then each rank reads its two experts' rows
    plan = Plan.uniform(2, dp=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3), micro_batch_size=MBS,
                        num_microbatches=NMB, seq_len=SEQ)
    engine = build_engine(model, plan, optim, env, weights=FolderWeights(Path(folder)))
    rows = MBS * NMB
    losses = [engine.train_step(b[env.rank * rows:(env.rank + 1) * rows]).loss for b in _batches()]
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
             for k, v in model.state_dict().items()}  # numpy: tensors would cross the queue as shared memory
    # a pipeline of 2 stages, one block each, over the whole batch
    model = load_hf(folder, device="meta")
    plan = Plan.uniform(2, pp=2, micro_batch_size=MBS, num_microbatches=2 * NMB, seq_len=SEQ)
    engine = build_engine(model, plan, optim, env, weights=FolderWeights(Path(folder)))
    piped = [engine.train_step(b).loss for b in _batches()]
    return {"losses": losses, "state": state, "piped": piped,
            "ref": _one_process(folder, optim) if env.rank == 0 else None}


def test_qwen3_moe_zero3_and_pipeline_two_ranks_match_one_process(tmp_path):
    write(hf_moe("qwen3_moe"), tmp_path / "base", "per-expert")
    results = run_ranks(_two_ranks, 2, str(tmp_path / "base"))
    ref_losses, ref_state = results[0]["ref"]
    assert results[1]["losses"] == results[0]["losses"]
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert results[0]["piped"] == pytest.approx(ref_losses, rel=1e-5)
    # equal weights after two AdamW steps: equal gradients, experts' included
    for name, t in results[0]["state"].items():
        torch.testing.assert_close(torch.from_numpy(t), torch.from_numpy(ref_state[name]), rtol=1e-5, atol=1e-6,
                                   msg=name)
    trained = torch.from_numpy(results[0]["state"]["blocks.0.layer.mlp.experts.gate_up_proj"])
    assert not torch.equal(trained, hf_moe("qwen3_moe").model.layers[0].mlp.experts.gate_up_proj)


# gpt-oss: attention sinks (eager attention), experts fused in the checkpoint too, with biases and a clamped
# SwiGLU; DeepSeek-V3: multi-head latent attention, grouped top-k routing, a shared expert, a dense first layer
OTHERS = {
    "gpt_oss": {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 8},
    "deepseek_v3": {**LLAMA, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 8, "n_shared_experts": 1},
}


@pytest.mark.parametrize("arch", list(OTHERS))
def test_gpt_oss_and_deepseek_v3_saved_by_transformers_load_equal(arch, tmp_path):
    from snugfit.model.hf import attention_for

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **OTHERS[arch])
    cfg._attn_implementation = attention_for(cfg)  # gpt-oss: eager, its sinks have no SDPA path
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    x = tokens()
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    model = load_hf(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(model(x), hf(input_ids=x).logits)
        assert model(x, targets).item() == hf(input_ids=x, labels=x).loss.item()
    quantized = AutoConfig.for_model(arch, **OTHERS[arch], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(SnugfitError, match="quantized \\(mxfp4\\)"):
        HFCausalLM(AutoModelForCausalLM.from_config(hf.config.__class__.from_dict(quantized.to_dict())))



def test_gpt_oss_profiles_its_mlp_though_it_returns_router_scores_too():
    """gpt-oss's MLP returns (hidden states, router scores): the profile still measures the MLP's output."""
    from snugfit.model.hf import attention_for
    from snugfit.profile.cache import profile_model

    cfg = AutoConfig.for_model("gpt_oss", **OTHERS["gpt_oss"])
    cfg._attn_implementation = attention_for(cfg)
    prof = profile_model(cfg.to_dict(), micro_batch_size=2, seq_len=16, use_cache=False)
    assert prof.blocks[0].mlp_share["out"] == 2 * 16 * cfg.hidden_size * 4  # tokens x hidden, fp32

def test_mixtral_folder_plans_trains_exports_and_reloads(tmp_path, capsys):
    import json

    from snugfit.cli import main
    from snugfit.train.export import export_checkpoint, load_checkpoint_model
    from snugfit.train.loop import train
    from tests.test_train import tiny

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", **{**CONFIGS["mixtral"], "vocab_size": 256})  # the byte tokenizer's
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")  # one matrix per expert
    assert main(["plan", "--model", str(tmp_path / "base"), "--seq", "16", "--global-batch", "4", "--json",
                 "--profile-cache", str(tmp_path / "profiles")]) == 0
    assert len(json.loads(capsys.readouterr().out)["blocks"]) == 2
    result = train(tiny(tmp_path / "run", **{"model.name": str(tmp_path / "base"), "steps": 2, "seq_len": 16,
                                             "lr": 0.05}))
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert "trains the language-model loss only" in capsys.readouterr().out  # the router's loss: not added
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    tuned = load_checkpoint_model(step).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(export_checkpoint(step, tmp_path / "exported")).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, tuned(x))
