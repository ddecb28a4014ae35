"""Tokenizers: bytes (no files, vocab 256) or a local Hugging Face tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from snugfit.errors import SnugfitError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no files and no download."""

    vocab_size = 256
    eos_id = None  # documents are separated by a blank line instead

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local tokenizer.json loaded through the `tokenizers` library (never downloaded)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise SnugfitError(f"cannot read tokenizer {path}: {e}; pass a valid tokenizer.json or 'byte'") from e
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next(
            (self._tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>") if self._tok.token_to_id(t) is not None),
            None,
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte', a tokenizer.json file, or a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise SnugfitError(
            f"tokenizer {spec!r} not found: pass 'byte' or the path of a local tokenizer.json (nothing is downloaded)"
        )
    return HFTokenizer(path)
