"""HFCausalLM against transformers' own forward; loading (sharded, partial), saving; 2-rank FSDP2 training.

Every model is a tiny random one built here from a config: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import snugfit.model.hf as hfmod  # noqa: E402
from snugfit.errors import SnugfitError  # noqa: E402
from snugfit.model.hf import HFCausalLM, load_hf, save_hf  # noqa: E402
from snugfit.model.lora import apply_lora  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.safetensors_spy import SafetensorsSpy  # noqa: E402

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)
CONFIGS = {
    "llama": LLAMA,
    "mistral": {**LLAMA, "sliding_window": 8},  # shorter than the tokens: the window's mask is exercised
    "qwen2": {**LLAMA, "tie_word_embeddings": True},
    "qwen3": {**LLAMA, "head_dim": 8},
    "phi3": {**LLAMA, "pad_token_id": 0},  # fused qkv_proj and gate_up_proj
    "olmo2": LLAMA,
    "gemma": {**LLAMA, "head_dim": 8},  # embeddings scaled by sqrt(hidden) inside their module
    # alternating sliding and full layers (a window shorter than the tokens), soft-capped attention (eager: no
    # SDPA path) and soft-capped logits, applied after lm_head
    "gemma2": {**LLAMA, "head_dim": 8, "sliding_window": 8, "final_logit_softcapping": 3.0,
               "attn_logit_softcapping": 5.0},
    "gemma3_text": {**LLAMA, "head_dim": 8, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                    "final_logit_softcapping": 3.0},  # a rotary table per layer type
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=64, word_embed_proj_dim=16, dropout=0.0),  # with project_in / project_out
}


def hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    cfg = AutoConfig.for_model(arch, **CONFIGS[arch])
    cfg._attn_implementation = hfmod.attention_for(cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def tokens(seed: int = 1, shape=(2, 16)) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_loss_equals_hf_forward(arch):
    hf = hf_model(arch)
    model = HFCausalLM(hf)
    x = tokens()
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)  # what HF's labels=x shifts to
    assert model(x, targets).item() == hf(input_ids=x, labels=x).loss.item()
    assert torch.equal(model(x), hf(input_ids=x).logits)
    assert model.cfg.n_layers == 2 and list(model.blocks) == ["0", "1"]
    assert model.cfg.tie_embeddings == (arch in ("qwen2", "gpt2", "opt", "gemma", "gemma2", "gemma3_text"))


def test_pipeline_pieces_compose():
    """embed-only, blocks-only, head-only stages chain to the whole model's logits."""
    model = HFCausalLM(hf_model("llama"))
    x = tokens()
    h = model.embed(x)
    for b in model.blocks.values():
        h = b(h, model.rope)
    assert torch.equal(model.head(model.norm(h)), model(x))


@pytest.mark.parametrize("policy", ["recompute", "selective", "selective_half", "offload", "recompute_offload"])
def test_runtime_activation_policies_wrap_hf_blocks(policy):
    from snugfit.runtime.activations import apply_activation_policy

    ref, model = HFCausalLM(hf_model("llama")), HFCausalLM(hf_model("llama"))
    for block in model.blocks.values():
        apply_activation_policy(block, policy)
    x = tokens()
    for m in (ref, model):
        m(x, x).backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), name


def write_sharded(hf, folder) -> dict[str, torch.Tensor]:
    """Two safetensors shards + index, the layout transformers writes for big models."""
    tied = hf.config.tie_word_embeddings
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf.config.save_pretrained(str(folder))
    return sd


