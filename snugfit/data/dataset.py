"""Token streams from local data, and a deterministic, resumable batch sampler.

Sources: the embedded corpus (the Python standard library's own source, on
every machine, no download), a text file or a folder of them, a `.jsonl`,
`.parquet` or `.arrow` file with a text field, or a pre-tokenized uint16/uint32
`.bin` memmap.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from snugfit.data.records import TABLE_SUFFIXES, read_records
from snugfit.data.tokenizer import ByteTokenizer, Tokenizer
from snugfit.errors import SnugfitError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
EMBEDDED_CORPUS_BYTES = 4_000_000  # about 4 MB of stdlib source: enough for a small model, read in ~0.1 s


def embedded_corpus() -> list[str]:
    """The Python standard library's top-level modules, sorted by name: real text on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        size += len(text)
        if size >= EMBEDDED_CORPUS_BYTES:
            break
    if not docs:
        raise SnugfitError(f"no Python sources under {stdlib} for the embedded corpus; pass --data.path")
    return docs


def _read_documents(path: Path, fmt: str, text_field: str) -> list[str]:
    if fmt == "jsonl":  # records: .jsonl lines, .parquet or .arrow rows
        docs = []
        for where, rec in read_records(path):
            text = rec.get(text_field) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise SnugfitError(f"{where}: not a record with a {text_field!r} string; fix it or set data.text_field")
            docs.append(text)
        return docs
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise SnugfitError(f"folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)}); point data.path at your data")
        return [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return [path.read_text(encoding="utf-8", errors="replace")]


def tokenize(docs: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate documents, separated by EOS (or a blank line for tokenizers without one)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_array("\n\n".join(docs))
    sep = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n\n")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        ids.extend(sep)
    return np.asarray(ids, dtype=np.uint32 if tokenizer.vocab_size > 65535 else np.uint16)


def detect_format(path: Path) -> str:
    if path.suffix in (".jsonl", *TABLE_SUFFIXES):
        return "jsonl"
    if path.suffix == ".bin":
        return "bin"
    return "text"


def load_tokens(path: str, fmt: str, tokenizer: Tokenizer, text_field: str = "text", bin_dtype: str = "uint16") -> np.ndarray:
    """All tokens of the data set as one 1-D array (a memmap for .bin files)."""
    if not path:
        return tokenize(embedded_corpus(), tokenizer)
    p = Path(path)
    if not p.exists():
        raise SnugfitError(f"data path {path!r} does not exist; pass an existing file or folder, or leave data.path empty for the embedded corpus")
    fmt = detect_format(p) if fmt == "auto" else fmt
    if fmt == "bin":
        if p.stat().st_size == 0:
            raise SnugfitError(f"data file {path} is empty; pass a file with tokens")
        if p.stat().st_size % np.dtype(bin_dtype).itemsize:
            raise SnugfitError(f"data file {path} is not a whole number of {bin_dtype} tokens; set data.bin_dtype to the dtype it was written in")
        return np.memmap(p, dtype=bin_dtype, mode="r")
    try:
        return tokenize(_read_documents(p, fmt, text_field), tokenizer)
    except (OSError, UnicodeError) as e:
        raise SnugfitError(f"cannot read data {path}: {e}; check the path and permissions") from e


@dataclass
class Splits:
    train: np.ndarray
    val: np.ndarray


def split(tokens: np.ndarray, seq_len: int, val_fraction: float, vocab_size: int) -> Splits:
    """The last val_fraction of the stream is validation; both must hold whole sequences."""
    need = seq_len + 1
    n_val = int(len(tokens) * val_fraction) if val_fraction > 0 else 0
    if n_val and n_val < need:
        n_val = need
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    if len(train) < need:
        raise SnugfitError(
            f"the corpus has {len(tokens)} tokens, too few for one training sequence of {need}; "
            "add data or lower train.seq_len"
        )
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise SnugfitError(
            f"token id {top} in the data is beyond the model's vocabulary ({vocab_size}); "
            "set model.vocab_size above it or use the matching tokenizer"
        )
    return Splits(train=train, val=val)


class BatchSampler:
    """Non-overlapping windows of seq_len+1 tokens, shuffled per epoch from (seed, epoch).

    The position is one number, the count of sequences consumed, so resuming
    from a checkpoint continues the exact same stream. Each step draws the
    global batch; a data-parallel rank keeps its contiguous slice of it, so the
    union over ranks is what a single process would have seen.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, dp_rank: int = 0, dp: int = 1):
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.seed, self.dp_rank, self.dp = seed, dp_rank, dp
        self.n_windows = (len(tokens) - 1) // seq_len
        self.consumed = 0
        self._epoch, self._order = -1, None

    def _window(self, i: int) -> np.ndarray:
        epoch, j = divmod(i, self.n_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        start = int(self._order[j]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def next_batch(self) -> torch.Tensor:
        """This rank's (global_batch / dp, seq_len + 1) slice of the next global batch."""
        per_rank = self.global_batch // self.dp
        first = self.consumed + self.dp_rank * per_rank
        rows = [self._window(first + k) for k in range(per_rank)]
        self.consumed += self.global_batch
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def eval_batches(tokens: np.ndarray, seq_len: int, batch: int, count: int) -> list[torch.Tensor]:
    """A fixed set of validation batches: the first windows of the split, same at every evaluation."""
    n = (len(tokens) - 1) // seq_len
    rows = [np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in range(min(n, batch * count))]
    return [torch.from_numpy(np.stack(rows[i : i + batch])) for i in range(0, len(rows) - batch + 1, batch)]
