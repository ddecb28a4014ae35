"""Plan JSON written by earlier layouts still loads (plan.migrated): the fixtures under tests/data were written by
snugfit at 2b2f69f (version 1: no version field, three placement booleans per unit)."""

import json
from pathlib import Path

import pytest

from snugfit.cli import main
from snugfit.plan import BlockPlan, Placement, Plan, PlanError
from snugfit.plan.plan import PLAN_VERSION
from tests.test_train import TINY

DATA = Path(__file__).parent / "data"


def _v1(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_a_version_1_plan_loads_as_the_plan_built_the_new_way():
    old = _v1("plan_v1_placements.json")
    assert "version" not in old and "offload_params" in old["blocks"][0]
    plan = Plan.from_dict(old)
    plan.validate(n_blocks=4, world_size=4)
    new = Plan.uniform(4, dp=2, pp=2, micro_batch_size=1, num_microbatches=4, seq_len=16, schedule="bpipe",
                       evict_bound=2, block=BlockPlan(zero=3), root=BlockPlan(zero=2, placement=Placement.HOST_STEP))
    new.blocks[:3] = [BlockPlan(zero=3, placement=Placement.PARAMS_ON_HOST, activations="recompute"),
                      BlockPlan(zero=3, placement=Placement.STREAMED),
                      BlockPlan(zero=1, placement=Placement.HOST_STEP, activations="offload")]
    assert plan == new
    assert plan.version == PLAN_VERSION and Plan.from_json(plan.to_json()) == plan


def test_a_version_1_unit_with_two_placements_is_refused_in_one_line():
    old = _v1("plan_v1_placements.json")
    old["blocks"][1]["offload_optimizer"] = True  # beside its stream_states
    with pytest.raises(PlanError, match=r"plan.blocks\[1\] sets offload_optimizer and stream_states"):
        Plan.from_dict(old)
    with pytest.raises(PlanError, match="plan version 9 is not one this snugfit reads"):
        Plan.from_dict({**old, "version": 9})


def test_train_runs_a_version_1_plan_file(tmp_path):
    """The README's `snugfit train --plan plan.json`, with a plan `snugfit plan --json` wrote at 2b2f69f (the first
    block's optimizer offloaded)."""
    assert _v1("plan_v1_offload.json")["blocks"][0]["offload_optimizer"]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    out = tmp_path / "run"
    assert main(["train", *args, "--steps", "2", "--checkpoint-every", "0", "--eval-every", "0",
                 "--plan", str(DATA / "plan_v1_offload.json"), "--out-dir", str(out)]) == 0
    ran = Plan.from_json((out / "plan.json").read_text())
    assert ran.version == PLAN_VERSION and [b.placement for b in ran.blocks] == [Placement.HOST_STEP,
                                                                                   Placement.DEVICE]
