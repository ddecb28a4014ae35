"""The docs follow the output: docs/how-it-plans.md's sample is what its command prints now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_how_it_plans_shows_what_snugfit_plan_prints(capsys):
    spec = importlib.util.spec_from_file_location("check_samples", ROOT / "docs" / "check_samples.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    page = ROOT / "docs" / "how-it-plans.md"
    assert check.SAMPLE.search(page.read_text()), "the page has no sample: the check would check nothing"
    assert check.check_file(page, write=False) == [], "run: python docs/check_samples.py --write docs/how-it-plans.md"
