"""Context parallelism (runtime.context_parallel) against one process over the whole batch, at 2 and 4 gloo ranks.

Each rank of a cp group holds a contiguous chunk of every sequence; attention trades it for heads with all-to-alls.
Every plan must give the loss and the gradients (reduced over dp x cp) of one forward over the whole global batch,
with grouped-query attention whose key/value heads are fewer than cp, learned positions (GPT-2), data and tensor
parallelism beside cp, pipeline stages each split over cp, a Hugging Face Llama, Gemma 2 (soft-capped attention,
sliding windows) and Qwen3-MoE, recomputation, and compiled blocks (the all-to-alls traced into their graph). The batch masks prompts and padding, so cp ranks hold different numbers
of targets and the loss's divisors must count them all.
"""

from __future__ import annotations

import pytest
import torch

from snugfit.data.instruct import IGNORE
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

SEQ, ROWS = 32, 4
LLAMA = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=SEQ)
GPT2 = ModelConfig(arch="gpt2", dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=SEQ)
# a Hugging Face Llama (transformers' layers, rotary module and SDPA) with 2 key/value heads, fewer than cp 4
HF_LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
# Gemma 2: soft-capped attention logits (eager attention; the Ulysses attention caps them over the whole sequence),
# alternating sliding (a window shorter than each rank's chunk) and full layers, soft-capped final logits
HF_GEMMA2 = {**HF_LLAMA, "model_type": "gemma2", "head_dim": 8, "sliding_window": 8, "attn_logit_softcapping": 1.0,
             "final_logit_softcapping": 3.0, "initializer_range": 0.3}  # logits large enough to be capped
