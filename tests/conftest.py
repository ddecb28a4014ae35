"""Shared test hygiene."""

import os
import tempfile

import pytest
import torch.distributed as dist

# Runs calibrate themselves by default (train.replan): their corrections go to a file of this test session, never
# to the user's (where they would correct the plans of the tests after them)
os.environ.setdefault("SNUGFIT_CORRECTIONS",
                      os.path.join(tempfile.mkdtemp(prefix="snugfit-tests-"), "corrections.json"))


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that ran an engine in this process (a one-rank group) must not hand that group to the next test:
    the hardware measurement forks, and a forked child with a default group cannot make its own."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
