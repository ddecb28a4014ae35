"""Models by hub id from the local Hugging Face cache, GPT-2 folders planned, and an export that stands alone:
the tokenizer and generation config beside the weights, never written over a folder that holds files, its base
found where it moved and refused where it changed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from snugfit.cli import main  # noqa: E402
from snugfit.config import build_config  # noqa: E402
from snugfit.errors import SnugfitError  # noqa: E402
from snugfit.train.export import export_checkpoint  # noqa: E402
from snugfit.train.loop import train  # noqa: E402
from tests.test_train import tiny  # noqa: E402

HUB_ID = "some-org/tiny-llama"
WORDS = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(61)]]


def _tiny_llama(folder):
    """A tiny Llama with its own word-level tokenizer and chat template, as `save_pretrained` writes them."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The model put into a Hugging Face cache folder in the layout huggingface_hub writes (refs/main naming a
    snapshot), that cache made the library's, and the hub offline."""
    import huggingface_hub.constants as hub

    root = tmp_path / "hub"
    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    _tiny_llama(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / commit


def _data(tmp_path):
    rows = [{"prompt": f"w{i % 7} w{i % 5}", "response": f"w{(i * 3) % 11}"} for i in range(30)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_hub_id_from_the_local_cache_plans_trains_and_exports(hub_cache, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["plan", "--model", HUB_ID, "--seq", "16", "--global-batch", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == str(hub_cache)
    cfg = tiny(tmp_path / "run", **{"model.name": HUB_ID, "lora_rank": 4, "format": "instruct",
                                    "path": _data(tmp_path), "steps": 2, "seq_len": 16, "val_fraction": 0.2})
    assert cfg.model.name == str(hub_cache)  # resolved once, recorded as a path
    train(cfg)
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002", tmp_path / "exported")
    tok = AutoTokenizer.from_pretrained(out)  # the base's tokenizer, chat template and generation config came along
    assert tok.eos_token == "</s>" and tok.chat_template and (out / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok("w1 w2", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)


def test_a_hub_id_missing_from_the_cache_is_one_line(hub_cache, tmp_path, capsys):
    assert main(["train", "--model", "other-org/absent", "--steps", "1", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'other-org/absent' is not in the local Hugging Face cache" in err
    assert main(["plan", "--model", "other-org/absent"]) == 2
    assert "is not in the local Hugging Face cache" in capsys.readouterr().err
    from snugfit.model.catalogue import resolve_model

    assert resolve_model("meta-llama/Llama-3.1-8B").n_layers == 32  # uncached: the catalogue's shape
    assert build_config(None, {"model.name": "other-org/absent"}).model.name == "other-org/absent"


def test_a_gpt2_folder_plans(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    assert main(["plan", "--model", str(tmp_path / "gpt2"), "--seq", "32", "--global-batch", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["blocks"]) == 3


def test_export_refuses_a_full_folder_finds_a_moved_base_and_refuses_a_changed_one(tmp_path):
    base = _tiny_llama(tmp_path / "base")
    cfg = tiny(tmp_path / "run", **{"model.name": str(base), "lora_rank": 4, "format": "instruct",
                                    "path": _data(tmp_path), "steps": 2, "seq_len": 16, "val_fraction": 0.2})
    train(cfg)
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(SnugfitError, match="already holds files; export into a new or empty folder"):
        export_checkpoint(step, full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    moved = tmp_path / "moved"
    shutil.move(base, moved)
    with pytest.raises(SnugfitError, match="is not there .moved.*--model"):
        export_checkpoint(step, tmp_path / "a")
    first = export_checkpoint(step, tmp_path / "a", base=str(moved))
    assert (first / "tokenizer.json").is_file()
    export_checkpoint(step, first, base=str(moved), overwrite=True)  # replaced whole, on request
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(SnugfitError, match="is not the one checkpoint .* was trained from"):
        export_checkpoint(step, tmp_path / "b", base=str(moved))
    assert not (tmp_path / "b").exists()
