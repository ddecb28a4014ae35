"""A Hugging Face folder read shard by shard into the plan's placement equals the whole-model CPU load.

The trainer builds the model on the meta device (`build_model(cfg, on_meta=True)`)
and `build_engine(..., weights)` reads it after FSDP2 has sharded it: each rank
reads only its own rows, a pipeline rank only its stages' blocks. Checked
against the path that loads the whole model on CPU in every process first:
same losses, gradients and updated parameters, LoRA adapters included, and
bytes read from the safetensors files per rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import snugfit.model.hf as hfmod  # noqa: E402
from snugfit.config import build_config  # noqa: E402
from snugfit.plan import BlockPlan, Plan  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.safetensors_spy import SafetensorsSpy  # noqa: E402

SEQ, MBS, NMB, STEPS, VOCAB = 16, 2, 2, 2, 128
OPT = OptimConfig(lr=1e-2, grad_clip=0.5)

ZERO3 = dict(dp=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3))
# name -> (plan, LoRA rank, tied embeddings); every plan for 2 ranks, blocks 0..3
CASES = {
    "zero3": (ZERO3, 0, False),
    "zero3-lora": (ZERO3, 4, False),
    "zero3-tied": (ZERO3, 0, True),
    "pp2-lora": (dict(pp=2, schedule="1f1b"), 4, False),
    "zero2-offload-optimizer": (dict(dp=2, block=BlockPlan(zero=2, placement="host_step")), 0, False),
    "zero3-offload-params": (dict(dp=2, block=BlockPlan(zero=3, placement="params_on_host"), root=BlockPlan(zero=3)), 0,
                             False),
}


def save_llama(folder, tied: bool = False) -> int:
    """A tiny random Llama saved as transformers saves it; returns the bytes of the tensors in its files."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied))
    hf.save_pretrained(folder)
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


SPY = SafetensorsSpy(hfmod.safe_open)  # installed in each rank process by _compare


def _batches(dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * MBS * NMB, SEQ + 1), generator=g) for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(env, folder: str, plan: Plan, lora: int, on_meta: bool) -> dict:
    """Build (whole CPU load, or on meta + weights), train STEPS steps; losses, first-step gradients, parameters."""
    from snugfit.runtime.build import build_engine
    from snugfit.train.build import build_model, model_weights

    cfg = build_config(None, {"model.name": folder, "lora_rank": lora, "seed": 3})
    weights = model_weights(cfg) if on_meta else None
    SPY.clear()
    engine = build_engine(build_model(cfg, on_meta=on_meta), plan, OPT, env, weights)
    read = (SPY.nbytes, SPY.largest)
    grads: dict[str, torch.Tensor] = {}
    update = engine._update

    def keep_grads(loss):
        if not grads:
            grads.update({n: _full(p.grad) for n, p in engine.model.named_parameters() if p.grad is not None})
            if engine.host is not None:
                grads.update({n: master.grad.clone() for n, _, master, _ in engine.host.named_masters()})
        return update(loss)

    engine._update = keep_grads
    rows = MBS * NMB
    dp_rank = env.rank % plan.dp
    losses = [engine.train_step(b[dp_rank * rows:(dp_rank + 1) * rows]).loss for b in _batches(plan.dp)]
    if engine.host is not None:  # the last host optimizer step runs on a worker thread until the next forward
        engine.host.wait()
    params = {n: _full(p) for n, p in engine.model.named_parameters()}
    buffers = {n: b.clone() for n, b in engine.model.named_buffers()}
    return {"losses": losses, "grads": grads, "params": params, "buffers": buffers, "read": read}


