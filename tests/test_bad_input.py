"""Every bad input: one line `error: ...` naming problem and fix, exit status 2, no checkpoint touched.

Each case runs the real CLI entry in this process against a run folder that
already holds a checkpoint, and checks that folder is byte-for-byte as before.
"""

import json
import shutil

import numpy as np
import pytest

from snugfit.cli import main
from tests.test_train import TINY

TINY_ARGS = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items()), [])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step run with its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *TINY_ARGS, "--steps", "2", "--out-dir", str(out)]) == 0
    return out


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.toml").write_text("[train\nsteps = 1\n")
    (tmp_path / "section.toml").write_text("[trainer]\nsteps = 1\n")
    (tmp_path / "typed.toml").write_text("[train]\nsteps = '10'x\n")
    (tmp_path / "bad.jsonl").write_text('{"txt": "hello"}\n')
    np.full(4000, 999, dtype=np.uint16).tofile(tmp_path / "big_ids.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "tok.json").write_text("{not json")
    (tmp_path / "plan_bad.json").write_text("{")
    plan = {"world_size": 2, "dp": 1, "pp": 1, "seq_len": 32, "micro_batch_size": 4, "stage_blocks": [2],
            "blocks": [{}, {}]}
    (tmp_path / "plan_world.json").write_text(json.dumps(plan))
    (tmp_path / "plan_field.json").write_text(json.dumps({**plan, "world_size": 1, "shard": 3}))
    (tmp_path / "plan_batch.json").write_text(json.dumps({**plan, "world_size": 1, "micro_batch_size": 2}))
    (tmp_path / "plan_offload.json").write_text(
        json.dumps({**plan, "world_size": 1, "blocks": [{"offload_params": True}, {}]}))
    (tmp_path / "plan_8bit.json").write_text(json.dumps({**plan, "world_size": 1, "optimizer": {"states": "8bit"}}))


CASES = [
    # (id, extra args, expected fragment of the message)
    ("malformed-toml", ["--config", "{t}/broken.toml"], "not valid TOML"),
    ("unknown-section", ["--config", "{t}/section.toml"], "unknown section [trainer]"),
    ("unknown-key", ["--setps", "3"], "unknown config key 'setps'; did you mean steps"),
    ("wrong-type", ["--lr", "fast"], "train.lr must be a number"),
    ("misspelt-alias", ["--global-bach", "8"], "did you mean --global-batch?"),
    ("fixed-part-beside-plan-file", ["--plan", "dp", "--zero", "3"], "--zero fixes a part of a searched plan"),
    ("zero-steps", ["--steps", "0"], "train.steps must be positive"),
    ("negative-batch", ["--batch-size", "-4"], "train.batch_size must be positive"),
    ("bad-choice", ["--dtype", "float8"], "train.dtype must be one of"),
    ("lora-target-matches-nothing", ["--lora-rank", "2", "--lora-targets", "attn.q,attn.qq"],
     "LoRA targets ['attn.qq'] match no layer"),  # tests/test_plan_cli.py: the same line from `snugfit plan`
    ("bad-grad-reduce", ["--grad-reduce", "sometimes"], "parallel.grad_reduce must be one of step, microbatch"),
    ("bad-optimizer-states", ["--optimizer-states", "2bit"],
     "train.optimizer_states must be one of fp32, bf16, 8bit, 4bit"),
    ("bad-master-weights", ["--master-weights", "fp16"], "train.master_weights must be one of fp32, bf16"),
    ("step-in-backward-accumulating", ["--optimizer-in-backward", "--grad-reduce", "step", "--micro-batch-size", "2"],
     "needs one microbatch per step or gradients reduced every microbatch"),
    ("step-in-backward-float16", ["--optimizer-in-backward", "--dtype", "float16"], "float16's loss scaling"),
    ("plan-optimizer-mismatch", ["--plan", "{t}/plan_8bit.json"], "--optimizer-states 8bit"),
    ("seq-too-long", ["--seq-len", "64"], "exceeds model.max_seq_len"),
    ("heads-not-dividing", ["--n-heads", "3"], "divisible by model.n_heads"),
    ("top-k-above-experts", ["--n-experts", "4", "--top-k", "5"], "model.top_k (5) must be between 1 and model.n_exp"),
    ("one-expert", ["--n-experts", "1"], "model.n_experts must be 0 (dense) or at least 2"),
    ("micro-batch", ["--micro-batch-size", "3"], "multiple of train.micro_batch_size"),
    ("missing-data", ["--path", "{t}/nothing.txt"], "does not exist"),
    ("empty-corpus", ["--path", "{t}/empty.txt"], "too few for one training sequence"),
    ("bad-jsonl", ["--path", "{t}/bad.jsonl"], "bad.jsonl:1: not a record with a 'text' string"),
    ("ids-beyond-vocab", ["--path", "{t}/big_ids.bin"], "token id 999 in the data is beyond"),
    ("odd-bin-size", ["--path", "{t}/odd.bin"], "not a whole number of uint16 tokens"),
    ("bad-tokenizer", ["--tokenizer", "{t}/tok.json"], "cannot read tokenizer"),
    ("missing-tokenizer", ["--tokenizer", "{t}/none.json"], "tokenizer"),
    ("plan-not-json", ["--plan", "{t}/plan_bad.json"], "is not a valid plan"),
    ("plan-missing", ["--plan", "{t}/nope.json"], "cannot read plan"),
    ("plan-unknown-field", ["--plan", "{t}/plan_field.json"], "unknown fields ['shard']"),
    ("plan-world-size", ["--plan", "{t}/plan_world.json"], "dp (1) x tp (1) x pp (1) must equal world_size (2)"),
    ("plan-batch-mismatch", ["--plan", "{t}/plan_batch.json"], "set --batch-size 2"),
    ("plan-contradiction", ["--plan", "{t}/plan_offload.json"], "(--offload-params) needs zero 3"),
    ("existing-run", [], "already holds checkpoints"),
    ("resume-past-end", ["--resume", "--steps", "2"], "raise --steps to train further"),
    ("resume-other-model", ["--resume", "--dim", "32"], "is of another model"),
]


@pytest.mark.parametrize("case, extra, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(run_dir, tmp_path, capsys, case, extra, message):
    files(tmp_path)
    before = snapshot(run_dir)
    args = [a.replace("{t}", str(tmp_path)) for a in extra]
    code = main(["train", *TINY_ARGS, "--out-dir", str(run_dir), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert snapshot(run_dir) == before


def test_resume_without_checkpoint(tmp_path, capsys):
    assert main(["train", *TINY_ARGS, "--out-dir", str(tmp_path / "new"), "--resume"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_corrupt_checkpoint_is_refused_and_kept(run_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shard = next((copy / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = snapshot(copy)
    assert main(["train", *TINY_ARGS, "--steps", "4", "--out-dir", str(copy), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be loaded" in err[0] and "corrupt" in err[0], err
    assert snapshot(copy) == before


def test_disk_full_while_saving_keeps_earlier_checkpoints(run_dir, tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    before = snapshot(copy / "checkpoints")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", disk_full)  # what the filesystem writer calls per item
    assert main(["train", *TINY_ARGS, "--steps", "4", "--checkpoint-every", "1", "--out-dir", str(copy), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "earlier checkpoints are untouched" in err[0], err
    assert snapshot(copy / "checkpoints") == before  # nothing new committed, no temporary left behind


def test_low_bit_states_without_torchao_name_the_extra(run_dir, capsys, monkeypatch):
    """torchao is optional (extra `optim`): asking for what needs it without it is refused before any rank
    starts."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    for args in (["--optimizer-states", "8bit"], ["--master-weights", "bf16"]):
        before = snapshot(run_dir)
        assert main(["train", *TINY_ARGS, "--out-dir", str(run_dir), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs torchao" in err[0] and 'pip install -e ".[optim]"' in err[0], err
        assert snapshot(run_dir) == before


def test_a_plan_file_of_another_model_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Under a launch the launcher reads the plan first: a plan for 3 blocks (another model), whose batch is wrong
    too, is named for its blocks, the bigger problem, and nothing is started."""
    import snugfit.runtime.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    plan = {"world_size": 2, "dp": 2, "pp": 1, "seq_len": 8, "micro_batch_size": 1, "stage_blocks": [3],
            "blocks": [{}, {}, {}]}
    (tmp_path / "other.json").write_text(json.dumps(plan))
    code = main(["train", *TINY_ARGS, "--nproc", "2", "--plan", str(tmp_path / "other.json"),
                 "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has 3 block decisions but the model has 2 blocks" in err[0], err
    assert not (tmp_path / "run").exists()
