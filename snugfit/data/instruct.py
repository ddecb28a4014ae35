"""Instruction data: prompt/response pairs -> fixed-length examples with the loss on the response only.

An example is (2, seq_len + 1) int64: row 0 the token ids (prompt, response,
EOS, then padding), row 1 the labels (the token id where the model should
learn it, -100 on the prompt and the padding). A batch is (B, 2, seq_len + 1);
the engine feeds inputs = b[:, 0, :-1] and targets = b[:, 1, 1:], so position j
learns token j+1 only where that token is part of a response (or its EOS).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from snugfit.data.dataset import BatchSampler
from snugfit.data.records import read_records
from snugfit.data.tokenizer import Tokenizer
from snugfit.errors import SnugfitError

IGNORE = -100
log = logging.getLogger(__name__)


def encode_example(prompt: list[int], response: list[int], seq_len: int, eos_id: int, pad_id: int) -> np.ndarray | None:
    """(2, seq_len + 1): ids and labels, truncated on the right; None when no response token fits."""
    return pack_example(prompt + response + [eos_id], [IGNORE] * len(prompt) + response + [eos_id], seq_len, pad_id)


def pack_example(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> np.ndarray | None:
    """(2, seq_len + 1): ids and labels truncated on the right and padded; None when no label is left to learn."""
    ids, labels = ids[: seq_len + 1], labels[: seq_len + 1]
    if all(t == IGNORE for t in labels[1:]):  # label 0 is never a target
        return None
    pad = seq_len + 1 - len(ids)
    return np.array([ids + [pad_id] * pad, labels + [IGNORE] * pad], dtype=np.int64)


def load_instruct(path: str | Path, tokenizer: Tokenizer, seq_len: int, prompt_field: str = "prompt",
                  response_field: str = "response", eos_id: int | None = None, pad_id: int | None = None) -> np.ndarray:
    """All examples of a .jsonl, .parquet or .arrow file as one (N, 2, seq_len + 1) array.

    eos_id defaults to the tokenizer's; pad_id to eos_id (padding is never
    learned, so its value only has to be a valid id). Examples whose prompt
    leaves no room for the response are dropped, and counted in the log.
    """
    eos = eos_id if eos_id is not None else tokenizer.eos_id
    if eos is None:
        raise SnugfitError("instruction data needs an end-of-sequence token: this tokenizer has none; set data.eos_id")
    pad = pad_id if pad_id is not None else eos
    p = Path(path)
    if not p.is_file():
        raise SnugfitError(f"instruction data {path} does not exist; pass a .jsonl, .parquet or .arrow file")

    def encode(where: str, rec) -> np.ndarray | None:
        try:
            prompt, response = rec[prompt_field], rec[response_field]
            return encode_example(tokenizer.encode(prompt), tokenizer.encode(response), seq_len, eos, pad)
        except (KeyError, TypeError) as e:
            raise SnugfitError(f"{where}: not a record with {prompt_field!r} and {response_field!r} strings ({e}); "
                               "fix it or set the field names") from e

    return stack_examples((encode(where, rec) for where, rec in read_records(p)), path, seq_len, "examples")


def stack_examples(packed: Iterable[np.ndarray | None], path: str | Path, seq_len: int, noun: str) -> np.ndarray:
    """(N, 2, seq_len + 1) from `pack_example` results; those with nothing to learn (None) are dropped and counted
    in the log, and a file left with none is a one-line error."""
    examples = list(packed)
    kept = [ex for ex in examples if ex is not None]
    if len(kept) < len(examples):
        log.warning("%s: %d %s dropped, nothing to learn within %d tokens", path, len(examples) - len(kept), noun,
                    seq_len)
    if not kept:
        raise SnugfitError(f"{path} holds no {noun} with anything to learn within {seq_len} tokens; "
                           "raise train.seq_len")
    return np.stack(kept)


class InstructSampler:
    """Deterministic, resumable sampler over examples, with BatchSampler's interface and order.

    The permutation, epochs, data-parallel slicing and resume position are
    BatchSampler's own: it runs over the stream 0, 1, ..., n with windows of
    one, whose first token is the index of the example to take.
    """

    def __init__(self, examples: np.ndarray, global_batch: int, seed: int, dp_rank: int = 0, dp: int = 1):
        self.examples = examples
        self._indices = BatchSampler(np.arange(len(examples) + 1), 1, global_batch, seed, dp_rank, dp)

    def next_batch(self) -> torch.Tensor:
        """This rank's (global_batch / dp, 2, seq_len + 1) slice of the next global batch."""
        rows = self._indices.next_batch()[:, 0].numpy()
        return torch.from_numpy(self.examples[rows])

    def state_dict(self) -> dict:
        return self._indices.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._indices.load_state_dict(state)


def instruct_eval_batches(examples: np.ndarray, batch: int, count: int) -> list[torch.Tensor]:
    """A fixed set of validation batches: the first examples, the same at every evaluation."""
    n = min(len(examples), batch * count) // batch * batch
    return [torch.from_numpy(examples[i : i + batch]) for i in range(0, n, batch)]
