"""`snugfit plan` (search and whole-plan evaluation) and `snugfit profile-hardware`, through their parsers."""

import argparse
import json
import os
import re
from dataclasses import replace

import pytest

from snugfit.cli import _StdoutHandler
from snugfit.commands import plan as plan_cmd
from snugfit.commands import profile_hardware as hw_cmd
from snugfit.errors import SnugfitError
from snugfit.hardware import parse_cluster
from snugfit.model.decoder import ModelConfig
from snugfit.plan import Plan


def _run(argv, capsys):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    plan_cmd.add_parser(sub)
    hw_cmd.add_parser(sub)
    args = ap.parse_args(argv)
    # as snugfit.cli.main: with --json, log lines (a first measurement of this machine) go to stderr
    _StdoutHandler.to_stderr = "--json" in argv
    try:
        rc = (plan_cmd if argv[0] == "plan" else hw_cmd).run(args)
    finally:
        _StdoutHandler.to_stderr = False
    return rc, capsys.readouterr().out


@pytest.fixture
def tiny_model(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(ModelConfig(dim=32, n_layers=4, n_heads=2, vocab_size=128, max_seq_len=64).to_dict()))
    return str(path)


def test_plan_json_has_predictions(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "2xRTX4090", "--seq", "64", "--micro-batch", "2",
                    "--pp", "2", "--num-microbatches", "4", "--schedule", "bpipe", "--json",
                    "--profile-cache", str(tmp_path)], capsys)
    d = json.loads(out)
    assert rc == 0 and d["shape"]["pp"] == 2 and d["shape"]["schedule"] == "bpipe"
    pred = d["predicted"]
    assert pred["peak_memory_bytes"] == max(sum(v for k, v in m.items() if not k.startswith("host:"))
                                            for m in pred["memory_by_rank"])
    assert pred["step_time_s"] > 0 and pred["tokens_per_s"] > 0 and pred["fits"]


def test_plan_text_reports_categories_and_verdict(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "4xA100-80GB", "--seq", "64", "--zero", "3",
                    "--recompute", "selective", "--global-batch", "16", "--micro-batch", "2", "--pp", "1",
                    "--memory-budget", "1MiB", "--profile-cache", str(tmp_path)], capsys)
    assert rc == 0 and "comm_buffers" in out and "tokens/s" in out and "does NOT fit" in out


def test_plan_file_roundtrip(tiny_model, tmp_path, capsys):
    _, out = _run(["plan", "--model", tiny_model, "--seq", "64", "--json", "--profile-cache", str(tmp_path)], capsys)
    path = tmp_path / "plan.json"
    path.write_text(out)
    _, again = _run(["plan", "--model", tiny_model, "--plan-file", str(path), "--json",
                     "--profile-cache", str(tmp_path)], capsys)
    assert json.loads(again)["predicted"]["peak_memory_bytes"] == json.loads(out)["predicted"]["peak_memory_bytes"]


WHOLE = ["--micro-batch", "1", "--zero", "0", "--recompute", "keep"]  # with --pp: evaluated as given


