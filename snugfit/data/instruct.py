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
from dataclasses import dataclass
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
    return pack_example(*response_pair(prompt, response, eos_id), seq_len, pad_id)


def response_pair(prompt: list[int], response: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of one prompt/response example: the loss on the response and its EOS only."""
    return prompt + response + [eos_id], [IGNORE] * len(prompt) + response + [eos_id]


def pack_example(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> np.ndarray | None:
    """(2, seq_len + 1): ids and labels truncated on the right and padded; None when no label is left to learn."""
    ids, labels = ids[: seq_len + 1], labels[: seq_len + 1]
    if all(t == IGNORE for t in labels[1:]):  # label 0 is never a target
        return None
    pad = seq_len + 1 - len(ids)
    return np.array([ids + [pad_id] * pad, labels + [IGNORE] * pad], dtype=np.int64)


@dataclass
class Examples:
    """A file's examples as one (N, 2, seq_len + 1) array, and what reading them did (for the run's data line)."""

    rows: np.ndarray
    lengths: np.ndarray  # each row's real positions (the rest is padding): what packing places
    pad_id: int
    read: int  # records in the file
    dropped: int  # nothing to learn within seq_len
    truncated: int  # kept, but cut on the right: what was cut is not learned
    noun: str = "examples"

    def __len__(self) -> int:
        return len(self.rows)

    def describe(self, seq_len: int) -> str:
        """'200 examples read, 125 dropped (nothing to learn within 34 tokens), 75 truncated at 34 tokens'."""
        parts = [f"{self.read} {self.noun} read"]
        if self.dropped:
            parts.append(f"{self.dropped} dropped (nothing to learn within {seq_len} tokens)")
        if self.truncated:
            parts.append(f"{self.truncated} truncated at {seq_len} tokens")
        return ", ".join(parts)


def stack_examples(pairs: Iterable[tuple[list[int], list[int]]], path: str | Path, seq_len: int, pad_id: int,
                   noun: str) -> Examples:
    """The (ids, labels) pairs packed to seq_len + 1 (`pack_example`), those with nothing to learn dropped and
    those cut on the right counted; a file left with none is a one-line error."""
    kept, lengths, read, truncated = [], [], 0, 0
    for ids, labels in pairs:
        read += 1
        row = pack_example(ids, labels, seq_len, pad_id)
        if row is not None:
            kept.append(row)
            lengths.append(min(len(ids), seq_len + 1))
            truncated += len(ids) > seq_len + 1
    if not kept:
        raise SnugfitError(f"{path} holds no {noun} with anything to learn within {seq_len} tokens; "
                           "raise train.seq_len")
    out = Examples(np.stack(kept), np.array(lengths), pad_id, read, read - len(kept), truncated, noun)
    if out.dropped or out.truncated:
        log.warning("%s: %s; raise train.seq_len to keep them whole", path, out.describe(seq_len))
    return out


# Alpaca's records (instruction, optional input, output): the prompt is the instruction, then the input after a
# blank line where there is one, then a blank line before the response
ALPACA = ("instruction", "input", "output")


def _prompt_response(rec: object, prompt_field: str, response_field: str) -> tuple[str, str]:
    """A record's (prompt, response): the configured fields, or Alpaca's instruction/input/output."""
    if isinstance(rec, dict) and prompt_field not in rec and "instruction" in rec and "output" in rec:
        extra = rec.get("input") or ""
        if not isinstance(extra, str):
            raise TypeError("'input' is not a string")
        return rec["instruction"] + (f"\n\n{extra}" if extra else "") + "\n\n", rec["output"]
    return rec[prompt_field], rec[response_field]


def load_instruct(path: str | Path, tokenizer: Tokenizer, seq_len: int, prompt_field: str = "prompt",
                  response_field: str = "response", eos_id: int | None = None, pad_id: int | None = None) -> Examples:
    """All examples of a .jsonl, .parquet or .arrow file: records with the prompt and response fields, or Alpaca's
    instruction/input/output.

    eos_id defaults to the tokenizer's; pad_id to eos_id (padding is never
    learned, so its value only has to be a valid id). Examples whose prompt
    leaves no room for the response are dropped, and counted in the log.
    """
    eos = eos_id if eos_id is not None else tokenizer.eos_id
    if eos is None:
        raise SnugfitError(f"instruction data needs an end-of-sequence token, and the tokenizer "
                           f"{tokenizer.describe()} has none; use a tokenizer whose folder names its eos_token "
                           "(tokenizer_config.json)")
    pad = pad_id if pad_id is not None else eos
    p = Path(path)
    if not p.is_file():
        raise SnugfitError(f"instruction data {path} does not exist; pass a .jsonl, .parquet or .arrow file")

    def encode(where: str, rec) -> tuple[list[int], list[int]]:
        try:
            prompt, response = _prompt_response(rec, prompt_field, response_field)
            return response_pair(tokenizer.encode(prompt), tokenizer.encode(response), eos)
        except (KeyError, TypeError) as e:
            raise SnugfitError(f"{where}: not a record with {prompt_field!r} and {response_field!r} strings, nor "
                               f"Alpaca's {'/'.join(ALPACA)} ({e}); fix it or set the field names") from e

    return stack_examples((encode(where, rec) for where, rec in read_records(p)), path, seq_len, pad, "examples")


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
