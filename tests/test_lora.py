"""LoRA and frozen pieces on the built-in Decoder and on HFCausalLM (the 2-rank run is in test_hf.py)."""

from __future__ import annotations

import pytest
import torch

from snugfit.errors import SnugfitError
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.lora import LoRALinear, apply_lora, freeze, merged_state_dict, trainable_summary
from snugfit.runtime.optimizer import OptimConfig, make_adamw

CFG = ModelConfig(dim=32, n_layers=3, n_heads=4, vocab_size=64, max_seq_len=32)


def decoder(arch: str = "llama") -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(**{**CFG.to_dict(), "arch": arch}))


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))


def train(model: torch.nn.Module, steps: int = 3) -> None:
    opt = make_adamw([p for p in model.parameters() if p.requires_grad], OptimConfig(lr=1e-2))
    for _ in range(steps):
        b = batch()
        model(b[:, :-1], b[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_on_decoder_trains_only_adapters(arch):
    model = decoder(arch)
    b = batch()
    before_out = model(b[:, :-1])
    wrapped = apply_lora(model, rank=4, alpha=8)
    assert len(wrapped) == 4 * CFG.n_layers and all(".attn." in w for w in wrapped)
    assert torch.equal(model(b[:, :-1]), before_out)  # B = 0: no change before training
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    train(model)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())
    assert not torch.equal(after["blocks.0.attn.q.lora_b"], torch.zeros_like(after["blocks.0.attn.q.lora_b"]))
    # merged weights compute what base + adapter compute
    merged = Decoder(model.cfg)
    merged.load_state_dict(merged_state_dict(model))
    assert torch.allclose(merged(b[:, :-1]), model(b[:, :-1]), atol=1e-5)


def test_lora_adapters_same_on_every_rank_and_split():
    a, b = decoder(), decoder()
    apply_lora(a, rank=2, seed=3)
    del b.blocks["0"]  # a pipeline stage without block 0 draws block 1's adapter alike
    apply_lora(b, rank=2, seed=3)
    assert torch.equal(a.blocks["1"].attn.q.lora_a, b.blocks["1"].attn.q.lora_a)


def test_trainable_summary_and_freeze():
    model = decoder()
    freeze(model, "embed, blocks:0-1")
    s = trainable_summary(model)
    assert s["embed"] == {"trainable": 0, "frozen": CFG.embed_params()}
    assert s["block.0"]["trainable"] == 0 and s["block.1"]["trainable"] == 0
    assert s["block.2"] == {"trainable": CFG.block_params(), "frozen": 0}
    assert s["head"] == {"trainable": CFG.head_params(), "frozen": 0}
    assert s["total"]["trainable"] + s["total"]["frozen"] == CFG.num_params()
    b = batch()
    model(b[:, :-1], b[:, 1:]).backward()
    assert all((p.grad is None) != p.requires_grad for p in model.parameters())  # frozen: no gradient

    lora = decoder()
    apply_lora(lora, rank=4)
    s = trainable_summary(lora)
    assert s["total"]["trainable"] == CFG.n_layers * 4 * (4 * 32 + 32 * 4)
    assert s["total"]["frozen"] == CFG.num_params()


@pytest.mark.parametrize("spec, message", [("embd", "pieces are"), ("blocks:2-9", "from 0 to 2"),
                                           ("blocks:x", "blocks:A-B")])
def test_freeze_rejects_bad_specs(spec, message):
    with pytest.raises(SnugfitError, match=message):
        freeze(decoder(), spec)


def test_lora_bad_targets_and_rank():
    with pytest.raises(SnugfitError, match=r"\['q_prj'\] match no layer.*attn.q"):  # a typo, named
        apply_lora(decoder(), rank=4, targets=("q_prj",))
    with pytest.raises(SnugfitError, match="positive"):
        apply_lora(decoder(), rank=0)


def test_lora_on_gpt2_conv1d_merges_transposed():
    transformers = pytest.importorskip("transformers")
    from snugfit.model.hf import HFCausalLM

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg)
    model = HFCausalLM(hf)
    assert apply_lora(model, rank=2) == [f"blocks.{i}.layer.attn.{n}" for i in range(2) for n in ("c_attn", "c_proj")]
    assert isinstance(model.blocks["0"].layer.attn.c_attn, LoRALinear)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_()
    b = batch()
    expect = model(b[:, :-1])
    plain = transformers.GPT2LMHeadModel(cfg)  # `hf` itself now runs the adapters: it shares the layers
    missing, unexpected = plain.load_state_dict(
        {model.hf_names[k]: v for k, v in merged_state_dict(model).items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied to the embedding
    assert torch.allclose(plain(input_ids=b[:, :-1]).logits, expect, atol=1e-5)


@pytest.mark.parametrize("zero", [0, 3])
def test_frozen_weights_are_stored_once_in_the_compute_dtype(zero):
    """bf16 LoRA: base weights cost 2 bytes each, not an fp32 master plus FSDP2's gathered bf16 copy."""
    from torch.distributed.tensor import DTensor

    from snugfit.plan import BlockPlan, Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv

    model = decoder()
    apply_lora(model, rank=4)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    plan = Plan.uniform(CFG.n_layers, block=BlockPlan(zero=zero), root=BlockPlan(zero=zero), micro_batch_size=4,
                        seq_len=16, compute_dtype="bfloat16")
    engine = build_engine(model, plan, OptimConfig(), DistEnv())
    params = list(engine.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params if not p.requires_grad)
    assert all(p.dtype == torch.float32 for p in params if p.requires_grad)  # masters of the adapters
    # one process with nothing sharded runs without FSDP2 (runtime.precision): plain tensors, frozen ones never
    # copied again
    assert all(isinstance(p, DTensor) == (zero > 0) for p in params)
    result = engine.train_step(batch()[:, :17])
    assert torch.isfinite(torch.tensor(result.loss))
    held = engine.memory.peak()
    assert held["device.parameters"] == frozen * 2 + trainable * 4
    if zero == 0:  # the compute copies: the adapters' only
        assert held["device.buffers"] <= trainable * 2 + sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("arch, peft, own", [
    ("snugfit", "q_proj,v_proj,gate_proj,down_proj", ["attn.q", "attn.v", "mlp.gate", "mlp.down"]),
    ("phi3", "q_proj,k_proj,v_proj,o_proj,up_proj", ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"]),
    ("gpt2", "q_proj,o_proj,up_proj,down_proj", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
])
def test_peft_target_names_adapt_the_same_projections_under_every_model_s_names(arch, peft, own):
    if arch == "snugfit":
        model = Decoder(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))
        prefix = ""
    else:
        pytest.importorskip("transformers")
        from transformers import AutoConfig, AutoModelForCausalLM

        from snugfit.model.hf import HFCausalLM

        kw = (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16) if arch == "gpt2" else
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, pad_token_id=0))
        model, prefix = HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw))), "layer."
    wrapped = apply_lora(model, rank=2, targets=peft.split(","))
    assert sorted(w for w in wrapped if w.startswith("blocks.0.")) == sorted(f"blocks.0.{prefix}{n}" for n in own)
    if arch == "phi3":  # the default targets adapt the fused projection too (q_proj & co. name no layer there)
        fresh = HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw)))
        assert "blocks.0.layer.self_attn.qkv_proj" in apply_lora(fresh, rank=2)