@pytest.mark.parametrize("argv,match", [
    (["--cluster", "4xA10", "--dp", "3", "--pp", "1", *WHOLE], "--dp 3 x --tp 1 x --pp 1"),
    (["--cluster", "4xA10", "--dp", "3"], "--dp 3 does not divide"),
    (["--cluster", "4xA10", "--pp", "3"], "does not divide"),
    (["--cluster", "2xA10", "--global-batch", "5", "--pp", "1", *WHOLE], "not divisible"),
    (["--cluster", "2xA10", "--global-batch", "5", "--dp", "2"],
     r"cannot be split .* on 2 GPUs with dp=2 .*a global batch of 6 \(--batch-size 6\) can be, or use fewer GPUs"),
    (["--cluster", "4xA10", "--pp", "4", "--num-microbatches", "2", *WHOLE], "num_microbatches"),
    (["--cluster", "4xA10", "--pp", "4", "--num-microbatches", "2"], "--num-microbatches 2 must be >= --pp 4"),
    (["--cluster", "2xA10", "--offload-params", "--zero", "2"], r"\(--offload-params\) needs zero 3"),
    (["--cluster", "2xA10", "--offload-optimizer", "2"], "'all' or 'none'"),
    (["--cluster", "2xA01"], "A10"),
    (["--cluster", "4xA10", "--tp", "3"], "--tp 3 does not divide"),
    (["--cluster", "4xA10", "--tp", "4"], "tp 4 does not divide the model's heads"),
    (["--cluster", "4xA10", "--tp", "2", "--zero", "3", "--offload-params"], "does not combine with host offload"),
])
def test_impossible_plans_are_one_line_errors(tiny_model, argv, match, capsys):
    with pytest.raises(SnugfitError, match=match) as e:
        _run(["plan", "--model", tiny_model, "--seq", "64", *argv], capsys)
    assert "\n" not in str(e.value)


def test_unknown_model_is_an_error(capsys):
    with pytest.raises(SnugfitError, match="did you mean"):
        _run(["plan", "--model", "lama-3-8b", "--seq", "64"], capsys)


def test_profile_hardware_command(tmp_path, capsys, monkeypatch):
    """Its stdout is the profile as JSON, whatever it says besides (here: that other work loaded the machine)."""
    from snugfit.cli import main

    monkeypatch.setattr("snugfit.calibrate.hardware.is_busy", lambda share: True)
    rc = main(["profile-hardware", "--out", str(tmp_path / "hw.json"), "--no-collectives", "--no-compile"])
    captured = capsys.readouterr()
    out = captured.out
    assert "other work kept" in captured.err
    assert rc == 0 and json.loads(out)["device"]["name"] == "cpu" and (tmp_path / "hw.json").exists()


def test_a_measured_gpu_machine_becomes_a_cluster_file(tmp_path, monkeypatch):
    """profile-hardware --toml on a GPU machine: the measured card as a [[gpu]] table that plans elsewhere."""
    import torch

    from snugfit.hardware import GPU, Host, Link, LocalHardware

    card = GPU("local-cuda", 48 * 2**30, {"float32": 30.0, "bfloat16": 150.0}, 900.0, 4, matmul_efficiency=1.0)
    local = LocalHardware(card, Host(ram_bytes=256 * 2**30), {"pcie-local": Link("pcie-local", 22.0, 1e-5)})
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "here.toml").write_text(hw_cmd.machine_cluster(local).to_toml())
    cluster = parse_cluster(str(tmp_path / "here.toml"))
    assert cluster.world_size == 4 and cluster.gpu_of(0).memory_bytes == 48 * 2**30
    assert cluster.gpu_of(0).flops_per_s("bfloat16") == 150e12  # measured: efficiency 1
    assert cluster.nodes[0].pcie.name == "pcie4"
    # an SXM card the catalogue lists: its node's GPUs talk over NVLink, which measuring one card does not see
    sxm = replace(card, memory_bytes=80 * 2**30, sms=132, arch="hopper")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    (tmp_path / "sxm.toml").write_text(hw_cmd.machine_cluster(replace(local, device=sxm)).to_toml())
    node = parse_cluster(str(tmp_path / "sxm.toml")).nodes[0]
    assert (node.gpu.name, node.intra.name, node.gpu.sms) == ("NVIDIA H100 80GB HBM3", "nvlink4", 132)


def test_a_cpu_machine_becomes_a_cluster_file_that_plans(tmp_path, capsys):
    """profile-hardware --toml on a CPU machine: its offload link (a memcpy, no catalogue name) is left for the
    loader to derive; it used to be written as 'host-memory', which --cluster then refused as an unknown link."""
    rc, _ = _run(["profile-hardware", "--out", str(tmp_path / "hw.json"), "--no-collectives",
                  "--toml", str(tmp_path / "here.toml")], capsys)
    cluster = parse_cluster(str(tmp_path / "here.toml"))
    assert rc == 0 and cluster.gpu_of(0).name == "cpu" and cluster.nodes[0].pcie.gbps > 0


