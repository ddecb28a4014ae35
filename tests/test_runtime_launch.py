"""The launcher builds torchrun's command line and refuses to nest."""

from __future__ import annotations

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