@pytest.fixture
def reads(monkeypatch):
    """The tensor names load_hf actually reads from disk."""
    spy = SafetensorsSpy(hfmod.safe_open)
    monkeypatch.setattr(hfmod, "safe_open", spy)
    return spy.names


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_load_sharded_and_partial(tmp_path, reads, arch):
    hf = hf_model(arch)
    stored = write_sharded(hf, tmp_path)
    model = load_hf(tmp_path)
    assert sorted(reads) == sorted(stored)
    x = tokens()
    assert torch.equal(model(x), hf(input_ids=x).logits)

    reads.clear()
    stage = load_hf(tmp_path, blocks={1}, embed=False)
    assert list(stage.blocks) == ["1"] and stage.embed is None
    layer = "model.layers.1." if arch == "llama" else "transformer.h.1."
    final = {"model.norm.weight"} if arch == "llama" else {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    head = {"lm_head.weight"} if arch == "llama" else {"transformer.wte.weight"}  # tied: read the embedding
    assert set(reads) == {k for k in stored if k.startswith(layer)} | final | head
    h = torch.randn(2, 16, 32)
    ref = hf.get_output_embeddings()(hf.get_decoder().norm(hf.get_decoder().layers[1](
        h, position_embeddings=hf.model.rotary_emb(h, torch.arange(16)[None]))) if arch == "llama" else
        hf.transformer.ln_f(hf.transformer.h[1](h)))
    assert torch.equal(stage(h), ref)


def test_config_only_and_hub_name(tmp_path):
    hf_model("qwen2").config.save_pretrained(str(tmp_path))
    model = load_hf(tmp_path / "config.json", blocks={0})
    assert list(model.blocks) == ["0"] and model.head.weight is model.embed.tokens.weight
    with pytest.raises(SnugfitError, match="downloads nothing"):
        load_hf("meta-llama/Llama-2-7b")
    with pytest.raises(SnugfitError, match="no model.safetensors"):
        load_hf(tmp_path)
    granite = AutoConfig.for_model("granite", **LLAMA, embedding_multiplier=2.0)
    with pytest.raises(SnugfitError, match="not supported yet"):
        HFCausalLM(AutoModelForCausalLM.from_config(granite))


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3", "gemma2"])
def test_save_reloads_in_transformers(tmp_path, arch):
    model = HFCausalLM(hf_model(arch))
    apply_lora(model, rank=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_()  # a trained adapter, so merging matters
    x = tokens()
    expect = model(x)
    save_hf(model, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation=hfmod.attention_for(
        model.hf_config))
    assert torch.allclose(reloaded(input_ids=x).logits, expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(load_hf(tmp_path)(x), reloaded(input_ids=x).logits)


# -- two ranks, FSDP2 zero 3, against one process --

STEPS, SEQ, MBS, NMB = 3, 16, 2, 2


def _batches(n: int) -> list[torch.Tensor]:
    return [tokens(seed, (2 * MBS * NMB, SEQ + 1)) for seed in range(n)]


def _fresh(lora: bool) -> HFCausalLM:
    model = HFCausalLM(hf_model("llama"))
    if lora:
        apply_lora(model, rank=4, alpha=8)
    return model


def _reference(lora: bool, optim) -> list[float]:
    """One process, the whole global batch, torch AdamW + clip_grad_norm_."""
    model = _fresh(lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    losses = []
    for batch in _batches(STEPS):
        total = 0.0
        for mb in batch.split(MBS):
            loss = model(mb[:, :-1], mb[:, 1:]) / (2 * NMB)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _train_two_ranks(env, folders: dict[str, str], saved: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from snugfit.model.hf import materialize
    from snugfit.plan import BlockPlan, Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.optimizer import OptimConfig
    from snugfit.runtime.mesh import ParallelDims
    from snugfit.runtime.sharding import apply_fsdp

    optim = OptimConfig(lr=1e-2, grad_clip=0.5)
    out = {}
    for arch, folder in folders.items():  # built on meta, sharded, then each rank reads its own rows
        model = load_hf(folder, device="meta")
        plan = Plan.uniform(2, dp=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3), seq_len=SEQ)
        apply_fsdp(model, dict(model.blocks.items()), plan, ParallelDims.of(plan, env))
        materialize(model, "cpu", folder)
        x = tokens()
        out[arch] = model(x, x).item()
    for lora in (False, True):
        model = _fresh(lora)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        plan = Plan.uniform(2, dp=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3), micro_batch_size=MBS,
                            num_microbatches=NMB, seq_len=SEQ)
        engine = build_engine(model, plan, optim, env)
        rows = MBS * NMB
        losses = [engine.train_step(b[env.rank * rows:(env.rank + 1) * rows]).loss for b in _batches(STEPS)]
        after = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
        out[lora] = (losses, changed, _reference(lora, optim) if env.rank == 0 else None)
    # export after sharded LoRA training: full state on rank 0, adapters merged
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.rank == 0:
        save_hf(model, saved, state_dict=full)
    out["logits"] = model(tokens()).detach().numpy()
    return out


def test_fsdp_two_ranks_match_one_process(tmp_path):
    folders = {}
    for arch in ("llama", "qwen2"):  # untied and tied
        folders[arch] = str(tmp_path / arch)
        (tmp_path / arch).mkdir()
        write_sharded(hf_model(arch), tmp_path / arch)
    results = run_ranks(_train_two_ranks, 2, folders, str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), attn_implementation="sdpa")
    logits = torch.from_numpy(results[0]["logits"])
    assert torch.allclose(reloaded(input_ids=tokens()).logits, logits, rtol=1e-5, atol=1e-5)
    for arch in folders:
        x = tokens()
        expect = HFCausalLM(hf_model(arch))(x, x).item()
        assert results[0][arch] == pytest.approx(expect, rel=1e-6) and results[1][arch] == results[0][arch]
    for lora in (False, True):
        losses, changed, ref = results[0][lora]
        assert results[1][lora][0] == losses
        assert losses == pytest.approx(ref, rel=1e-5)
        if lora:  # only adapters moved; every base weight bit-identical
            assert changed and all(k.endswith(("lora_a", "lora_b")) for k in changed)
            assert sum(k.endswith("lora_b") for k in changed) == 8  # q, k, v, o in both blocks
        else:
            assert len(changed) == len(dict(_fresh(False).named_parameters()))