def test_search_explains_choice_alternatives_and_rejections(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "4xRTX4090", "--seq", "64", "--global-batch", "8",
                    "--profile-cache", str(tmp_path)], capsys)
    assert rc == 0 and out.startswith("model ") and "\nchosen: dp" in out and "tokens/s" in out
    assert "peak memory per rank" in out
    assert "alternatives:" in out and "other families:" in out and "CUDA context" in out


def test_search_respects_fixed_parts_and_prints_json(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "4xRTX4090", "--seq", "64", "--global-batch", "8",
                    "--pp", "2", "--zero", "3", "--json", "--profile-cache", str(tmp_path)], capsys)
    d = json.loads(out)
    plan = Plan.from_dict(d)
    assert rc == 0 and plan.pp == 2 and plan.dp == 2 and all(b["zero"] == 3 for b in d["blocks"])
    assert d["predicted"]["fits"] and plan.global_batch == 8


def test_tensor_parallelism_is_searched_within_nodes_and_can_be_fixed(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "2x2xA100-80GB", "--seq", "64", "--global-batch", "8",
                    "--alternatives", "8", "--profile-cache", str(tmp_path)], capsys)
    assert rc == 0 and set(re.findall(r"x tp (\d+) x", out)) == {"2"}  # searched, and 2 GPUs a node: never tp 4
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "4xA100-80GB", "--seq", "64", "--global-batch", "8",
                    "--tp", "2", "--json", "--profile-cache", str(tmp_path)], capsys)
    d = json.loads(out)
    shape = d["shape"]
    assert rc == 0 and shape["tp"] == 2 and shape["dp"] * shape["pp"] == 2
    assert d["predicted"]["time_by_phase"]["tp_comm"] > 0


def test_nothing_fits_prints_advice_not_a_plan(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "2xRTX4090", "--seq", "64", "--memory-budget",
                    "100MiB", "--profile-cache", str(tmp_path)], capsys)
    assert rc == 2 and "nothing is chosen" in out and "smallest changes that fit" in out and "chosen:" not in out


def test_explain_bpipe_compares(tiny_model, tmp_path, capsys):
    rc, out = _run(["plan", "--model", tiny_model, "--cluster", "4xRTX4090", "--seq", "64", "--global-batch", "8",
                    "--pp", "4", "--explain-bpipe", "--profile-cache", str(tmp_path)], capsys)
    assert rc == 0 and "BPipe" in out and ("verdict" in out or "no BPipe plan" in out)


