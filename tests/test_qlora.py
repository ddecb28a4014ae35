"""QLoRA: a Hugging Face folder's frozen block linears in 4-bit NF4 (torchao), LoRA adapters trained beside them.

The reference is the same model with each NF4 weight replaced by its dequantized
values as a plain frozen tensor: linear_nf4 computes F.linear(x, dequantized
weight) in the input's dtype, so in fp32 the two differ only in rounding of the
same operations (rel 1e-6). The 2-rank ZeRO-3 run reads the folder onto the meta
device's shards, quantizing each tensor whole before taking its rows, and must
train as the 1-process run does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")
pytest.importorskip("torchao")

from snugfit.config import build_config  # noqa: E402
from snugfit.model.quantize import dequantized, is_quantized  # noqa: E402
from snugfit.plan import BlockPlan, Plan  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

SEQ, MBS, STEPS, VOCAB = 16, 2, 3, 128
OPT = OptimConfig(lr=1e-2)


def save_llama(folder) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(folder)


def _batches() -> list[torch.Tensor]:
    """The global batches: 2 ranks take half each, one process takes both halves as 2 microbatches."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * MBS, SEQ + 1), generator=g) for _ in range(STEPS)]


def _cfg(folder: str):
    return build_config(None, {"model.name": folder, "lora_rank": 4, "quantize_base": "nf4", "seed": 3})


def _train(env, folder: str, plan: Plan, on_meta: bool, dequantize: bool = False) -> dict:
    from snugfit.runtime.build import build_engine
    from snugfit.train.build import build_model, model_weights

    cfg = _cfg(folder)
    model = build_model(cfg, on_meta=on_meta)
    if dequantize:  # the reference: the same values as plain frozen weights
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and is_quantized(m.weight):
                m.weight = torch.nn.Parameter(dequantized(m.weight, torch.float32), requires_grad=False)
    engine = build_engine(model, plan, OPT, env, model_weights(cfg) if on_meta else None)
    quantized = sum(is_quantized(p) for p in engine.model.parameters())
    rows = 2 * MBS // plan.dp
    losses = [engine.train_step(b[env.rank * rows:(env.rank + 1) * rows]).loss for b in _batches()]
    return {"losses": losses, "quantized": quantized, "held": engine.memory.peak()["device.parameters"]}


def _two_ranks(env, folder: str) -> dict:
    plan = Plan.uniform(2, dp=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3), micro_batch_size=MBS, seq_len=SEQ)
    return _train(env, folder, plan, on_meta=True)


