"""The data users bring: the end-of-sequence token from the tokenizer's own config, Alpaca and ShareGPT records,
the counts of what was dropped or cut, and one validation set whatever the ranks."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from snugfit.config import RunConfig
from snugfit.data.instruct import IGNORE, load_instruct
from snugfit.data.tokenizer import ByteTokenizer, load_tokenizer
from snugfit.errors import SnugfitError
from snugfit.plan import Plan
from snugfit.train.build import RunData, build_data


def _word_tokenizer(folder, eos_token: str | None, config_eos_id: int | None = None):
    """A word-level tokenizer.json whose id 0 is "!" (as in Llama-3 and Qwen vocabularies) and whose EOS is
    "<|eos|>", named only by the folder's tokenizer_config.json (and, optionally, config.json's id)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    words = ["!", "<unk>", "<|eos|>", "</s>", "what", "is", "two", "plus", "four", "say", "hi", "yo", "and"]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(exist_ok=True)
    core.save(str(folder / "tokenizer.json"))
    if eos_token is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos_token}}))
    if config_eos_id is not None:
        (folder / "config.json").write_text(json.dumps({"eos_token_id": [config_eos_id, 3]}))
    return folder


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_end_of_sequence_token_is_the_one_the_tokenizer_config_names(tmp_path):
    tok = load_tokenizer(str(_word_tokenizer(tmp_path / "a", "<|eos|>")))
    assert tok.eos_id == 2 and tok.eos_source == "tokenizer_config.json"  # not "</s>" (3), not id 0
    assert "'<|eos|>' (id 2, from tokenizer_config.json)" in tok.describe()
    by_config = load_tokenizer(str(_word_tokenizer(tmp_path / "b", None, config_eos_id=2)))
    assert (by_config.eos_id, by_config.eos_source) == (2, "config.json")  # a list's first id
    guessed = load_tokenizer(str(_word_tokenizer(tmp_path / "c", None)))
    assert guessed.eos_id == 3  # no config names one: the conventional "</s>"


def test_an_instruct_run_ends_responses_with_the_tokenizer_s_own_eos(tmp_path, caplog):
    folder = _word_tokenizer(tmp_path / "tok", "<|eos|>")
    data = _write(tmp_path / "d.jsonl", [{"prompt": "what is two plus two", "response": "four"}] * 20)
    cfg = RunConfig()
    cfg.data.format, cfg.data.path, cfg.data.tokenizer = "instruct", str(data), str(folder)
    cfg.train.seq_len, cfg.train.batch_size = 8, 4
    with caplog.at_level(logging.INFO, logger="snugfit"):
        run = build_data(cfg, vocab_size=64)
    row = run.train[0]
    learned = row[1][row[1] != IGNORE].tolist()
    assert learned == [8, 2]  # "four" then <|eos|>, never id 0 ("!")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data:"))
    assert "20 examples read" in line and "'<|eos|>'" in line and "1 held out" in line
    assert "about 8 learned tokens a step (of 32 positions)" in line  # 2 learned tokens x batch 4


def test_a_vocabulary_without_an_eos_is_refused_for_instruct_data(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path / "noeos"
    folder.mkdir()
    Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    data = _write(tmp_path / "d.jsonl", [{"prompt": "a", "response": "a"}])
    with pytest.raises(SnugfitError, match="has none; use a tokenizer whose folder names its eos_token"):
        load_instruct(data, load_tokenizer(str(folder)), seq_len=8)


def test_alpaca_records_use_their_input(tmp_path):
    rows = [{"instruction": "say hi", "input": "and yo", "output": "hi yo"},
            {"instruction": "say hi", "input": "", "output": "hi"}]
    ex = load_instruct(_write(tmp_path / "a.jsonl", rows), ByteTokenizer(), seq_len=32, eos_id=3).rows
    text = [bytes(t for t, lab in zip(r[0], r[1]) if lab == IGNORE and t != 3).decode() for r in ex]
    assert text == ["say hi\n\nand yo\n\n", "say hi\n\n"]  # the prompts, unlearned
    assert [bytes(t for t in r[1] if t not in (IGNORE, 3)).decode() for r in ex] == ["hi yo", "hi"]
    with pytest.raises(SnugfitError, match="nor Alpaca's instruction/input/output"):
        load_instruct(_write(tmp_path / "b.jsonl", [{"instruction": "x"}]), ByteTokenizer(), seq_len=32, eos_id=3)


def test_dropped_and_truncated_examples_are_counted(tmp_path, caplog):
    rows = [{"prompt": "x" * 40, "response": "lost"},  # no room for the response: dropped
            {"prompt": "q", "response": "a long answer cut short"},  # cut mid-answer: kept, truncated
            {"prompt": "q", "response": "ok"}]
    with caplog.at_level(logging.WARNING):
        ex = load_instruct(_write(tmp_path / "t.jsonl", rows), ByteTokenizer(), seq_len=12, eos_id=3)
    assert (ex.read, ex.dropped, ex.truncated, len(ex)) == (3, 1, 1, 2)
    assert "3 examples read, 1 dropped (nothing to learn within 12 tokens), 1 truncated at 12 tokens" in caplog.text


def test_sharegpt_conversations_read_as_messages(tmp_path):
    pytest.importorskip("transformers")
    from snugfit.data.chat import _messages

    rec = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    assert _messages(rec, "messages", "x:1") == [{"role": "system", "content": "s"},
                                                 {"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": "a"}]
    with pytest.raises(SnugfitError, match=r"x:1: ShareGPT turn .* needs 'from'"):
        _messages({"conversations": [{"from": "robot", "value": "a"}]}, "messages", "x:1")


@pytest.mark.parametrize("instruct", [False, True])
def test_the_validation_set_is_the_same_whatever_the_data_parallel_ranks(instruct):
    """dp 2's two parts of each validation batch are dp 1's batch (the per-rank batch once sized it, so a
    checkpoint's validation loss differed between --nproc 1 and 2)."""
    val = (np.arange(40 * 2 * 9).reshape(40, 2, 9) if instruct else np.arange(400) % 256)
    data = RunData(val, val, instruct)
    one = data.eval_batches(Plan.uniform(2, dp=1, micro_batch_size=2, num_microbatches=4, seq_len=8), 3, 0)
    two = [data.eval_batches(Plan.uniform(2, dp=2, micro_batch_size=4, num_microbatches=1, seq_len=8), 3, r)
           for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) >= 2
    for whole, a, b in zip(one, *two):
        assert whole.shape[0] == 8 and torch.equal(torch.cat([a, b]), whole)
