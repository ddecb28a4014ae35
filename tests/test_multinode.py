"""Two nodes on one machine: two `snugfit train --nnodes 2` launchers (1 rank each) meet at a c10d rendezvous
on 127.0.0.1. They share one out dir, as nodes share a filesystem: DCP writes every rank's shard there and
rank 0 (node 0) writes metrics.jsonl. Their losses equal a one-node, 2-rank run's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from snugfit.train.metrics import read_metrics

ARGS = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--max-seq-len", "16",
        "--batch-size", "4", "--steps", "12", "--warmup-steps", "2", "--eval-every", "0", "--log-every", "1",
        "--checkpoint-every", "1000", "--progress", "false", "--plot", "false", "--timeout-s", "30", "--plan", "dp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--out-dir", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a test can kill a whole node


def _node(out: Path, node_rank: int, endpoint: str, *args: str) -> subprocess.Popen:
    return _train(out, "--nproc", "1", "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint,
                  *args)


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def test_two_launchers_match_one_node_with_two_ranks(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [_node(tmp_path / "pair", rank, endpoint) for rank in (0, 1)]
    reference = _train(tmp_path / "one", "--nproc", "2")
    for proc in (*nodes, reference):
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    want = _losses(tmp_path / "one")
    assert sorted(want) == list(range(1, 13))
    assert _losses(tmp_path / "pair") == want  # bit-identical: same ranks, same data, same reductions
