"""Compiled blocks (Plan.compile) train as eager ones do, at 1, 2 and 4 gloo ranks, and the profile predicts them.

Each world size is one spawn that trains every plan eager and then compiled from the same weights and batches.
Tolerance: compiling changes only the order of float operations (fused kernels, inductor's reduction order): in
fp32 the losses of these runs agree to ~1e-7 relative (NF4's dequantization to ~4e-6). A relative 1e-4 is far
above that and far below what a wrong graph does (a recomputation that dropped a tensor, a gradient the
partitioner lost, a block run without its adapters moves the loss by 1e-2 and more).

Compiling costs tens of seconds of CPU per distinct graph (gcc builds inductor's kernels), so the plans are few and
tiny, and the ranks share the session's inductor cache (tests/conftest.py): the one-rank run compiles each graph
once, the 2- and 4-rank runs (the same blocks under FSDP2, pipelines and BPipe's hooks) and the CLI run find them
in the cache.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.estimate import estimate
from snugfit.profile import profile_model
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

pytest.importorskip("torchao")

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32)
SEQ, MBS, STEPS = 16, 2, 2
REL = 1e-4


def plan(world: int, block: BlockPlan, *, pp: int = 1, tp: int = 1, m: int = 2, tune: str = "",
         layers: int = CFG.n_layers, **kw) -> tuple[Plan, str]:
    """A plan and its fine-tuning ("", "lora", "qlora": LoRA adapters beside NF4 base weights)."""
    return Plan.uniform(layers, dp=world // pp // tp, pp=pp, tp=tp, block=block, micro_batch_size=MBS,
                        num_microbatches=m, seq_len=SEQ, **kw), tune


def model(tune: str, layers: int) -> Decoder:
    torch.manual_seed(0)
    net = Decoder(ModelConfig(**{**CFG.to_dict(), "n_layers": layers}))
    net.init_weights(0)
    if tune:
        from snugfit.model.lora import apply_lora

        apply_lora(net, 4, targets=("attn.q", "attn.v", "mlp.up"))
    if tune == "qlora":
        from snugfit.model.quantize import quantize_base

        quantize_base(net)
    return net


def train(env, plans: list[tuple[Plan, str]]) -> list[dict]:
    """Per plan: eager and compiled losses, the compiled run's graphs and tracked activation peak."""
    from torch._dynamo.utils import counters

    from snugfit.runtime.build import build_engine

    out = []
    for p, tune in plans:
        row = {}
        for compiled in (False, True):
            graphs = counters["stats"]["unique_graphs"]
            p.shape = replace(p.shape, compile=compiled)
            engine = build_engine(model(tune, len(p.blocks)), p, OptimConfig(lr=1e-2), env)
            rows = p.micro_batch_size * p.num_microbatches
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(STEPS):
                batch = torch.randint(0, CFG.vocab_size, (p.dp * rows, SEQ + 1), generator=g)
                dp_rank = p.layout.coords(env.rank)[1]
                losses.append(engine.train_step(batch[dp_rank * rows:(dp_rank + 1) * rows]).loss)
            row["compiled" if compiled else "eager"] = losses
            row["graphs"] = counters["stats"]["unique_graphs"] - graphs
            row["activations"] = engine.memory.peak()["device.activations"]
        out.append(row)
    return out


def check(results: list[dict], plans: list[tuple[Plan, str]]) -> None:
    for row, (p, tune) in zip(results, plans):
        assert row["compiled"] == pytest.approx(row["eager"], rel=REL), (p.blocks[0], p.pp, p.schedule, tune)


# every activation policy at one rank (offload's hooks wrap the keep and recompute graphs, which they reuse)
ONE = [plan(1, BlockPlan()), plan(1, BlockPlan(activations="recompute")),
       plan(1, BlockPlan(activations="selective")), plan(1, BlockPlan(activations="recompute"), tune="qlora"),
       plan(1, BlockPlan(activations="selective_half")), plan(1, BlockPlan(activations="offload")),
       plan(1, BlockPlan(activations="recompute_offload"))]
TWO = [plan(2, BlockPlan(zero=0)), plan(2, BlockPlan(zero=3, activations="recompute")),
       plan(2, BlockPlan(activations="selective"), pp=2),
       plan(2, BlockPlan(zero=3, activations="recompute"), tune="qlora"),
       plan(2, BlockPlan(), tp=2)]  # the block's DTensors and their collectives traced into the graph
FOUR = [plan(4, BlockPlan(zero=0)), plan(4, BlockPlan(zero=3, activations="selective")),
        plan(4, BlockPlan(zero=3, activations="recompute"), tune="qlora"),
        plan(4, BlockPlan(zero=2, activations="recompute"), pp=2),
        plan(4, BlockPlan(), pp=4, m=4, schedule="bpipe", layers=4)]  # BPipe evicts from pp 4 on


@functools.cache
def profiles():
    """CFG's profile eager and compiled (two tests read them; the compiled one traces the block)."""
    return tuple(profile_model(CFG, micro_batch_size=MBS, seq_len=SEQ, use_cache=False, compile=compiled)
                 for compiled in (False, True))


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(train, 1, ONE)[0]