def _compare(env, folders: dict[bool, str]) -> dict:
    hfmod.safe_open = SPY
    out = {}
    for name, (spec, lora, tied) in CASES.items():
        plan = Plan.uniform(4, micro_batch_size=MBS, num_microbatches=NMB, seq_len=SEQ, **spec)
        whole, sharded = (_train(env, folders[tied], plan, lora, on_meta) for on_meta in (False, True))
        bad = []
        for kind in ("grads", "params", "buffers"):
            if whole[kind].keys() != sharded[kind].keys():
                bad.append(f"{kind}: names differ")
            for n, t in whole[kind].items():
                if n in sharded[kind] and not torch.allclose(t, sharded[kind][n], rtol=1e-6, atol=1e-7):
                    bad.append(f"{kind} {n}: max diff {(t - sharded[kind][n]).abs().max().item()}")
        out[name] = {"losses": (whole["losses"], sharded["losses"]), "read": (whole["read"], sharded["read"]),
                     "bad": bad, "trained": len(whole["grads"])}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folders = {tied: tmp_path_factory.mktemp(f"llama-tied-{tied}") for tied in (False, True)}
    full = {tied: save_llama(folder, tied) for tied, folder in folders.items()}
    return full, run_ranks(_compare, 2, {tied: str(folder) for tied, folder in folders.items()})


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_load_trains_as_the_whole_model_load(two_ranks, name):
    _, results = two_ranks
    for r in results:
        whole, sharded = r[name]["losses"]
        assert sharded == pytest.approx(whole, rel=1e-6)
        assert not r[name]["bad"], r[name]["bad"]
        assert r[name]["trained"] > 0
    if CASES[name][1]:  # LoRA: adapters only (q, k, v, o: A and B), drawn from the seed on both paths
        blocks_per_rank = 2 if name.startswith("pp") else 4
        assert all(r[name]["trained"] == blocks_per_rank * 4 * 2 for r in results)


@pytest.mark.parametrize("name", ["zero3", "zero3-lora", "zero3-tied", "pp2-lora", "zero3-offload-params"])
def test_no_process_reads_the_whole_model(two_ranks, name):
    full, results = two_ranks
    full = full[CASES[name][2]]
    whole = [r[name]["read"][0][0] for r in results]
    sharded = [r[name]["read"][1][0] for r in results]
    assert whole == [full, full]  # the CPU-load path: every process reads everything
    assert all(0 < b < 0.6 * full for b in sharded), (sharded, full)
    assert sum(sharded) == full  # each row read by exactly one rank


def test_optimizer_offload_reads_its_rows_again_for_the_fp32_masters(two_ranks):
    """Host offload's fp32 masters come from the files (exact, whatever the device copy's dtype): each rank
    reads its own rows twice, for the device copy and for the masters (every unit offloads here), and never
    a whole tensor (the largest, the embedding, is 128 x 32 fp32)."""
    full, results = two_ranks
    for r in results:
        (whole, whole_largest), (sharded, sharded_largest) = r["zero2-offload-optimizer"]["read"]
        assert whole == full[False] and whole_largest == 128 * 32 * 4
        assert sharded == full[False]  # half of every tensor, twice
        assert sharded_largest == whole_largest // 2


def test_random_init_and_unwrapped_runs_keep_the_cpu_path(tmp_path):
    """config.json alone: nothing to read, built as before; one fp32 process runs unwrapped, read normally."""
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv
    from snugfit.train.build import build_model, model_weights

    save_llama(tmp_path)
    config_only = build_config(None, {"model.name": str(tmp_path / "config.json")})
    assert model_weights(config_only) is None
    assert not any(p.is_meta for p in build_model(config_only, on_meta=True).parameters())

    cfg = build_config(None, {"model.name": str(tmp_path), "lora_rank": 2})
    plan = Plan.uniform(4, micro_batch_size=MBS, num_microbatches=NMB, seq_len=SEQ)
    assert plan.runs_unwrapped
    batch = _batches(1)[0]
    try:
        losses = [build_engine(build_model(cfg, on_meta=on_meta), plan, OPT, DistEnv(),
                               model_weights(cfg) if on_meta else None).train_step(batch).loss
                  for on_meta in (False, True)]
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert losses[0] == losses[1]