def test_plan_says_what_it_planned_with_transformers_exact_count(tmp_path, capsys):
    """A Hugging Face config.json alone: no --seq (its max_position_embeddings), exact parameter counts."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    count = transformers.LlamaForCausalLM(config).num_parameters()
    args = ["plan", "--model", str(tmp_path / "config.json"), "--cluster", "1xRTX4090", "--profile-cache", str(tmp_path)]
    rc, out = _run([*args, "--json"], capsys)
    model = json.loads(out)["model"]
    assert rc == 0 and model["parameters"] == model["trainable"] == count
    assert (model["blocks"], model["hidden"], model["vocabulary"]) == (2, 64, 1000)
    assert json.loads(out)["seq_len"] == 256
    rc, out = _run(args, capsys)
    assert out.splitlines()[0].startswith(f"model {tmp_path / 'config.json'}: {count:,} parameters")
    assert "seq 256: the model's maximum length" in out


def test_infeasible_plan_names_host_ram_when_it_binds_and_every_advised_change_fits(tmp_path, capsys):
    """Offload needs the host: with too little RAM the answer is more RAM, not only a larger GPU; and each
    change the advice names is a plan when planned with it."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps(ModelConfig(dim=2048, n_layers=24, n_heads=16, vocab_size=32000,
                                           max_seq_len=256).to_dict()))
    args = ["plan", "--model", str(path), "--cluster", "1xRTX3080", "--seq", "256", "--global-batch", "1",
            "--compile", "false", "--profile-cache", str(tmp_path)]  # eager: the compiled side is test_compile_choice's
    rc, out = _run([*args, "--host-ram", "8GiB"], capsys)
    advice = [a.strip() for a in out.split("smallest changes that fit:\n")[1].splitlines()]
    assert rc == 2 and advice[0].startswith("--host-ram ") and "(host RAM is the binding limit, 8 GiB per node)" in out
    suggested = advice[0].split()[1]
    assert 8 < int(suggested.removesuffix("GiB")) <= 32 and "GiB of host memory per node" in out
    assert len(advice) >= 3 and all("tokens/s" in a for a in advice), out
    for line in advice:  # the options a line names, then what it says of them
        flags = line.split(": fits as")[0].split(" (")[0].split()
        rc, out = _run([*args, "--host-ram", "8GiB", *flags], capsys)
        assert rc == 0 and "chosen:" in out, (line, out)
    rc, out = _run([*args, "--host-ram", "64GiB"], capsys)
    assert rc == 0 and ("parameter offload" in out or "optimizer offload" in out), out


def test_train_and_plan_share_one_option_set():
    """Every run-config key is the same option, with the same spellings, on both commands."""
    from snugfit.cli import build_parser
    from snugfit.config import all_keys

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))

    def spellings(command):
        return {a.dest: sorted(a.option_strings) for a in sub.choices[command]._actions if "." in a.dest}

    train, plan = spellings("train"), spellings("plan")
    assert train == plan and set(train) == set(all_keys())
    for key, alias in [("model.name", "--model"), ("train.seq_len", "--seq"), ("train.batch_size", "--global-batch"),
                       ("train.micro_batch_size", "--micro-batch"), ("train.dtype", "--dtype"),
                       ("finetune.lora_rank", "--lora-rank"), ("finetune.freeze", "--freeze"),
                       ("parallel.zero", "--zero"), ("train.seq_len", "--seq-len"), ("parallel.plan", "--plan-file")]:
        assert alias in train[key] and f"--{key}" in train[key]


def test_plan_reads_a_train_config_for_the_built_in_model(tmp_path, capsys):
    """`snugfit plan --config run.toml`: the built-in model of [model], [train] batch and seq, [parallel] fixed
    parts and ranks, no model JSON; options override the file as they do for `snugfit train`."""
    from snugfit.config import build_config

    (tmp_path / "run.toml").write_text('[model]\ndim = 64\nn_layers = 4\nn_heads = 4\n'
                                       '[train]\nseq_len = 64\nbatch_size = 8\n'
                                       '[parallel]\nnproc = 2\nzero = 3\n')
    rc, out = _run(["plan", "--config", str(tmp_path / "run.toml"), "--json", "--profile-cache", str(tmp_path)],
                   capsys)
    d = json.loads(out)
    count = build_config(str(tmp_path / "run.toml")).model.num_params()
    assert rc == 0 and d["model"]["parameters"] == d["model"]["trainable"] == count
    assert (d["model"]["name"], d["model"]["blocks"], d["model"]["hidden"]) == ("built-in llama", 4, 64)
    plan = Plan.from_dict(d)
    assert (plan.seq_len, plan.global_batch, plan.dp * plan.pp) == (64, 8, 2)
    assert {b["zero"] for b in [d["root"], *d["blocks"]]} == {3}
    rc, out = _run(["plan", "--config", str(tmp_path / "run.toml"), "--lora-rank", "4", "--pp", "2", "--json",
                    "--profile-cache", str(tmp_path)], capsys)
    d = json.loads(out)
    assert rc == 0 and d["shape"]["pp"] == 2 and d["model"]["parameters"] - d["model"]["trainable"] == count  # base frozen
    with pytest.raises(SnugfitError, match="--zero fixes a part of a searched plan"):
        _run(["plan", "--config", str(tmp_path / "run.toml"), "--plan", "dp"], capsys)


