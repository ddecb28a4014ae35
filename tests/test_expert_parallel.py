"""Expert parallelism's rules (issue 44 items 2, 7): what the model must have for ep, named in one line before
ranks start; the runtime is not built yet, so every ep > 1 is still refused, last."""
from snugfit.plan.facts import ModelFacts
from snugfit.plan.rules import parts_of, problem
from snugfit.plan.shape import Shape


def _problem(ep: int, n_experts: int) -> str | None:
    return problem(parts_of(Shape(ep=ep, dp=6), model=ModelFacts(n_experts=n_experts, top_k=min(2, n_experts))))


def test_ep_on_a_dense_model_is_refused_in_one_line():
    message = _problem(2, 0)
    assert "this model is dense; use ep 1" in message and "\n" not in message


def test_ep_that_does_not_divide_the_experts_is_refused_in_one_line():
    message = _problem(3, 8)
    assert "ep 3 does not divide the model's 8 experts" in message and "\n" not in message


def test_an_ep_that_fits_the_model_is_refused_only_for_the_missing_runtime():
    assert "is not built yet; use ep 1" in _problem(2, 8)
    assert _problem(1, 8) is None and _problem(1, 0) is None


def test_ep_that_does_not_divide_the_data_parallel_ranks_is_refused_in_one_line():
    message = problem(parts_of(Shape(ep=4, dp=2, cp=3)))
    assert "ep 4 does not divide the dp x cp ranks (2 x 3)" in message and "\n" not in message
