"""Router statistics: the tokens per expert MoEMLP records per step equal a hand count, and the report's max/mean."""

import torch

from snugfit.cli import main
from snugfit.model.moe import MoEMLP, begin_step, step_token_counts
from snugfit.report.routing import summarise
from snugfit.train.loop import train
from snugfit.train.metrics import read_metrics
from tests.test_train import tiny


def test_recorded_counts_equal_hand_count_over_microbatches():
    torch.manual_seed(0)
    mlp = MoEMLP(8, 4, 2, 8, aux_coef=0.0, shared=None)
    begin_step(mlp, 0.5, 1.0)
    batches = [torch.randn(3, 5, 8) for _ in range(2)]
    expected = torch.zeros(4, dtype=torch.long)
    for x in batches:
        mlp(x).sum().backward()
        chosen = mlp.router(x.reshape(-1, 8)).softmax(-1).topk(2, dim=-1).indices.flatten()
        expected += torch.bincount(chosen, minlength=4)
    with torch.no_grad():
        mlp(batches[0])  # an evaluation forward is no microbatch: not counted
    assert step_token_counts(mlp) == [expected.tolist()]
    begin_step(mlp, 0.5, 1.0)
    assert step_token_counts(mlp) == []


def test_summary_max_over_mean():
    layers = summarise([[[6, 2, 0, 0], [2, 2, 2, 2]], [[2, 2, 0, 4], [1, 3, 2, 2]]])
    assert [layer.tokens_per_expert for layer in layers] == [[8, 4, 0, 4], [3, 5, 4, 4]]
    assert layers[0].max_over_mean == 2.0 and layers[1].max_over_mean == 1.25


def test_a_short_run_records_its_routing_and_diagnose_reports_it(tmp_path, capsys):
    model = {"dim": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "max_seq_len": 16, "batch_size": 2,
             "n_experts": 4, "top_k": 2, "moe_ffn_dim": 16}
    train(tiny(tmp_path / "run", **model, steps=2, eval_every=0, checkpoint_every=0))
    steps = [r["tokens_per_expert"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
             if r.get("kind", "train") == "train"]
    assert steps and all(len(layers) == 2 for layers in steps)
    assert all(sum(layer) == 2 * 16 * 2 for layers in steps for layer in layers)  # every token's top_k slots
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    for i, layer in enumerate(summarise(steps)):
        assert f"layer {i}: tokens per expert {layer.tokens_per_expert}, max/mean {layer.max_over_mean:.2f}" in out