def test_long_context_qlora_fits_one_24gb_card_with_offloaded_checkpoints(tmp_path, capsys):
    """Llama-3.1-8B, NF4 base, LoRA r32, 64k tokens on one RTX 4090: the plan fits by keeping each block's
    saved activations on host (the chunked loss holds no whole logits); without that, 39 GiB. With the MLP in tiles
    (its intermediates never whole) the activations go to host without recomputation. Eager blocks: compiled ones
    save less for backward (the partitioner's choice), so some of them keep their activations."""
    rc, out = _run(["plan", "--model", "llama-3.1-8b", "--cluster", "1xRTX4090", "--seq", "65536", "--global-batch",
                    "1", "--lora-rank", "32", "--quantize-base", "nf4", "--compile", "false", "--json",
                    "--profile-cache", str(tmp_path)],
                   capsys)
    d = json.loads(out)
    assert rc == 0 and d["predicted"]["fits"] and d["predicted"]["peak_memory_bytes"] <= 24 * 2**30
    assert {(b["activations"], b.get("mlp_tiles", 1)) for b in d["blocks"]} == {("offload", 16)}


def test_planning_a_catalogue_model_prints_no_library_warnings(tmp_path):
    """transformers imports torchao where it is installed, which logged 'Failed to load ..._C_mxfp8...so' and torch's
    _pytree deprecations on every plan of a Hugging Face model, NF4 or not: filtered where snugfit imports them."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", "snugfit", "plan", "--model", "qwen2.5-0.5b", "--cluster",
                           "1xA100-80GB", "--seq", "256", "--global-batch", "1", "--lora-rank", "8",
                           "--profile-cache", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "chosen: dp 1 x pp 1" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr == ""


@pytest.mark.parametrize("targets", ["", "attn.q,attn.v", "all-linear"])
def test_lora_targets_are_planned_as_trained(targets, tmp_path, capsys):
    """`snugfit plan` profiles the adapters `snugfit train` builds: the plan's trainable count is the trained
    model's, fewer targets than the default (q, k, v, o) count fewer, all-linear (the MLP's too) more."""
    from snugfit.config import build_config
    from snugfit.model.lora import trainable_summary
    from snugfit.train.build import build_model

    (tmp_path / "run.toml").write_text('[model]\ndim = 64\nn_layers = 2\nn_heads = 4\n[train]\nseq_len = 32\n'
                                       f'[finetune]\nlora_rank = 4\nlora_targets = "{targets}"\n')
    rc, out = _run(["plan", "--config", str(tmp_path / "run.toml"), "--json", "--profile-cache", str(tmp_path)],
                   capsys)
    planned = json.loads(out)["model"]["trainable"]
    trained = trainable_summary(build_model(build_config(str(tmp_path / "run.toml"))))["total"]["trainable"]
    assert rc == 0 and planned == trained
    block_in, dim = 64, 64
    per_target = 4 * (block_in + dim)  # lora_a (r x in) + lora_b (out x r) of a dim x dim projection
    if targets == "attn.q,attn.v":
        assert planned == 2 * 2 * per_target
    elif targets == "":
        assert planned == 2 * 4 * per_target
    else:  # q, k, v, o and the MLP's gate, up, down (dim -> hidden -> dim)
        assert planned > 2 * 4 * per_target + 2 * 3 * 4 * dim


def test_a_lora_target_that_matches_nothing_is_the_train_error(tmp_path, capsys):
    """The same line as `snugfit train` gives (tests/test_bad_input.py), from the profile's apply_lora."""
    from snugfit.cli import main

    code = main(["plan", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq", "16", "--lora-rank", "2",
                 "--lora-targets", "attn.q,attn.qq", "--profile-cache", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: LoRA targets ['attn.qq'] match no layer; linear layers of a block:"), err
