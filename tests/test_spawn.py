"""run_ranks, the multi-rank tests' runner, never waits forever: a rank that dies or hangs fails the call."""

from __future__ import annotations

import os
import time

import pytest

from snugfit.runtime.spawn import run_ranks


def _rank_plus_one(env):
    return env.rank + 1


def _rank_one_dies(env):
    if env.rank == 1:
        os._exit(7)  # as a rank the kernel kills, or one crashing in C: no traceback, no report
    return env.rank


def _rank_zero_hangs(env):
    if env.rank == 0:
        wait_here_forever()
    return env.rank


def wait_here_forever():
    while True:
        time.sleep(0.1)


def test_every_rank_reports_in_rank_order():
    assert run_ranks(_rank_plus_one, 2) == [1, 2]


def test_a_rank_that_exits_without_reporting_fails_the_call_at_once():
    # named by its exit, not found silent at the deadline (which would say "still running")
    with pytest.raises(AssertionError, match="rank 1 exited with code 7 before reporting"):
        run_ranks(_rank_one_dies, 2, timeout_s=300)


def test_a_rank_past_the_deadline_fails_the_call_with_its_stacks():
    # 10 s: room for rank 1 to start and report on a busy machine, so only rank 0 is silent at the deadline
    with pytest.raises(AssertionError, match="rank 0 still running after 10 s") as err:
        run_ranks(_rank_zero_hangs, 2, timeout_s=10)
    assert "wait_here_forever" in str(err.value)  # faulthandler's dump of the hanging rank's threads
    assert "rank 1" not in str(err.value)  # rank 1 reported
