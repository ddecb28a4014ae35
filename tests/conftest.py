"""Shared test hygiene."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from snugfit.hardware.catalogue import cache_dir

# Runs calibrate themselves by default (train.replan): their corrections go to a file of this test session, never
# to the user's (where they would correct the plans of the tests after them)
_SESSION = tempfile.mkdtemp(prefix="snugfit-tests-")
os.environ.setdefault("SNUGFIT_CORRECTIONS", os.path.join(_SESSION, "corrections.json"))
# Every process of the session (the tests, their ranks, CLI runs) compiles into one inductor cache, new with the
# session as on CI, so an identical graph compiles once; and with no pool of compile workers to start on 2 cores.
# Set before the ranks' fork server (snugfit.runtime.spawn) starts: inductor reads them when imported.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SESSION, "inductor"))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One thread per process, as the ranks run (run_ranks; torchrun sets OMP_NUM_THREADS=1): the tests' models are too
# small to split an operator across cores, and on a loaded machine a parallel region waits for a descheduled
# thread (a 12-step run of tests/test_train's tiny model took 5.5-9.9 s with two threads, 0.8-1.1 s with one)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# This machine as the tests measure it (at that one thread) goes to a file of the tests' own, kept between sessions
# as the user's is: in the user's, the `snugfit train` after a test run planned for one thread (steps predicted
# 1.8x what they took, on the README's default model)
os.environ.setdefault("SNUGFIT_HARDWARE_PROFILE", str(cache_dir() / "tests" / "hardware.json"))


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that ran an engine in this process (a one-rank group) must not hand that group to the next test:
    the hardware measurement forks, and a forked child with a default group cannot make its own."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """One uninterrupted `snugfit train --nproc 2` of tests.distributed.REFERENCE_RUN, logging every step: the run
    test_elastic's restarted runs and test_multinode's two-launcher runs end bit-identical to, trained once for
    both. Started when first asked for, beside the asking test's own runs; calling the fixture's value waits for
    it and returns its out dir."""
    from tests.distributed import REFERENCE_RUN

    out = tmp_path_factory.mktemp("reference_run")
    log = out.with_name(f"{out.name}.log")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as sink:  # a file never fills up and blocks the run, as an unread pipe would
        proc = subprocess.Popen([sys.executable, "-m", "snugfit", "train", *REFERENCE_RUN, "--log-every", "1",
                                 "--nproc", "2", "--out-dir", str(out)], stdout=sink, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)

    def finished():
        if proc.returncode is None:
            proc.wait(timeout=400)
        assert proc.returncode == 0, log.read_text()[-3000:]
        return out

    yield finished
    if proc.poll() is None:  # a failed test left it running: its ranks die with its process group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