def test_qlora_trains_alike_at_1_and_2_ranks_and_as_its_dequantized_reference(tmp_path):
    from snugfit.runtime.dist import DistEnv

    save_llama(tmp_path)
    one = Plan.uniform(2, micro_batch_size=MBS, num_microbatches=2, seq_len=SEQ)
    alone = _train(DistEnv(), str(tmp_path), one, on_meta=False)
    reference = _train(DistEnv(), str(tmp_path), one, on_meta=False, dequantize=True)
    two = run_ranks(_two_ranks, 2, str(tmp_path))
    assert alone["quantized"] == 2 * 7 and reference["quantized"] == 0  # q, k, v, o, gate, up, down per block
    assert alone["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert alone["losses"][-1] < alone["losses"][0]  # the adapters learn
    for r in two:
        assert r["quantized"] == 2 * 7
        assert r["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    # 4-bit weights: each rank holds half of the NF4 bytes, far below the fp32 reference's
    assert all(r["held"] < 0.45 * reference["held"] for r in two)


def test_nf4_without_a_frozen_base_is_one_clear_error(tmp_path):
    from snugfit.errors import SnugfitError
    from snugfit.train.build import build_model

    save_llama(tmp_path)
    with pytest.raises(SnugfitError, match="nothing is frozen; add --lora-rank"):  # refused with the options
        build_config(None, {"model.name": str(tmp_path), "quantize_base": "nf4"})
    cfg = build_config(None, {"model.name": str(tmp_path), "quantize_base": "nf4", "freeze": "embed"})
    with pytest.raises(SnugfitError, match="--lora-rank"):  # frozen, but no block linear: the model says so
        build_model(cfg)


def test_a_qlora_run_exports_merged_bf16_weights_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from snugfit.train.export import export_checkpoint, load_checkpoint_model
    from snugfit.train.loop import train

    torch.manual_seed(0)  # a vocabulary the byte tokenizer fits
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(tmp_path / "base")
    train(build_config(None, {"model.name": str(tmp_path / "base"), "lora_rank": 4, "quantize_base": "nf4",
                              "steps": 3, "seq_len": 32, "batch_size": 4, "eval_every": 0, "log_every": 1,
                              "progress": False, "plot": False, "out_dir": str(tmp_path / "run")}))
    step = tmp_path / "run" / "checkpoints" / "step_00000003"
    export_checkpoint(step, tmp_path / "out")
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ours = load_checkpoint_model(step)
    assert any(is_quantized(p) for p in ours.parameters())
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens[:, :-1], tokens[:, 1:]).item()
        got = tuned(tokens, labels=tokens).loss.item()  # transformers shifts: the same 32 targets
    # the merged weight W + BA is rounded to bf16 once: a loss within 1% of the 4-bit model's
    assert got == pytest.approx(want, rel=1e-2)


class _CountOps(TorchDispatchMode):
    """Operators that make tensors, and the bytes those other than matmuls and views read and write, as the
    profile's recorder counts them."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops += bool(outs)
        view = str(func._overloadpacket) == "aten._unsafe_view" or any(r.alias_info for r in func._schema.returns)
        if outs and func._overloadpacket not in flop_registry and not view:
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


def test_the_profile_charges_what_torchao_dispatches_for_each_nf4_linear():
    """NF4_LINEAR_OPS and NF4_LINEAR_BYTES (per weight) are what linear_nf4 adds to a plain linear, forward and
    backward, at two shapes; a profile with NF4 base weights carries them for each of a block's seven linears."""
    import torch.nn.functional as F

    from snugfit.model.decoder import ModelConfig
    from snugfit.model.quantize import quantize
    from snugfit.profile.cache import profile_model
    from snugfit.profile.types import NF4_LINEAR_BYTES, NF4_LINEAR_OPS

    for shape in ((128, 512), (512, 1024)):
        weight = torch.randn(*shape, dtype=torch.bfloat16)
        counts = []
        for w in (weight, quantize(weight)):
            x = torch.randn(2, 8, shape[1], dtype=torch.bfloat16, requires_grad=True)
            with _CountOps() as fwd:
                y = F.linear(x, w)
            with _CountOps() as bwd:
                y.backward(torch.ones_like(y))
            counts.append((fwd.ops, bwd.ops, fwd.bytes, bwd.bytes))
        assert (counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]) == NF4_LINEAR_OPS, shape
        for i in (2, 3):
            assert (counts[1][i] - counts[0][i]) / weight.numel() == pytest.approx(NF4_LINEAR_BYTES, rel=0.01)
    cfg = ModelConfig(arch="llama", dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=16)
    kw = dict(micro_batch_size=1, seq_len=16, dtype="bfloat16", lora_rank=4, use_cache=False)
    plain, nf4 = (profile_model(cfg, quantize_base=q, **kw) for q in ("none", "nf4"))
    for a, b in zip(plain.blocks, nf4.blocks):
        assert (b.fwd_ops - a.fwd_ops, b.bwd_ops - a.bwd_ops) == (7 * NF4_LINEAR_OPS[0], 7 * NF4_LINEAR_OPS[1])
        assert b.fwd_mem_bytes - a.fwd_mem_bytes == pytest.approx(b.quantized * NF4_LINEAR_BYTES)


def test_compiled_nf4_dequantization_is_one_fused_kernel_per_linear():
    """Compiled, each NF4 linear's dequantization is one kernel a pass, reading the 4-bit weight and writing it in
    the compute dtype: a twelfth of eager's traffic (NF4_LINEAR_BYTES), which is what QLoRA gains from compile."""
    from snugfit.model.decoder import ModelConfig
    from snugfit.profile.cache import profile_model
    from snugfit.profile.types import NF4_LINEAR_BYTES, nf4_bytes

    cfg = ModelConfig(arch="llama", dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=16)
    kw = dict(micro_batch_size=1, seq_len=16, dtype="bfloat16", lora_rank=4, use_cache=False, compile=True)
    plain, nf4 = (profile_model(cfg, quantize_base=q, **kw) for q in ("none", "nf4"))
    for a, b in zip(plain.blocks, nf4.blocks):
        assert b.compiled and (b.fwd_ops - a.fwd_ops, b.bwd_ops - a.bwd_ops) == (7, 7)
        fused = nf4_bytes(b.quantized) + 2 * b.quantized
        assert b.fwd_mem_bytes - a.fwd_mem_bytes == b.bwd_mem_bytes - a.bwd_mem_bytes == fused
        assert fused < b.quantized * NF4_LINEAR_BYTES / 12