def test_one_rank_compiled_matches_eager(one_rank):
    check(one_rank, ONE)


def test_every_block_shares_one_graph(one_rank):
    """Two blocks, one graph; LoRA's first block (its input needs no gradient) makes a second; offloading the
    saved tensors wraps the graph keep or recompute made, and compiles none."""
    assert [row["graphs"] for row in one_rank] == [1, 1, 1, 2, 1, 0, 0]


def test_profile_predicts_what_a_compiled_block_saves(one_rank):
    """The tracker sees what the compiled graph saves (the partitioner's choice); the compiled profile predicts
    it, and it is less than eager's."""
    keep = ONE[0][0]
    keep.shape = replace(keep.shape, compile=True)
    eager, prof = profiles()
    predicted = estimate(keep, prof, _cpu()).tracked_by_rank[0]["device.activations"]
    assert one_rank[0]["activations"] == pytest.approx(predicted, rel=0.02)
    assert prof.blocks[0].saved_bytes["keep"] < eager.blocks[0].saved_bytes["keep"]


def test_two_ranks_compiled_matches_eager():
    for rank in run_ranks(train, 2, TWO):
        check(rank, TWO)


def test_four_ranks_compiled_matches_eager():
    for rank in run_ranks(train, 4, FOUR):
        check(rank, FOUR)


def _cpu():
    from snugfit.hardware import parse_cluster

    return parse_cluster("cpu")


def test_train_cli_compiled_loss_matches_eager(tmp_path):
    """`snugfit train --compile` runs and ends where the same run trained eager does (within 2%: it is ~1e-6 here).
    The eager run trains in this process: the same loop the CLI runs, without a second process to start."""
    from snugfit.config import build_config
    from snugfit.train.loop import train as train_loop

    settings = {"steps": 8, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "seq_len": SEQ,
                "batch_size": 4, "micro_batch_size": MBS, "plan": "dp", "progress": False, "plot": False,
                "log_every": 4, "eval_every": 0}
    eager = train_loop(build_config(None, {**settings, "compile": False, "out_dir": str(tmp_path / "eager")}))
    args = [f"--{k.replace('_', '-')}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    out = tmp_path / "compiled"
    run = subprocess.run([sys.executable, "-m", "snugfit", "train", *args, "--out-dir", str(out), "--compile"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compiled the blocks in" in run.stderr + run.stdout
    assert json.loads((out / "plan.json").read_text())["shape"]["compile"] is True
    assert json.loads((tmp_path / "eager" / "plan.json").read_text())["shape"]["compile"] is False
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    compiled = next(r["loss"] for r in rows if r.get("kind") == "train" and r["step"] == 8)
    assert compiled == pytest.approx(eager.losses[8], rel=0.02)


def test_speed_bench_smoke(tmp_path):
    """bench/speed.py --smoke: four loops timed, the eager engine within the operator bar of a plain loop."""
    run = subprocess.run([sys.executable, "bench/speed.py", "--smoke"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(tmp_path)}, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads((tmp_path / "speed.json").read_text())["rows"][0]
    assert set(row["step_s"]) == {"plain eager", "plain compiled", "snugfit eager", "snugfit compiled"}
    assert all(t > 0 for t in row["step_s"].values())
    assert row["ratios"]["eager ops"] <= 1.1


def test_time_model_charges_a_compiled_block_its_launches():
    """A compiled block's host time is its kernel launches at GPU.compiled_launch_s, its selective replay those
    launches again (the policy ran once, when traced); its memory-bound traffic is the fused kernels'."""
    from dataclasses import replace

    from snugfit.hardware.catalogue import GPUS
    from snugfit.plan.policies import policy
    from snugfit.plan.timing import piece_compute, recompute_time

    eager, block = (prof.blocks[0] for prof in profiles())
    assert block.compiled and not eager.compiled
    assert block.fwd_ops < eager.fwd_ops / 3 and block.fwd_mem_bytes < eager.fwd_mem_bytes / 2
    host_bound = replace(GPUS["H100-SXM"], op_overhead_s=1.0, compiled_launch_s=0.25, sac_overhead_s=1.0)
    fwd, bwd = piece_compute(block, host_bound, "float32", None)
    assert (fwd, bwd) == (block.fwd_ops * 0.25, block.bwd_ops * 0.25)
    assert piece_compute(eager, host_bound, "float32", None)[0] == eager.fwd_ops * 1.0
    assert recompute_time(block, policy("selective"), fwd, host_bound, "float32", None) == block.fwd_ops * 0.25


def test_hugging_face_blocks_are_profiled_compiled():
    """A Hugging Face layer, called with its rotary module, traces as torch.compile runs it."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).to_dict()
    eager = profile_model(config, micro_batch_size=MBS, seq_len=SEQ, use_cache=False)
    compiled = profile_model(config, micro_batch_size=MBS, seq_len=SEQ, use_cache=False, compile=True)
    assert compiled.compiled
    assert compiled.blocks[0].saved_bytes["keep"] < eager.blocks[0].saved_bytes["keep"]
    assert compiled.blocks[0].fwd_ops < eager.blocks[0].fwd_ops