# Qwen3-MoE: token-wise experts on each rank's chunk (transformers' forward adds no router aux loss by default)
HF_QWEN3_MOE = {**HF_LLAMA, "model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16}
PROMPTS, PADDING = [1, 20, 3, 9], [0, 5, 12, 0]  # masked prompt and padding per row: cp chunks hold unequal targets

# world -> name -> (config, Plan.uniform arguments), each for a global batch of ROWS rows
PLANS = {
    2: {"cp2": (LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
        "cp2-gpt2-zero0": (GPT2, dict(cp=2, micro_batch_size=4, num_microbatches=1)),
        "cp2-lora": (LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
        "hf-cp2": (HF_LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
        "hf-gemma2-cp2": (HF_GEMMA2, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
        "hf-qwen3-moe-cp2": (HF_QWEN3_MOE, dict(cp=2, micro_batch_size=2, num_microbatches=2)),
        # the block compiled whole (fullgraph), its recomputation and the all-to-alls inside the graph
        "cp2-compiled-recompute": (LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, compile=True,
                                               block=BlockPlan(zero=3, activations="recompute")))},
    4: {"cp4-gqa": (LLAMA, dict(cp=4, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=2))),
        "dp2xcp2-recompute": (LLAMA, dict(dp=2, cp=2, micro_batch_size=1, num_microbatches=2,
                                            block=BlockPlan(zero=3, activations="recompute"))),
        "pp2xcp2": (LLAMA, dict(pp=2, cp=2, schedule="1f1b", micro_batch_size=2, num_microbatches=2,
                                block=BlockPlan(zero=3))),
        "hf-cp4-gqa": (HF_LLAMA, dict(cp=4, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=2))),
        "tp2xcp2": (LLAMA, dict(tp=2, cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3)))},
}


def instruct_batch(cfg) -> torch.Tensor:
    """(ROWS, 2, SEQ + 1): tokens, and targets masked on each row's prompt and padding."""
    vocab = cfg["vocab_size"] if isinstance(cfg, dict) else cfg.vocab_size
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    targets = tokens.clone()
    for row, (prompt, pad) in enumerate(zip(PROMPTS, PADDING)):
        targets[row, : prompt + 1] = IGNORE
        targets[row, SEQ + 1 - pad:] = IGNORE
    return torch.stack([tokens, targets], dim=1)


def fresh_model(cfg, lora: bool = False) -> torch.nn.Module:
    """The model (a Hugging Face one, on CPU, for a config dict); with LoRA adapters (rank 2, B drawn non-zero so
    both factors get gradients) where asked."""
    from snugfit.model.hf import hf_from_config
    from snugfit.model.lora import apply_lora

    torch.manual_seed(0)
    model = hf_from_config(cfg, device="cpu") if isinstance(cfg, dict) else Decoder(cfg)
    if lora:
        apply_lora(model, rank=2, seed=3)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad and "lora" in n.lower():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    return model


def reference(cfg, lora: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    batch = instruct_batch(cfg)
    model = fresh_model(cfg, lora)
    loss = model(batch[:, 0, :-1], batch[:, 1, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.item(), grads


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _step(env: DistEnv, world: int) -> dict:
    """Every plan for this world size: eval and one step on this rank's rows, checked against the reference."""
    from torch._dynamo.utils import counters

    from snugfit.runtime import compile as compiled
    from snugfit.runtime.build import build_engine

    out = {}
    for name, (cfg, spec) in PLANS[world].items():
        graphs = counters["stats"]["unique_graphs"]
        lora = name.endswith("lora")
        ref_loss, ref_grads = reference(cfg, lora)
        model = fresh_model(cfg, lora)
        plan = Plan.uniform(model.cfg.n_layers, seq_len=SEQ, **spec)
        engine = build_engine(model, plan, OptimConfig(grad_clip=0.0), env)
        bad: list[str] = []
        update = engine._update

        def check_grads(loss, engine=engine, bad=bad, update=update, ref_grads=ref_grads):
            for n, p in engine.model.named_parameters():
                if ref_grads[n] is None and p.grad is None:  # frozen
                    continue
                try:
                    torch.testing.assert_close(_full(p.grad), ref_grads[n], rtol=1e-5, atol=1e-6)
                except AssertionError as err:
                    bad.append(f"{n}: {err}")
            return update(loss)

        engine._update = check_grads
        rows, dp_rank = ROWS // plan.dp, plan.layout.coords(env.rank)[1]
        rank_batch = instruct_batch(cfg)[dp_rank * rows:(dp_rank + 1) * rows]
        ev, step = engine.eval_loss(rank_batch), engine.train_step(rank_batch)
        ref_norm = torch.stack([g.norm() for g in ref_grads.values() if g is not None]).norm().item()
        out[name] = {"eval": ev, "loss": step.loss, "norm": step.grad_norm, "ref_norm": ref_norm, "bad": bad,
                     "ref": ref_loss, "compiled": spec.get("compile", False),
                     "graphs": counters["stats"]["unique_graphs"] - graphs, "eager": list(compiled._failed.values())}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world):
    for r in run_ranks(_step, world, world):
        for name, res in r.items():
            assert res["loss"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-6), name
            assert res["eval"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-6), name
            assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5), name  # shards summed over dp x cp once
            assert not res["bad"], (name, res["bad"][:2])
            if res["compiled"]:  # the blocks ran compiled, none fell back to eager
                assert res["graphs"] > 0 and not res["eager"], (name, res["eager"])


LONG = ["--model", "llama-3.1-8b", "--cluster", "8xH100-80GB", "--seq", "131072", "--global-batch", "8"]


@pytest.mark.parametrize("extra, says", [
    (["--seq", "131071", "--cp", "2"], "cp 2 does not divide the sequence length (131071)"),
])
def test_a_cp_that_cannot_run_is_one_line_before_any_rank(capsys, extra, says):
    from snugfit.cli import main

    assert main(["plan", *LONG, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_the_search_splits_a_long_sequence_over_ranks(capsys):
    """Llama-3.1-8B at 128k tokens on 8 x H100: context parallelism is what the search picks, and the JSON says so."""
    import json

    from snugfit.cli import main

    assert main(["plan", *LONG, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["cp"] > 1
    assert plan["predicted"]["time_by_phase"]["cp_comm"] > 0


def _qlora_losses(env: DistEnv, folder: str, cp: int) -> list[float]:
    """Three steps of test_qlora's model (NF4 base, LoRA rank 4, a Hugging Face Llama) over its whole batches."""
    from snugfit.runtime.build import build_engine
    from snugfit.train.build import build_model
    from tests.test_qlora import MBS, OPT, SEQ as QSEQ, _batches, _cfg

    plan = Plan.uniform(2, cp=cp, micro_batch_size=MBS, num_microbatches=2, seq_len=QSEQ, block=BlockPlan(zero=3))
    engine = build_engine(build_model(_cfg(folder), on_meta=False), plan, OPT, env)
    return [engine.train_step(b).loss for b in _batches()]


def test_an_nf4_base_with_lora_trains_at_cp_2_as_in_one_process(tmp_path):
    """Later steps' losses follow the adapters' updates, so they equal only where the gradients did too."""
    pytest.importorskip("torchao")
    from tests.test_qlora import save_llama

    save_llama(tmp_path)
    alone = _qlora_losses(DistEnv(), str(tmp_path), 1)
    for losses in run_ranks(_qlora_losses, 2, str(tmp_path), 2):
        assert losses == pytest.approx(alone, rel=1e-5)


def test_tracked_peak_per_rank_matches_the_model_at_cp_2():
    """Each cp rank holds half of every sequence's activations and ZeRO-3 shards over dp x cp: the MemoryTracker's
    peak per rank within 5% of the memory model's (test_memory_vs_runtime's check, on a cp plan)."""
    from tests.test_memory_vs_runtime import _check, _plan, tracked_peaks

    plans = {"cp2_zero3": (_plan(1, BlockPlan(zero=3), BlockPlan(zero=3), m=2, cp=2), ""),
             "cp2_recompute": (_plan(1, BlockPlan(activations="recompute"), m=2, cp=2), "lora")}
    _check(run_ranks(tracked_peaks, 2, plans), plans)


def test_attention_sinks_are_refused_in_planning_and_at_run_time_soft_capping_is_not():
    """gpt-oss's per-head sinks have no term in the Ulysses attention, so cp refuses it (the rule reads
    sequence_splits); Gemma 2's soft-capped attention runs."""
    from snugfit.model.hf import hf_from_config
    from snugfit.plan.facts import ModelFacts
    from snugfit.profile import profile_model
    from snugfit.runtime.tensor_parallel import model_facts

    sinks = {**HF_LLAMA, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}
    for cfg, splits in ((sinks, False), (HF_GEMMA2, True)):
        assert model_facts(hf_from_config(cfg)).sequence_splits is splits, cfg["model_type"]
        prof = profile_model(cfg, micro_batch_size=1, seq_len=SEQ, use_cache=False)
        assert ModelFacts.of_profile(prof).sequence_splits is splits, cfg["model_type"]
