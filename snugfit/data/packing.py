"""Sequence packing: short examples put together into full sequences, their boundaries kept.

Padded to seq_len, a set of short chat or instruction examples spends most of each step on padding. Packed, each
row of (3, seq_len + 1) holds several whole examples one after another:

    row 0  token ids      the examples' ids, then padding
    row 1  labels         each example's own (IGNORE where it is not learned); its first is IGNORE, as an example's
                          first label is never a target unpacked, so no token learns the next example's first
    row 2  document ids   1, 2, ... per example, 0 on the padding

The model restarts positions at each document and lets no token attend across a document edge (model.decoder
`document_positions`, `document_mask`; model.hf_model for Hugging Face layers), so each example's loss is what it
would be alone. Examples are placed best-fit in decreasing length: a sequence takes the longest examples first, the
short ones fill the gaps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from snugfit.data.instruct import IGNORE

DOCS = 2  # the row of a packed example that holds the document ids


@dataclass
class Packed:
    """Packed rows (M, 3, seq_len + 1) and what packing did, for the run's data line."""

    rows: np.ndarray
    examples: int  # examples in the rows
    tokens: int  # their tokens (all positions but padding)

    @property
    def ratio(self) -> float:
        """Examples per sequence: how many times fewer steps an epoch takes than unpacked."""
        return self.examples / max(len(self.rows), 1)

    @property
    def padding(self) -> float:
        """The share of positions that are padding."""
        return 1 - self.tokens / max(self.rows.shape[0] * self.rows.shape[-1], 1)


def bins(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Example indices per sequence: best fit, longest first (each goes where it leaves the least room)."""
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))  # stable: ties keep the file's order
    out: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, sequence), sorted
    for i in order:
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(out)
            out.append([])
        out[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return out


def pack(rows: np.ndarray, lengths: np.ndarray, pad_id: int) -> Packed:
    """Padded examples (N, 2, seq_len + 1) whose first `lengths` positions are real -> packed rows (M, 3, seq_len +
    1) (see the module docstring)."""
    capacity = rows.shape[-1]
    groups = bins(lengths, capacity)
    out = np.full((len(groups), 3, capacity), IGNORE, dtype=np.int64)
    out[:, 0] = pad_id
    out[:, DOCS] = 0
    for r, group in enumerate(groups):
        at = 0
        for doc, i in enumerate(group, start=1):
            n = int(lengths[i])
            out[r, :2, at:at + n] = rows[i, :, :n]
            out[r, 1, at] = IGNORE
            out[r, DOCS, at:at + n] = doc
            at += n
    return Packed(out, len(rows), int(lengths.sum()))
