"""Profiler: parameter counts, saved activations, FLOPs, caching, HF models, the model catalogue."""

import pytest
import torch

from snugfit.errors import SnugfitError
from snugfit.model.catalogue import resolve_model
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.profile import ModelProfile, profile_model
from snugfit.model.hf import hf_from_config


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("arch,tied", [("llama", False), ("gpt2", True), ("llama", True)])
def test_builtin_param_counts_equal_the_model(arch, tied):
    cfg = ModelConfig(arch=arch, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=300, tie_embeddings=tied)
    with torch.device("meta"):
        model = Decoder(cfg)
    prof = profile_model(cfg, micro_batch_size=1, seq_len=32, use_cache=False)
    assert prof.num_params() == _count(model) == cfg.num_params()
    assert prof.blocks[0].num_params == cfg.block_params()
    assert prof.tied_params == (cfg.vocab_size * cfg.dim if tied else 0)


@pytest.mark.parametrize("hf", [
    dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2),
    dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    dict(model_type="opt", vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
         max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=False),
])
def test_hf_param_counts_equal_the_model(hf):
    prof = profile_model(hf, micro_batch_size=2, seq_len=16, use_cache=False)
    assert prof.num_params() == _count(hf_from_config(hf))
    assert len(prof.blocks) == 2 and all(b.saved_bytes["keep"] > 0 for b in prof.blocks)
    assert prof.head.fwd_peak_bytes > 0 and prof.train_flops() > 0


@pytest.mark.parametrize("name,published", [("llama-2-7b", 6_738_415_616), ("gpt2", 124_439_808),
                                            ("mistral-7b", 7_241_732_096)])
def test_catalogue_builtin_counts_match_published_and_transformers(name, published):
    cfg = resolve_model(name)
    assert isinstance(cfg, ModelConfig) and cfg.num_params() == published
    hf = (dict(model_type="gpt2", vocab_size=cfg.vocab_size, n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads,
               n_positions=cfg.max_seq_len) if cfg.arch == "gpt2" else
          dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.ffn_dim))
    assert _count(hf_from_config(hf)) == published


def test_catalogue_hf_entry_counts_match_published():
    assert _count(hf_from_config(resolve_model("qwen2.5-0.5b"))) == 494_032_768
    assert _count(hf_from_config(resolve_model("opt-125m"))) == 125_239_296


def test_unknown_model_suggests_close_names():
    with pytest.raises(SnugfitError, match="llama-2-7b"):
        resolve_model("llama-2-7")


def test_eager_gpt_block_matches_korthikanti():
    """Korthikanti et al. 2022: a GPT layer saves s*b*h*(34 + 5*a*s/h) bytes in 16-bit without recomputation.

    That figure includes dropout, which our block lacks: two sbh dropout masks (1 byte each, after attention
    and after the MLP), and for the attention probabilities a mask (a*s^2*b bytes) plus the dropped-out copy
    (2*a*s^2*b) on top of the softmax output. Without dropout the figure is s*b*h*(32 + 2*a*s/h). We also keep
    the causal mask (s^2 bytes) and LayerNorm statistics, which the paper ignores: allowed within 10%.
    """
    s, b, h, a = 256, 2, 64, 4
    cfg = ModelConfig(arch="gpt2", dim=h, n_layers=2, n_heads=a, vocab_size=128, max_seq_len=s, attention="eager")
    prof = profile_model(cfg, micro_batch_size=b, seq_len=s, dtype="bfloat16", use_cache=False)
    expected = s * b * h * (34 - 2) + a * s * s * b * (5 - 3)
    assert prof.blocks[1].saved_bytes["keep"] == pytest.approx(expected, rel=0.10)


def test_sdpa_keeps_linear_in_sequence_eager_quadratic():
    def saved(att, s):
        cfg = ModelConfig(arch="llama", dim=64, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=s, attention=att)
        return profile_model(cfg, micro_batch_size=1, seq_len=s, use_cache=False).blocks[0].saved_bytes["keep"]

    assert saved("sdpa", 512) / saved("sdpa", 256) == pytest.approx(2.0, rel=0.02)
    assert saved("eager", 512) / saved("eager", 256) > 2.5


