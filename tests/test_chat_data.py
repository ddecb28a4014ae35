"""Chat data: conversations rendered with the model folder's own chat template, the loss on assistant turns only;
.parquet and .arrow files give what .jsonl gives. The tokenizer and template are built here: nothing is downloaded."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from snugfit.data.chat import chat_tokenizer, encode_chat, load_chat  # noqa: E402
from snugfit.data.instruct import IGNORE  # noqa: E402
from snugfit.errors import SnugfitError  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "hello how are you fine thanks and what is two plus equals four the answer".split()
CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you"},
     {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four is the answer"}],
    [{"role": "user", "content": "two plus two equals"}, {"role": "assistant", "content": "four"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny local tokenizer (word level) with a ChatML template, as a model folder holds it."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + ["system", "user", "assistant", "be", "brief", *WORDS, "\n"])}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                  pre_tokenizers.WhitespaceSplit()])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    path = tmp_path_factory.mktemp("chat_model")
    tok.save_pretrained(str(path))
    return path


def test_rendered_ids_are_the_templates_and_only_assistant_turns_are_learned(folder):
    tok = chat_tokenizer(folder)
    ids, labels = encode_chat(tok, CONVERSATIONS[0], "test")
    assert ids == list(tok.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=False))
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    assert learned.split() == "fine thanks <|im_end|> four is the answer <|im_end|>".split()
    assert all(lab in (IGNORE, t) for t, lab in zip(ids, labels))
    assert "<unk>" not in tok.decode(ids)  # every word is in the vocabulary: the test reads what it means


def test_parquet_and_arrow_give_what_jsonl_gives(folder, tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    table = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    want = load_chat(jsonl, folder, seq_len=24).rows
    assert want.shape == (2, 2, 25)
    for path in (tmp_path / "chat.parquet", arrow):
        np.testing.assert_array_equal(load_chat(path, folder, seq_len=24).rows, want)


@pytest.mark.parametrize("line, match", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, r"chat\.jsonl:2: message .* needs a role"),
    ({"text": "hi"}, r"chat\.jsonl:2: no 'messages' list"),
])
def test_a_bad_record_is_one_line_naming_it(folder, tmp_path, line, match):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(SnugfitError, match=match):
        load_chat(path, folder, seq_len=24)


def test_a_folder_without_a_template_is_refused(folder, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    with pytest.raises(SnugfitError, match="has no chat template"):
        chat_tokenizer(plain)


def test_training_on_chat_data_learns_the_assistant_turns(folder, tmp_path):
    from snugfit.config import build_config
    from snugfit.train.loop import train

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) + "\n" for i in range(40)))
    cfg = build_config(None, {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "seq_len": 32,
                              "max_seq_len": 32, "batch_size": 8, "steps": 30, "lr": 0.01, "warmup_steps": 2,
                              "eval_every": 0, "checkpoint_every": 0, "progress": False,
                              "plot": False, "out_dir": str(tmp_path / "run"), "data.path": str(path),
                              "data.format": "chat", "data.tokenizer": str(folder), "val_fraction": 0.1})
    result = train(cfg)
    assert result.losses[30] < 0.25 * result.losses[1]  # the labels are the assistant turns only
