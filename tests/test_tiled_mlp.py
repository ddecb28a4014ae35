"""Tiled MLP (model.tiled_mlp, BlockPlan.mlp_tiles): the untiled block's losses and gradients, its names, and the
memory model's tiled block against what torch's MemTracker measures."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from snugfit.errors import PlanError
from snugfit.hardware import parse_cluster
from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.lora import apply_lora
from snugfit.model.recompute import recompute
from snugfit.model.tiled_mlp import TiledMLP, tile_mlp
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.profile import profile_model
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import check_update_gradients, run_ranks

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32)
SEQ = 16


def _loss_and_grads(model, tokens) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tiled(model, tiles: int, policy: str | None = None):
    out = copy.deepcopy(model)
    for block in out.blocks.values():
        tile_mlp(block, tiles)
        if policy:
            recompute(block, policy)
    return out


def _assert_same(model, tiled, tokens) -> None:
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tiled.named_parameters()]
    assert list(model.state_dict()) == list(tiled.state_dict())  # checkpoints keep their names
    (l0, g0), (l1, g1) = _loss_and_grads(model, tokens), _loss_and_grads(tiled, tokens)
    assert l1 == pytest.approx(l0, rel=1e-6)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("tune", ["", "lora", "qlora"])
def test_tiled_block_equals_the_untiled_one(tune):
    torch.manual_seed(0)
    model = Decoder(replace(CFG, dim=128, ffn_dim=512) if tune == "qlora" else CFG)  # NF4: 256-scale blocks
    if tune:
        apply_lora(model, 4, targets=("all-linear",))
        for n, p in model.named_parameters():
            if "lora_b" in n:  # B starts at zero: give the adapters something to differentiate through
                torch.nn.init.normal_(p, std=0.02)
    if tune == "qlora":
        from snugfit.model.quantize import quantize_base

        quantize_base(model)
    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ + 1))
    _assert_same(model, _tiled(model, 4), tokens)
    _assert_same(model, _tiled(model, 4, "recompute"), tokens)  # the recomputation recomputes it tiled too
    assert isinstance(_tiled(model, 4).blocks["0"].mlp, TiledMLP)


def test_hugging_face_llama_layer_tiles_under_its_own_names():
    pytest.importorskip("transformers")
    from snugfit.model.hf import hf_from_config

    torch.manual_seed(0)
    model = hf_from_config(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                max_position_embeddings=64), device="cpu")
    tiled = _tiled(model, 4)
    assert isinstance(tiled.blocks["0"].layer.mlp, TiledMLP)
    assert set(tiled.hf_names) <= {n for n, _ in tiled.named_parameters()} | set(dict(tiled.named_buffers()))
    _assert_same(model, tiled, torch.randint(0, 64, (2, SEQ + 1)))


def test_bad_tiles_are_one_line_before_anything_runs():
    with pytest.raises(PlanError, match="mlp_tiles 5 must divide the sequence length"):
        Plan.uniform(2, block=BlockPlan(mlp_tiles=5), seq_len=SEQ).validate()
    with pytest.raises(PlanError, match="selective keeps the MLP's matmul outputs"):
        Plan.uniform(2, block=BlockPlan(activations="selective", mlp_tiles=4), seq_len=SEQ).validate()
    with pytest.raises(PlanError, match="mlp_tiles must be an integer >= 1"):
        Plan.uniform(2, block=BlockPlan(mlp_tiles=0), seq_len=SEQ).validate()
    plan = Plan.uniform(2, block=BlockPlan(mlp_tiles=4), seq_len=SEQ)
    assert Plan.from_json(plan.to_json()).blocks[0].mlp_tiles == 4
    old = plan.to_dict()
    for b in old["blocks"]:
        del b["mlp_tiles"]  # a plan written before tiles loads untiled
    assert Plan.from_dict(old).blocks[0].mlp_tiles == 1


# -- the runtime: one process against dp 2 with ZeRO-3 --

PLANS = {"untiled": BlockPlan(zero=3), "tiled": BlockPlan(zero=3, mlp_tiles=4),
         "tiled_recompute": BlockPlan(zero=3, activations="recompute", mlp_tiles=2)}


def _train(env: DistEnv, dp: int, names: list[str]) -> dict[str, tuple[float, float, list[str], int]]:
    """Each plan's first step on this rank: (its loss, the one-process reference's, gradients that differ from the
    reference's, gradients checked)."""
    batch = torch.randint(0, CFG.vocab_size, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))  # every rank
    torch.manual_seed(0)
    ref = Decoder(CFG)
    ref_loss, reference = _loss_and_grads(ref, batch)
    out = {}
    for name in names:
        torch.manual_seed(0)
        plan = Plan.uniform(CFG.n_layers, dp=dp, block=PLANS[name], root=BlockPlan(zero=3),
                            micro_batch_size=2, num_microbatches=2, seq_len=SEQ)
        engine = build_engine(Decoder(CFG), plan, OptimConfig(lr=1e-2), env)
        checked, bad = [], []
        check_update_gradients(engine, reference, checked, bad)
        out[name] = (engine.train_step(batch).loss, ref_loss, bad, len(checked))
    return out