def test_policies_order_and_recompute_keeps_only_the_input():
    cfg = ModelConfig(arch="llama", dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=64)
    blk = profile_model(cfg, micro_batch_size=2, seq_len=64, use_cache=False).blocks[0]
    assert blk.saved_bytes["recompute"] == blk.input_bytes == 2 * 64 * 64 * 4
    assert blk.saved_bytes["recompute"] < blk.saved_bytes["selective"] < blk.saved_bytes["keep"]
    # selective_half drops the outputs of the 2nd, 4th and 6th of q, k, v, o, gate, up, down: k, o and up
    assert [n for _, n, _ in blk.gemms[1::2]] == [cfg.dim, cfg.dim, cfg.ffn_dim]  # k (no GQA here), o, up
    dropped = 2 * 64 * (cfg.dim + cfg.dim + cfg.ffn_dim) * 4
    assert blk.saved_bytes["selective"] - blk.saved_bytes["selective_half"] == dropped


def test_flops_agree_with_the_analytic_count():
    """The analytic count takes backward = 2 x forward; torch's attention backward formula is 2.5 x."""
    cfg = ModelConfig(arch="llama", dim=128, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=128)
    prof = profile_model(cfg, micro_batch_size=2, seq_len=128, use_cache=False)
    assert prof.train_flops() / (2 * 128) == pytest.approx(cfg.flops_per_token(128), rel=0.10)


def test_logits_dominate_the_last_piece():
    cfg = ModelConfig(arch="llama", dim=32, n_layers=1, n_heads=2, vocab_size=4096, max_seq_len=64)
    head = profile_model(cfg, micro_batch_size=2, seq_len=64, use_cache=False).head
    logits = 2 * 64 * 4096 * 4
    assert head.fwd_peak_bytes >= 2 * logits  # logits + fp32 log-softmax


def test_cache_roundtrip_and_scaling(tmp_path):
    cfg = ModelConfig(arch="gpt2", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32)
    a = profile_model(cfg, micro_batch_size=2, seq_len=32, cache_dir=tmp_path)
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    assert profile_model(cfg, micro_batch_size=2, seq_len=32, cache_dir=tmp_path) == a == ModelProfile.load(files[0])
    big = profile_model(cfg, micro_batch_size=4, seq_len=32, use_cache=False)
    scaled = a.scaled(4)
    assert scaled.blocks[0].saved_bytes == big.blocks[0].saved_bytes
    assert scaled.train_flops() == pytest.approx(big.train_flops())


