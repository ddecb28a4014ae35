"""The compatibility rules (plan.rules), each written once: a plan file breaking any of them is refused by
`snugfit plan --plan-file` and by `snugfit train --plan` with the same line, the search's fixed parts are refused
by the same rule, and the search never offers what a rule forbids."""

from dataclasses import replace

import pytest

from snugfit.cli import main
from snugfit.plan import BlockPlan, OptimizerPlan, Plan
from snugfit.model.decoder import ModelConfig
from snugfit.plan.facts import ModelFacts
from snugfit.plan.options import Constraints
from snugfit.plan import rules

BLOCKS, SEQ = 4, 16


def _plan(**kw) -> Plan:
    block = kw.pop("block", BlockPlan())
    return Plan.uniform(BLOCKS, block=block, root=kw.pop("root", replace(block, activations="keep")),
                        micro_batch_size=1, seq_len=SEQ, **kw)


# one plan per rule of rules.RULES, in its order, breaking that rule first
BREAKS = [
    _plan(ep=2),  # expert groups sit within dp x cp (1 x 1 here)
    _plan(cp=3),
    _plan(pp=2, schedule="interleaved", virtual_stages=2, num_microbatches=3),
    _plan(pp=2, schedule="1f1b", num_microbatches=2, evict_bound=1),
    _plan(pp=2, tp=2, schedule="bpipe", num_microbatches=2),
    _plan(tp=2, block=BlockPlan(zero=3, placement="streamed")),
    _plan(tp=2, block=BlockPlan(activations="offload")),
    _plan(block=BlockPlan(zero=2, placement="params_on_host")),
    _plan(pp=2, schedule="zbv", num_microbatches=2, block=BlockPlan(zero=3)),
    _plan(pp=2, schedule="zbv", num_microbatches=2, block=BlockPlan(activations="selective")),
    _plan(pp=2, schedule="zbv", num_microbatches=2, optimizer=OptimizerPlan(in_backward=True)),
    _plan(pp=2, schedule="zbv", num_microbatches=2, grad_reduce="microbatch"),
    _plan(pp=2, schedule="zbv", num_microbatches=2, compile=True),
    _plan(num_microbatches=2, optimizer=OptimizerPlan(in_backward=True)),
    _plan(compute_dtype="float16", optimizer=OptimizerPlan(in_backward=True)),
    _plan(block=BlockPlan(mlp_tiles=3)),  # tiled MLP (model.tiled_mlp)
    _plan(block=BlockPlan(activations="selective", mlp_tiles=4)),
    _plan(compile=True, block=BlockPlan(mlp_tiles=4)),
    _plan(tp=2, block=BlockPlan(mlp_tiles=4)),
    _plan(pp=2, schedule="zbv", num_microbatches=2, block=BlockPlan(mlp_tiles=4)),
]
# then the rules beside the model's facts (plan.facts): (plan, facts) breaking each, in RULES' order
FACTS = ModelFacts(heads=4, kv_heads=4, mlp_hidden=128, vocabulary=64, max_seq_len=SEQ)
MODEL_BREAKS = [
    (_plan(tp=2), replace(FACTS, kv_heads=1)),
    (_plan(tp=2), replace(FACTS, tied_embeddings=True)),
    (_plan(tp=2), replace(FACTS, adapters=True)),
    (_plan(tp=2), replace(FACTS, unsplittable_block="GPT2Block")),
    (_plan(block=BlockPlan(mlp_tiles=4)), replace(FACTS, untileable_mlp="GPT-2's MLP (dropout inside)")),
    (_plan(cp=8), FACTS),
    (_plan(cp=2), replace(FACTS, attention="LlamaDecoderLayer", sequence_splits=False)),
    (_plan(ep=2, dp=2), FACTS),
    (_plan(ep=3, dp=3), replace(FACTS, n_experts=4, top_k=2)),
    (_plan(ep=2, dp=2), replace(FACTS, n_experts=4, top_k=2, expert_splits=False)),
    (_plan(), replace(FACTS, n_experts=4, top_k=2, nf4_experts=True)),
    (_plan(), replace(FACTS, max_seq_len=SEQ // 2)),
]


def test_every_rule_has_a_plan_that_breaks_it_first():
    assert len(BREAKS) + len(MODEL_BREAKS) == len(rules.RULES)
    for rule, (plan, facts) in zip(rules.RULES, [*((p, None) for p in BREAKS), *MODEL_BREAKS]):
        where, parts = next((w, p) for w, p in plan.rule_parts(facts)
                            if all(getattr(p, n) is not None for n in rule.reads) and rule.broken(p))
        assert plan.rule_broken(facts) == f"{where}: {rule.says(parts)}"
        assert facts is None or plan.rule_broken() is None  # read only beside a model


@pytest.mark.parametrize("cfg, plan", [
    (ModelConfig(dim=48, n_layers=BLOCKS, n_heads=6, n_kv_heads=3, vocab_size=64, max_seq_len=SEQ), _plan(tp=2)),
    (ModelConfig(dim=32, n_layers=BLOCKS, n_heads=4, vocab_size=64, max_seq_len=SEQ, tie_embeddings=True),
     _plan(tp=2)),
    (ModelConfig(dim=32, n_layers=BLOCKS, n_heads=4, vocab_size=64, max_seq_len=SEQ // 2), _plan()),
], ids=["heads", "tied", "too-long"])
def test_the_planner_and_the_runtime_read_the_same_facts(cfg, plan):
    """The model's facts from its profile (the planner's) and from its module (the runtime's) break the same rule
    with the same line."""
    from snugfit.model.decoder import Decoder
    from snugfit.profile import profile_model
    from snugfit.runtime.tensor_parallel import model_facts

    model = Decoder(cfg)
    planned = ModelFacts.of_profile(profile_model(cfg, micro_batch_size=1, seq_len=min(SEQ, cfg.max_seq_len)))
    line = plan.rule_broken(model_facts(model))
    assert line is not None and plan.rule_broken(planned) == line


@pytest.mark.parametrize("i", range(len(BREAKS)))
def test_plan_and_train_refuse_a_plan_file_with_the_same_line(i, tmp_path, capsys):
    plan = BREAKS[i]
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    line = plan.rule_broken()
    model = ["--n-layers", str(BLOCKS), "--seq-len", str(SEQ), "--max-seq-len", str(SEQ)]
    assert main(["plan", "--plan-file", str(path), *model]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {line}"
    assert main(["train", "--plan", str(path), "--batch-size", str(plan.global_batch), "--steps", "1",
                 "--out-dir", str(tmp_path / "run"), "--progress", "false", "--plot", "false", *model]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: plan {path}: {line}"


def test_fixed_parts_break_the_same_rules():
    with pytest.raises(Exception, match="tp 2 does not combine with schedule 'bpipe'"):
        Constraints(tp=2, schedule="bpipe").checked(4)
    with pytest.raises(Exception, match="needs zero 3"):
        Constraints(zero=2, offload_params=True).checked(2)
    with pytest.raises(Exception, match="allows one backward"):
        Constraints(schedule="zbv", recompute="selective").checked(2)
    assert Constraints(tp=2).checked(4).tp == 2  # a rule whose other part is not fixed is not read


def test_the_search_refuses_an_optimizer_setup_beside_fixed_parts_by_the_same_rule():
    from snugfit.hardware import parse_cluster
    from snugfit.plan.search import NoPlanError, search
    from tests.test_search import MODELS

    with pytest.raises(NoPlanError, match="schedule 'zbv' makes weight gradients in later weight passes"):
        search(MODELS["mid"], parse_cluster("4xA10"), global_batch=8, constraints=Constraints(schedule="zbv"),
               optimizer=OptimizerPlan(in_backward=True))


def test_the_search_offers_nothing_a_rule_forbids():
    from snugfit.hardware import parse_cluster
    from snugfit.plan.cost_model import CostModel
    from snugfit.plan.search import budget_for
    from tests.test_search import MODELS

    prof, cluster = MODELS["mid"], parse_cluster("4xA10")
    model = CostModel(prof, cluster, 8, Constraints(), budget_for(cluster, None))
    seen = set()
    for cand in model.candidates():
        for root in (False, True):
            for o in model.options(cand, root):
                assert rules.allows_unit(o, cand.shape, root)
                seen.add((cand.schedule, o.zero, o.activations))
    assert ("zbv", 2, "keep") in seen and ("zbv", 3, "keep") not in seen and ("1f1b", 3, "keep") in seen
