"""Shared test hygiene."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that ran an engine in this process (a one-rank group) must not hand that group to the next test:
    the hardware measurement forks, and a forked child with a default group cannot make its own."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