def test_a_cached_profile_is_read_without_importing_torch(tmp_path):
    """`snugfit plan` of a profiled model imports no torch (profile.cache): a fresh interpreter reads the profile
    this one built, equal to it, with torch never imported; the key's torch version is the one torch reports."""
    import json
    import subprocess
    import sys
    from importlib.metadata import version
    from pathlib import Path

    cfg = ModelConfig(arch="llama", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32)
    built = profile_model(cfg, micro_batch_size=2, seq_len=32, cache_dir=tmp_path, kernels="gpu")
    assert version("torch") == torch.__version__
    read = subprocess.run([sys.executable, "-c", f"""
import json, sys
from snugfit.model.config import ModelConfig
from snugfit.profile import profile_model
prof = profile_model(ModelConfig(**{cfg.to_dict()!r}), micro_batch_size=2, seq_len=32, cache_dir={str(tmp_path)!r},
                     kernels="gpu")
print(json.dumps({{"torch": "torch" in sys.modules, "profile": prof.to_dict()}}))
"""], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    out = json.loads(read.stdout)
    assert not out["torch"]
    assert ModelProfile.from_dict(out["profile"]) == built


def test_measured_times_are_positive():
    cfg = ModelConfig(arch="llama", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32)
    prof = profile_model(cfg, micro_batch_size=1, seq_len=32, use_cache=False, measure_on="cpu", repeats=1)
    assert prof.device == "cpu" and all(p.fwd_time_s > 0 and p.bwd_time_s > 0 for p in prof.pieces)
    for block in prof.blocks:  # each recomputation policy measured with its own intercept, within its total
        assert set(block.recompute_fixed_s) == set(block.recompute_time_s) == {"recompute", "selective", "selective_half"}
        assert all(0 <= block.recompute_fixed_s[k] <= block.recompute_time_s[k] for k in block.recompute_time_s)


def test_gpu_profiles_count_what_the_gpu_kernels_save():
    """Profiles for GPU clusters keep what CUDA's kernels keep, not the CPU path's extra copies: the fused RMSNorm
    its bf16 input and a row statistic (not fp32 copies), flash attention its output sequence-major (so the
    output projection's input is a view of it, not a copy). Llama-2-7B's block at seq 4096 then saves the
    published CUDA count, about 37.5 x s*b*h bytes, 14 less than on CPU."""
    cfg = resolve_model("llama-2-7b")
    cfg.n_layers = 1
    sbh = 4096 * cfg.dim
    saved = {k: profile_model(cfg, micro_batch_size=1, seq_len=4096, dtype="bfloat16", use_cache=False,
                              kernels=k).blocks[0].saved_bytes["keep"] / sbh for k in ("cpu", "gpu")}
    assert saved["gpu"] == pytest.approx(37.5, abs=0.25)
    assert saved["cpu"] - saved["gpu"] == pytest.approx(14.0, abs=0.1)  # 6 per norm, two norms; 2 for the copy


def test_attention_backward_is_counted_once_with_its_head_dim():
    """Flash attention's backward is 2.5 forwards, its recomputation included: the GPU kernels' stand-in must not
    add a forward for the recomputation it runs on CPU. The profile keeps attention's head dim."""
    cfg = ModelConfig(arch="llama", dim=128, n_layers=1, n_heads=2, vocab_size=256, max_seq_len=256)
    for kernels in ("cpu", "gpu"):
        block = profile_model(cfg, micro_batch_size=1, seq_len=256, use_cache=False, kernels=kernels).blocks[0]
        gemm = sum(2.0 * m * n * k for m, n, k in block.gemms)
        attention = 4.0 * 256 * 256 * 128 / 2  # causal: half of 4 s^2 d
        assert block.head_dim == 64
        assert block.fwd_flops - gemm == pytest.approx(attention)
        assert block.bwd_flops - 2 * gemm == pytest.approx(2.5 * attention)


def test_the_fused_norm_stand_in_computes_what_rms_norm_computes():
    import torch.nn.functional as F

    from snugfit.profile.kernels import _FusedRMSNorm

    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = _FusedRMSNorm.apply(x, w, 1e-5)
    ref = F.rms_norm(x, (16,), w, 1e-5)
    g = torch.randn_like(ref)
    torch.testing.assert_close(y, ref)
    for got, want in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_flash_attention_stand_in_computes_what_sdpa_computes():
    import torch.nn.functional as F

    from snugfit.profile.kernels import _FlashAttention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    out = _FlashAttention.apply(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(ref)
    torch.testing.assert_close(out, ref)
    assert out.transpose(1, 2).is_contiguous()  # sequence-major, as flash attention writes it
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_measured_profile_of_frozen_leading_pieces_has_no_backward_time():
    """The embedding and the first blocks frozen: nothing before them needs gradients, so they run no backward,
    and the measured profile says 0 for it (it failed on the missing timings before)."""
    cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, vocab_size=128, max_seq_len=32)
    prof = profile_model(cfg, micro_batch_size=2, seq_len=32, measure_on="cpu", repeats=2, use_cache=False,
                         frozen="embed,blocks:0-1")
    assert [p.bwd_time_s for p in prof.pieces[:3]] == [0.0, 0.0, 0.0]
    assert prof.blocks[2].bwd_time_s > 0 and all(p.fwd_time_s > 0 for p in prof.pieces)


def test_memory_traffic_is_the_activations_and_doubles_with_the_micro_batch():
    """Only ops that make a tensor move bytes: fake tensors answer metadata queries (prim.device) on weights and
    gradients too, which once counted each weight's bytes several times per block and broke the linear scaling
    in the micro-batch that ModelProfile.scaled assumes."""
    cfg = ModelConfig(arch="llama", dim=256, n_layers=1, n_heads=4, vocab_size=256, max_seq_len=256, ffn_dim=512)
    one, two = (profile_model(cfg, micro_batch_size=b, seq_len=256, dtype="bfloat16", use_cache=False,
                              kernels="gpu").blocks[0] for b in (1, 2))
    assert two.fwd_mem_bytes == pytest.approx(2 * one.fwd_mem_bytes, rel=0.01)
    assert two.bwd_mem_bytes == pytest.approx(2 * one.bwd_mem_bytes, rel=0.05)


def test_operators_counted_are_the_ones_an_eager_block_dispatches():
    """The dispatch floor counts operators: the fake-tensor metadata queries (prim.device), two of every three
    ops counted once, never run in eager mode. An eager block's forward dispatches exactly the counted ops; its
    backward a few fewer (the profile's fake gradients add detaches)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
            return out

    cfg = ModelConfig(arch="llama", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=8)
    model = Decoder(cfg)
    x, rope = torch.randn(1, 8, 32, requires_grad=True), model.rope[:8]  # as Decoder.forward calls the block
    with Count() as fwd:
        y = model.blocks["0"](x, rope)
    with Count() as bwd:
        y.backward(torch.ones_like(y))
    counted = profile_model(cfg, micro_batch_size=1, seq_len=8, dtype="float32", use_cache=False).blocks[0]
    assert counted.fwd_ops == fwd.n
    assert bwd.n <= counted.bwd_ops <= 1.25 * bwd.n


@pytest.mark.parametrize("name, published", [
    ("llama-3.2-1b", 1.24e9), ("llama-3.2-3b", 3.21e9), ("qwen3-0.6b", 0.60e9), ("qwen3-8b", 8.19e9),
    ("gemma-2-2b", 2.61e9), ("gemma-2-9b", 9.24e9), ("gemma-3-1b", 1.00e9), ("phi-3-mini", 3.82e9), ("phi-4", 14.7e9),
])
def test_the_2026_catalogue_entries_have_their_published_sizes(name, published):
    """The model cards' sizes (two or three digits): each entry's shape, built by transformers on meta."""
    cfg = resolve_model(name)
    count = cfg.num_params() if isinstance(cfg, ModelConfig) else _count(hf_from_config(cfg))
    assert count == pytest.approx(published, rel=0.01)


def _every_block_recorded(monkeypatch):
    """profile_model as it was before blocks stood in for each other: every block recorded and traced."""
    import snugfit.profile.profile as profiling

    monkeypatch.setattr(profiling, "stand_ins", lambda embed, blocks: list(range(len(blocks))))


@pytest.mark.parametrize("kind", ["lora", "sliding", "compiled"])
def test_blocks_of_one_kind_are_recorded_once_and_profile_as_every_block_recorded(monkeypatch, kind):
    """One block of each kind stands for the others (profile.alike): the profile equals, field for field, the one
    that records and traces every block. A LoRA model's first block computes no input gradient; a Qwen2 with
    sliding windows above its second layer has two kinds of attention; compiled, every block is traced so too."""
    from snugfit.model.hf import hf_from_config
    from snugfit.profile.alike import stand_ins
    from snugfit.profile.profile import fine_tune, model_parts

    pytest.importorskip("transformers")
    llama = ModelConfig(arch="llama", vocab_size=256, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_seq_len=64)
    qwen = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 128, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    model, options, kinds = {
        "lora": (llama, {"lora_rank": 4, "kernels": "gpu"}, [0, 1, 1, 1, 1, 5]),
        "sliding": (qwen, {}, [0, 1, 2, 2, 4]),
        "compiled": (llama, {"compile": True, "lora_rank": 4, "quantize_base": "nf4"}, [0, 1, 1, 1, 1, 5]),
    }[kind]
    if isinstance(model, dict):
        net = hf_from_config(model)
    else:
        with torch.device("meta"):
            net = Decoder(model)
    fine_tune(net, options.get("lora_rank"), None)
    parts = model_parts(net)
    assert stand_ins(parts.embed, parts.blocks) == kinds
    few = profile_model(model, micro_batch_size=2, seq_len=32, use_cache=False, **options)
    _every_block_recorded(monkeypatch)
    assert few == profile_model(model, micro_batch_size=2, seq_len=32, use_cache=False, **options)


def test_a_compiled_profile_takes_the_eager_recording_and_only_traces(monkeypatch, tmp_path):
    """`snugfit plan` profiles a model eager, then compiled: the second records nothing again."""
    import snugfit.profile.profile as profiling

    cfg = ModelConfig(arch="llama", vocab_size=256, dim=64, n_layers=3, n_heads=4, max_seq_len=64)
    eager = profile_model(cfg, micro_batch_size=2, seq_len=32, cache_dir=tmp_path)
    recorded = []
    monkeypatch.setattr(profiling, "record_step", lambda *a: recorded.append(a))
    compiled = profile_model(cfg, micro_batch_size=2, seq_len=32, cache_dir=tmp_path, compile=True)
    assert compiled.compiled and not recorded
    assert [b.fwd_flops for b in compiled.blocks] == [b.fwd_flops for b in eager.blocks]
