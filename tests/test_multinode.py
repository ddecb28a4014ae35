"""Two nodes on one machine: two `snugfit train --nnodes 2` launchers (1 rank each) meet at a c10d rendezvous
on 127.0.0.1. They share one out dir, as nodes share a filesystem: DCP writes every rank's shard there and
rank 0 writes metrics.jsonl. Node 0 starts first, so its launcher holds the rendezvous store.

- their losses equal a one-node, 2-rank run's, bit for bit;
- a node that dies (its launcher's process group killed) makes the other exit within timeout_s with one line
  naming what went, and leaves no process of the run behind, whichever of the two it was;
- with --max-restarts 1 on both, a killed rank restarts the pair, which resumes from the last checkpoint and
  ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snugfit.train.export import load_checkpoint_model
from snugfit.train.metrics import read_metrics
from tests.distributed import REFERENCE_RUN, REFERENCE_STEPS, free_port, rank_pid, run_pids

STEPS = REFERENCE_STEPS
ARGS = [*REFERENCE_RUN, "--log-every", "1"]
TIMEOUT_S = 8  # the dying-node test's parallel.timeout_s


def _train(out: Path, *args: str, log: str = "run") -> subprocess.Popen:
    """A launcher writing its and its ranks' output to <out>.<log>.log: a file never fills up and blocks
    them, as an unread pipe would."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with open(out.with_name(f"{out.name}.{log}.log"), "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--out-dir", str(out), *args],
                                stdout=sink, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # its own process group, as if on its own machine
    proc.log = Path(sink.name)
    return proc


def _pair(out: Path, *args: str) -> list[subprocess.Popen]:
    """Node 0's and node 1's launchers; node 1 starts once node 0 listens, so node 0 holds the store."""
    port = free_port()
    nodes = [_train(out, "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", *args, log="node0")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and nodes[0].poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    nodes.append(_train(out, "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", *args, log="node1"))
    return nodes


def _finish(*procs: subprocess.Popen) -> str:
    """The runs' output, once each exited 0."""
    for proc in procs:
        proc.wait(timeout=240)
    logs = [proc.log.read_text() for proc in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-3000:]
    return "".join(logs)


def _kill(nodes: list[subprocess.Popen]) -> None:
    """What a failed test leaves running: each launcher's ranks die with it."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def _losses(out: Path) -> dict[int, float]:
    """Each step's loss; a step run again after a restart counts with its last value."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_model(out / "checkpoints" / f"step_{STEPS:08d}").state_dict()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def one_node(reference_run):
    """The reference, an uninterrupted one-node 2-rank run of ARGS' training (conftest.reference_run, which
    test_elastic shares; started when first asked for, beside the test's own launchers); calling the fixture's
    value waits for it and returns its out dir."""
    def finished() -> Path:
        out = reference_run()
        assert sorted(_losses(out)) == list(range(1, STEPS + 1))
        return out

    return finished


def test_two_launchers_match_one_node_with_two_ranks(tmp_path, one_node):
    _finish(*_pair(tmp_path))
    assert _losses(tmp_path) == _losses(one_node())  # bit-identical: same ranks, same data, same reductions


@pytest.mark.parametrize("dead", [0, 1], ids=["store-holder-dies", "other-node-dies"])
def test_a_dead_node_stops_the_other_with_one_line(tmp_path, dead):
    nodes = _pair(tmp_path, "--steps", "2000", "--timeout-s", str(TIMEOUT_S), "--checkpoint-every", "5")
    try:
        committed = tmp_path / "checkpoints" / "step_00000005"  # async: it commits a step or more after step 5
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(n.poll() is None for n in nodes) and not (
                (tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) >= 6 and committed.is_dir()):
            time.sleep(0.2)
        assert committed.is_dir(), "the pair never committed its first checkpoint"
        dead_rank = next(r for r in (0, 1) if _parent(rank_pid(tmp_path, r)) == nodes[dead].pid)
        os.killpg(nodes[dead].pid, signal.SIGKILL)  # the launcher; its rank follows it (PR_SET_PDEATHSIG)
        killed_at = time.monotonic()
        nodes[dead].wait()
        nodes[1 - dead].wait(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - killed_at
    finally:
        _kill(nodes)
    assert nodes[1 - dead].returncode not in (0, None)
    output = nodes[1 - dead].log.read_text()
    assert took < TIMEOUT_S + 20, took
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    # the launcher of rank 0's node holds the ranks' store (torchrun's rendezvous gives rank 0 to either node); the
    # launcher holding the rendezvous (--rdzv-endpoint) is node 0's, which starts first
    store_gone = "lost the job's store while this rank ran step" if dead_rank == 0 else None
    rank_gone = f"rank {dead_rank} stopped answering after step"
    assert lines and all("the last checkpoint is step_000000" in line or "lost the rendezvous" in line
                         for line in lines), output[-3000:]
    assert any((store_gone or rank_gone) in line for line in lines), output[-3000:]
    if dead == 1:  # the rendezvous is intact: the surviving rank's line alone
        assert len(lines) == 1, output[-3000:]
    deadline = time.monotonic() + 120
    while run_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_pids(tmp_path) == []  # both launchers and both ranks are gone


def test_a_killed_rank_restarts_both_nodes_and_resumes(tmp_path, one_node):
    nodes = _pair(tmp_path, "--max-restarts", "1")
    first = tmp_path / "checkpoints" / "step_00000008"
    deadline = time.monotonic() + 240
    while not first.exists() and time.monotonic() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.05)
    assert first.exists(), "the pair never reached its first checkpoint"
    pid = rank_pid(tmp_path, 1)
    assert pid is not None, "rank 1 not found"
    os.kill(pid, signal.SIGKILL)
    try:
        logs = _finish(*nodes)
    finally:
        _kill(nodes)
    assert "resuming at step" in logs, logs[-3000:]  # the restarted ranks resumed, not started again from 0
    assert _losses(tmp_path) == _losses(one_node())
    want, got = _final_weights(one_node()), _final_weights(tmp_path)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
