"""Instruction data: masking, padding, truncation, the loss on responses only, the resumable sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snugfit.data.instruct import IGNORE, InstructSampler, encode_example, instruct_eval_batches, load_instruct
from snugfit.data.tokenizer import ByteTokenizer
from snugfit.errors import SnugfitError
from snugfit.model.decoder import Decoder, ModelConfig

EOS = 3


def write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_encode_masks_prompt_and_padding():
    ex = encode_example([10, 11, 12], [20, 21], seq_len=8, eos_id=EOS, pad_id=0)
    assert ex.tolist() == [[10, 11, 12, 20, 21, EOS, 0, 0, 0],
                           [IGNORE, IGNORE, IGNORE, 20, 21, EOS, IGNORE, IGNORE, IGNORE]]
    cut = encode_example([10, 11, 12], [20, 21, 22, 23], seq_len=4, eos_id=EOS, pad_id=0)
    assert cut.tolist() == [[10, 11, 12, 20, 21], [IGNORE] * 3 + [20, 21]]  # truncated: no EOS
    assert encode_example(list(range(10)), [1], seq_len=8, eos_id=EOS, pad_id=0) is None


def test_load_fields_and_errors(tmp_path):
    path = write(tmp_path, [{"q": "hi", "a": "yo"}, {"q": "x" * 50, "a": "lost"}])
    ex = load_instruct(path, ByteTokenizer(), seq_len=16, prompt_field="q", response_field="a", eos_id=EOS).rows
    assert ex.shape == (1, 2, 17)  # the second prompt fills the window: dropped
    assert ex[0, 1, :2].tolist() == [IGNORE, IGNORE] and ex[0, 1, 2:5].tolist() == [ord("y"), ord("o"), EOS]
    with pytest.raises(SnugfitError, match="end-of-sequence"):
        load_instruct(path, ByteTokenizer(), seq_len=16)
    with pytest.raises(SnugfitError, match=r"data.jsonl:1: .*'prompt'"):
        load_instruct(path, ByteTokenizer(), seq_len=16, eos_id=EOS)


def test_loss_equals_manual_masked_ce(tmp_path):
    rows = [{"prompt": f"question {i}?", "response": "answer " * (i % 3 + 1)} for i in range(6)]
    ex = load_instruct(write(tmp_path, rows), ByteTokenizer(), seq_len=40, eos_id=EOS).rows
    b = torch.from_numpy(ex[:4])
    torch.manual_seed(0)
    model = Decoder(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=256, max_seq_len=48))
    inputs, targets = b[:, 0, :-1], b[:, 1, 1:]  # the engine's convention
    loss = model(inputs, targets)
    logits, ids = model(inputs), b[:, 0, 1:]
    keep = targets != IGNORE
    manual = F.cross_entropy(logits[keep], ids[keep])
    assert torch.allclose(loss, manual, rtol=1e-6)
    assert keep.sum() == sum(len(r["response"]) + 1 for r in rows[:4])  # responses + EOS, nothing else


def test_sampler_is_deterministic_resumable_and_splits_over_ranks():
    examples = np.arange(10 * 2 * 5).reshape(10, 2, 5)
    whole = InstructSampler(examples, global_batch=4, seed=7)
    first = [whole.next_batch() for _ in range(3)]  # crosses an epoch (10 examples)
    assert first[0].shape == (4, 2, 5)
    ids = torch.cat([b[:, 0, 0] for b in first[:2]]) // 10
    assert len(set(ids[:8].tolist())) == 8  # no repeats within an epoch
    resumed = InstructSampler(examples, global_batch=4, seed=7)
    resumed.load_state_dict({"consumed": 4})
    assert torch.equal(resumed.next_batch(), first[1])
    ranks = [InstructSampler(examples, 4, 7, dp_rank=r, dp=2) for r in range(2)]
    assert torch.equal(torch.cat([s.next_batch() for s in ranks]), first[0])
    assert len(instruct_eval_batches(examples, batch=4, count=5)) == 2
