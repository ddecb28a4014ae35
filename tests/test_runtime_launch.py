"""The launcher builds torchrun's command line and refuses to nest."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from snugfit.errors import SnugfitError
from snugfit.runtime.launch import launch, torchrun_args


def test_one_node_is_standalone():
    args = torchrun_args(["train", "--config", "c.toml"], nproc=4, max_restarts=1)
    assert "--standalone" in args and "--nproc-per-node=4" in args and "--max-restarts=1" in args
    assert args[-5:] == ["-m", "snugfit", "train", "--config", "c.toml"]


def test_multi_node_needs_a_rendezvous():
    args = torchrun_args(["train"], nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="host:29500")
    assert "--rdzv-endpoint=host:29500" in args and "--node-rank=1" in args and "--standalone" not in args
    with pytest.raises(SnugfitError, match="rdzv-endpoint"):
        torchrun_args(["train"], nproc=2, nnodes=2)


def test_no_launch_inside_a_launch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SnugfitError, match="already inside"):
        launch(["train"], nproc=2)


def _snugfit(*args: str, cwd, env_extra: dict | None = None, module: list[str] | None = None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, *(module or ["-m", "snugfit"]), *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=240)


def _error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


def test_a_plan_error_at_launch_is_one_line_and_starts_no_rank(tmp_path):
    """--plan auto is searched by the launcher before torchrun starts anything: 32 ranks that cannot split the
    batch are refused in one line, with no rank started (no torchrun line, no out dir)."""
    proc = _snugfit("train", "--nproc", "32", "--batch-size", "16", "--steps", "1", "--out-dir", "run", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == _error_lines(proc), proc.stderr[-2000:]
    (line,) = _error_lines(proc)
    assert "global batch 16 cannot be split" in line and "on 32 ranks" in line and "--batch-size 32" in line
    assert "launch: torchrun" not in proc.stdout and not (tmp_path / "run").exists()


# Imported by every process whose PYTHONPATH starts with its folder: rank 1 alone fails while it builds its engine.
RANK_1_FAILS = """
import os
if os.environ.get("RANK") == "1":
    import snugfit.train.loop as loop
    from snugfit.errors import SnugfitError
    def build_engine(*args, **kwargs):
        raise SnugfitError("simulated: rank 1 cannot read its shards")
    loop.build_engine = build_engine
"""

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--max-seq-len", "16",
        "--batch-size", "4", "--steps", "2", "--eval-every", "0", "--progress", "false", "--plot", "false"]


def test_a_rank_failing_in_set_up_is_one_line_and_the_others_exit_quietly(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RANK_1_FAILS)
    proc = _snugfit("train", *TINY, "--nproc", "2", "--plan", "dp", "--out-dir", "run", cwd=tmp_path,
                    env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert _error_lines(proc) == ["error: rank 1: simulated: rank 1 cannot read its shards"], proc.stderr[-2000:]
    # torchrun's view: the ranks exited 2 (rank 0 quietly), or it stopped one of them with SIGTERM first
    assert re.search(r"launch failed: exit 2 on ranks? [01].*\n", proc.stdout), proc.stdout


def test_ranks_torchrun_starts_itself_search_on_rank_0_and_fail_in_one_line(tmp_path):
    """`torchrun ... -m snugfit train` (no snugfit launcher): rank 0 searches; its plan error is its one line and the
    other rank exits quietly."""
    proc = _snugfit("--standalone", "--nproc-per-node", "2", "-m", "snugfit", "train", *TINY, "--batch-size", "1",
                    "--out-dir", "run", cwd=tmp_path, module=["-m", "torch.distributed.run"])
    assert proc.returncode != 0
    assert _error_lines(proc) == ["error: --plan auto: global batch 1 cannot be split into micro-batch x "
                                  "microbatches x dp on 2 ranks (a pipeline needs at least pp microbatches); a "
                                  "global batch of 2 (--batch-size 2) can be, or use fewer ranks"], proc.stderr[-2000:]
    assert "[rank1]" not in proc.stderr  # torchrun prefixes a rank's traceback with it


def test_every_node_runs_node_0s_plan_or_refuses_in_one_line():
    """PlanHandoff.share over one store: the plan node 0 searched reaches a node that does not search, and a
    second searching node (every node left at --node-rank 0) runs the first one's; a search error is node 0's
    line and `node 0 could not plan the run: ...` on the others."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from snugfit.runtime.launch import PlanHandoff
    from tests.distributed import free_port

    def store(master: bool):
        return dist.TCPStore("127.0.0.1", port, None, master, timeout=timedelta(seconds=30))

    port = free_port()
    host = store(True)
    got: dict = {}
    receiver = threading.Thread(target=lambda: got.update(other=PlanHandoff(nodes=3).share(store(False))))
    receiver.start()
    assert PlanHandoff(search=lambda: '{"plan": 0}', nodes=3).share(host) == '{"plan": 0}'
    assert PlanHandoff(search=lambda: '{"plan": 1}', nodes=3).share(store(False)) == '{"plan": 0}'
    receiver.join()
    assert got["other"] == '{"plan": 0}'

    def refuse():
        raise SnugfitError("--plan auto: no plan fits")

    port = free_port()
    host = store(True)
    said: dict = {}

    def receive():
        try:
            PlanHandoff(nodes=2).share(store(False))
        except SnugfitError as e:
            said["other"] = str(e)

    receiver = threading.Thread(target=receive)
    receiver.start()
    with pytest.raises(SnugfitError, match="^--plan auto: no plan fits$"):
        PlanHandoff(search=refuse, nodes=2).share(host)  # returns once the other node has read it
    receiver.join()
    assert said["other"] == "node 0 could not plan the run: --plan auto: no plan fits"
