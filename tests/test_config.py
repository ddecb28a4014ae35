"""Config: defaults < TOML < overrides; every bad input is a one-line SnugfitError naming the key."""

import pytest

from snugfit.config import build_config
from snugfit.errors import SnugfitError


def test_layers_and_short_keys(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nsteps = 7\nlr = 0.01\n[model]\ndim = 64\nn_heads = 4\n")
    cfg = build_config(str(f), {"steps": "9", "model.n_layers": "3", "resume": "true"})
    assert (cfg.train.steps, cfg.train.lr, cfg.model.dim, cfg.model.n_layers, cfg.train.resume) == (9, 0.01, 64, 3, True)
    assert cfg.model.ffn_dim == 192  # re-derived for the new width


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"stepz": 3}, "unknown config key 'stepz'; did you mean steps"),
        ({"steps": "abc"}, "train.steps must be an integer"),
        ({"steps": 0}, "train.steps must be positive"),
        ({"lr": -1}, "train.lr must be positive"),
        ({"dtype": "fp8"}, "train.dtype must be one of"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"batch_size": 10, "micro_batch_size": 4}, "multiple of train.micro_batch_size"),
        ({"seq_len": 4096}, "exceeds model.max_seq_len"),
        ({"model.n_heads": 5}, "divisible by model.n_heads"),
        ({"resume": "maybe"}, "true or false"),
    ],
)
def test_bad_values(overrides, match):
    with pytest.raises(SnugfitError, match=match):
        build_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(SnugfitError, match="not found"):
        build_config(str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=1")
    with pytest.raises(SnugfitError, match="not valid TOML"):
        build_config(str(bad))
    sec = tmp_path / "sec.toml"
    sec.write_text("[trian]\nsteps=1\n")
    with pytest.raises(SnugfitError, match=r"did you mean \[train\]"):
        build_config(str(sec))
    typ = tmp_path / "typ.toml"
    typ.write_text("[train]\nsteps = 1.5\n")
    with pytest.raises(SnugfitError, match="train.steps must be an integer, got 1.5"):
        build_config(str(typ))


@pytest.mark.parametrize("written, meant", [("bf16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32"),
                                            ("bfloat16", "bfloat16")])
def test_dtype_aliases_are_read_as_their_names(written, meant):
    import argparse

    from snugfit.commands import plan as plan_cmd

    assert build_config(None, {"dtype": written}).train.dtype == meant
    sub = argparse.ArgumentParser().add_subparsers()
    plan_cmd.add_parser(sub)
    assert sub.choices["plan"].parse_args(["--reduce-dtype", written]).reduce_dtype == meant
    with pytest.raises(SnugfitError, match="train.dtype must be one of"):
        build_config(None, {"dtype": "bf17"})


def test_an_out_dir_that_names_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for out in (f, f / "run"):
        with pytest.raises(SnugfitError, match="is a file, not a folder; name a folder"):
            build_config(None, {"out_dir": str(out)})
    assert f.read_text() == "mine"


UNBOUNDED = {"train.seed"}  # any integer is a seed


def test_every_numeric_option_refuses_a_value_out_of_its_range():
    """A sweep of the config keys (new ones included): -1 for each number (and the bound's far side where there
    is one) is one SnugfitError line, never accepted, never a traceback."""
    from snugfit.config import BOUNDED, _base_type, all_keys

    swept = 0
    for key, (_, tp) in all_keys().items():
        if _base_type(tp) not in (int, float) or _base_type(tp) is bool or key in UNBOUNDED:
            continue
        bads = [-1] + ([BOUNDED[key][1] + 1] if key in BOUNDED else [])
        for bad in bads:
            with pytest.raises(SnugfitError) as e:
                build_config(None, {key: bad})
            assert key in str(e.value) and "\n" not in str(e.value), (key, bad)
            swept += 1
    assert swept > 40


@pytest.mark.parametrize("pair, names", [
    ({"lora_targets": "q_proj"}, "finetune.lora_targets is set but finetune.lora_rank is 0"),
    ({"lora_dropout": 0.1}, "finetune.lora_dropout is set but finetune.lora_rank is 0"),
    ({"quantize_base": "nf4"}, "nothing is frozen; add --lora-rank"),
    ({"nnodes": 2, "node_rank": 2}, "parallel.node_rank 2 must be below parallel.nnodes"),
    ({"steps": 10, "trace_step": 11}, "train.trace_step 11 is past train.steps"),
    ({"batch_size": 6, "micro_batch_size": 4}, "must be a multiple of train.micro_batch_size"),
])
def test_options_that_contradict_each_other_are_one_line(pair, names):
    with pytest.raises(SnugfitError, match=names):
        build_config(None, pair)


def test_a_bad_option_on_the_command_line_starts_nothing_and_writes_nothing(tmp_path, capsys):
    from snugfit.cli import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "-1", "--out-dir", str(out), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: train.steps must be positive, got -1" and not out.exists()
