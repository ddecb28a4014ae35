"""A first `snugfit plan` answers fast without answering differently: the optimizer switches' advice searches only
where its lower bounds say a switch could pay (plan.advice._could_pay)."""

from __future__ import annotations

import pytest

import snugfit.plan.advice as explain
from snugfit.hardware import parse_cluster
from snugfit.model.catalogue import resolve_model
from snugfit.plan.cost_model import CostModel
from snugfit.plan.options import Constraints
from snugfit.plan.search import budget_for, search
from snugfit.profile import profile_model

# one row whose advice names a switch (tests/test_plan_optimizer.py), one that offloads where no switch can pay (its
# step is the compute of 128 sequences)
ROWS = [("llama-3.1-8b", "1xRTX4090", 2, 2048), ("llama-2-7b", "2xRTX4090", 128, 2048)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


def _row(row, cache):
    name, spec, batch, seq = row
    prof = profile_model(resolve_model(name), micro_batch_size=1, seq_len=seq, dtype="bfloat16", kernels="gpu",
                         cache_dir=cache)
    return prof, parse_cluster(spec), batch


@pytest.mark.parametrize("row", ROWS)
def test_every_switchs_plan_is_no_faster_than_its_lower_bounds(row, cache):
    """What the skip rests on: no plan the search finds beats the least of its candidates' lower bounds."""
    prof, cluster, batch = _row(row, cache)
    for opt in explain.SWITCHES:
        model = CostModel(prof, cluster, batch, Constraints(), budget_for(cluster, None), optimizer=opt)
        least = min(model.lower_bound(x) for x in model.candidates())
        assert search(prof, cluster, global_batch=batch, alternatives=0, optimizer=opt).best.predicted.step_time_s \
            >= least


@pytest.mark.parametrize("row", ROWS)
def test_the_floor_is_below_every_switchs_lower_bounds(row, cache):
    """CostModel.floor, which rules candidates out before any switch prices them, is below each one's lower
    bound under every switch (0 on one GPU: row 1), and rules most out where no switch pays (the second row)."""
    prof, cluster, batch = _row(row, cache)
    floors = CostModel(prof, cluster, batch, Constraints(), budget_for(cluster, None))
    for opt in explain.SWITCHES:
        model = CostModel(prof, cluster, batch, Constraints(), budget_for(cluster, None), optimizer=opt)
        for x in model.candidates():
            assert floors.floor(x) <= model.lower_bound(x) * (1 + 1e-12), (opt, x.shape)
    if row == ROWS[1]:
        step = search(prof, cluster, global_batch=batch, alternatives=0).best.predicted.step_time_s
        kept = [x for x in floors.candidates() if explain.PAYS * floors.floor(x) <= step]
        assert len(kept) < len(floors.candidates()) / 2


@pytest.mark.parametrize("row", ROWS)
def test_the_advice_is_what_searching_every_switch_gives(row, cache, monkeypatch):
    """The bound skips the second row's five searches and changes no row's advice."""
    prof, cluster, batch = _row(row, cache)
    res = search(prof, cluster, global_batch=batch)
    kw = dict(global_batch=batch, constraints=None, memory_budget=None, result=res)
    searched = []
    real = explain.search
    monkeypatch.setattr(explain, "search", lambda *a, **k: searched.append(k["optimizer"]) or real(*a, **k))
    bounded = explain.switches(prof, cluster, **kw)
    skipped = len(searched)
    monkeypatch.setattr(explain, "_could_pay", lambda *a: True)
    assert explain.switches(prof, cluster, **kw) == bounded
    assert bool(bounded) == (row == ROWS[0])
    assert (skipped, len(searched) - skipped) == ((0, 5) if row == ROWS[1] else (4, 4))
