"""Data: sources, tokenizers, the resumable sampler and its data-parallel slices."""

import json

import numpy as np
import pytest
import torch

from snugfit.data import BatchSampler, ByteTokenizer, eval_batches, load_tokenizer, load_tokens, split
from snugfit.errors import SnugfitError


def test_embedded_corpus_is_real_text():
    tokens = load_tokens("", "auto", ByteTokenizer())
    assert len(tokens) > 1_000_000
    assert b"def " in bytes(tokens[:200_000].astype(np.uint8))


def test_sources_text_folder_jsonl_bin(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello")
    (tmp_path / "d" / "b.md").write_text("world")
    assert bytes(load_tokens(str(tmp_path / "d"), "auto", tok).astype(np.uint8)) == b"hello\n\nworld"
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "cd"}) + "\n")
    assert bytes(load_tokens(str(tmp_path / "x.jsonl"), "auto", tok).astype(np.uint8)) == b"ab\n\ncd"
    ids = np.arange(1000, dtype=np.uint32) * 70
    ids.tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.bin"), "auto", tok, bin_dtype="uint32"), ids)


def test_bad_sources_are_clear_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(SnugfitError, match="does not exist"):
        load_tokens(str(tmp_path / "missing"), "auto", tok)
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(SnugfitError, match="bad.jsonl:1"):
        load_tokens(str(tmp_path / "bad.jsonl"), "auto", tok)
    with pytest.raises(SnugfitError, match="too few"):
        split(np.zeros(10, dtype=np.uint16), 16, 0.0, 256)
    with pytest.raises(SnugfitError, match="beyond the model's vocabulary"):
        split(np.array([1, 300] * 20, dtype=np.uint16), 8, 0.0, 256)


def test_hf_tokenizer_json_loads_locally(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.eos_id == 1
    ids = loaded.encode("def f(x):")
    assert loaded.decode(ids).strip() == "def f(x):"
    with pytest.raises(SnugfitError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_sampler_is_deterministic_and_resumable():
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    a = BatchSampler(tokens, 16, 8, seed=3)
    seq = [a.next_batch() for _ in range(5)]
    b = BatchSampler(tokens, 16, 8, seed=3)
    [b.next_batch() for _ in range(2)]
    c = BatchSampler(tokens, 16, 8, seed=3)
    c.load_state_dict(b.state_dict())
    for want in seq[2:]:
        torch.testing.assert_close(c.next_batch(), want)
    assert not torch.equal(BatchSampler(tokens, 16, 8, seed=4).next_batch(), seq[0])


def test_sampler_epochs_cover_every_window_once():
    tokens = np.arange(16 * 10 + 1, dtype=np.uint16)
    s = BatchSampler(tokens, 16, 5, seed=0)
    starts = sorted(int(row[0]) for _ in range(2) for row in s.next_batch())
    assert starts == [16 * i for i in range(10)]


def test_data_parallel_slices_union_to_the_global_batch():
    tokens = np.arange(5000, dtype=np.uint16) % 256
    whole = BatchSampler(tokens, 8, 12, seed=1).next_batch()
    parts = [BatchSampler(tokens, 8, 12, seed=1, dp_rank=r, dp=4).next_batch() for r in range(4)]
    torch.testing.assert_close(torch.cat(parts), whole)


def test_eval_batches_fixed():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    a, b = eval_batches(tokens, 16, 4, 3), eval_batches(tokens, 16, 4, 3)
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