def test_tiled_runs_equal_the_one_process_reference_at_2_ranks_with_zero3():
    for rank in run_ranks(_train, 2, 2, list(PLANS)):
        for name, (loss, ref_loss, bad, checked) in rank.items():
            assert loss == pytest.approx(ref_loss, rel=1e-6), name
            assert checked and not bad, (name, bad[:2])


# -- memory: the tiled block's model against MemTracker --

WIDE = ModelConfig(arch="llama", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=96, ffn_dim=1024)


def test_mlp_working_peak_shrinks_by_the_tiles_as_the_model_says():
    from snugfit.calibrate.step import measure_single_process

    prof = profile_model(WIDE, micro_batch_size=2, seq_len=96, use_cache=False)
    share = prof.blocks[0].mlp_share
    tokens_ffn = 2 * 96 * WIDE.ffn_dim * 4
    assert 3 * tokens_ffn <= share["fwd_inner"] <= 5 * tokens_ffn  # gate, up, their product (and silu's output)
    peaks, predicted = {}, {}
    for tiles in (1, 4):
        plan = Plan.uniform(2, block=BlockPlan(activations="recompute", mlp_tiles=tiles), root=BlockPlan(),
                            micro_batch_size=2, num_microbatches=1, seq_len=96)
        predicted[tiles] = estimate(plan, prof, parse_cluster("cpu")).peak_memory_bytes
        peaks[tiles] = measure_single_process(WIDE, plan, steps=0).peak_bytes
        assert predicted[tiles] == pytest.approx(peaks[tiles], rel=0.05), tiles
    # the peak is the MLP's backward: tiling takes off what the model says, at least three quarters of gate, up and
    # their product
    saved = peaks[1] - peaks[4]
    assert saved == pytest.approx(predicted[1] - predicted[4], rel=0.1)  # the totals within 5%: their gap 8%
    assert saved >= (1 - 1 / 4) * 3 * tokens_ffn


def test_the_report_names_the_tiles():
    from snugfit.plan.options import describe

    assert describe(BlockPlan(activations="recompute", mlp_tiles=16)).endswith("recompute + MLP in 16 tiles")
    assert "tiles" not in describe(BlockPlan(activations="recompute"))


def test_the_search_weighs_tiles_only_at_long_sequences():
    from snugfit.plan.options import Constraints
    from snugfit.plan.search import TILE_FROM_SEQ, mlp_tiles_worth_trying

    prof = profile_model(WIDE, micro_batch_size=2, seq_len=96, use_cache=False)
    assert mlp_tiles_worth_trying(prof, Constraints()) == 1  # short: one search, as before
    long = replace(prof, seq_len=TILE_FROM_SEQ)
    share = prof.blocks[0].mlp_share["fwd_inner"] / prof.blocks[0].input_bytes
    tiles = mlp_tiles_worth_trying(long, Constraints())
    assert tiles / 2 < share <= tiles  # the smallest power of two bringing the MLP down to one hidden state
    assert mlp_tiles_worth_trying(long, Constraints(mlp_tiles=1)) == 1  # fixed by the user
