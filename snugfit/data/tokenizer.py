"""Tokenizers: bytes (no files, vocab 256) or a local Hugging Face tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from snugfit.errors import SnugfitError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def describe(self) -> str:
        """One line naming the tokenizer and its end-of-sequence token (the run's data line)."""


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

    def describe(self) -> str:
        return "bytes (256 tokens, no end-of-sequence token)"


# Where a folder names its end-of-sequence token, most specific first: the tokenizer's own config (the token
# transformers' tokenizer uses), then the model's generation and model configs (the id generation stops on)
EOS_SOURCES = ("tokenizer_config.json", "generation_config.json", "config.json")
# Vocabularies whose folder names no end-of-sequence token: the token strings they use by convention
EOS_STRINGS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """A local tokenizer.json loaded through the `tokenizers` library (never downloaded). Its end-of-sequence
    token comes from the folder's own configs (EOS_SOURCES), as transformers reads it: a Llama-3 or Qwen
    vocabulary's EOS is none of the conventional strings, and guessing wrong ends every response with another
    token (id 0 is "!" there), so a fine-tuned model never stops."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise SnugfitError(f"cannot read tokenizer {path}: {e}; pass a valid tokenizer.json or 'byte'") from e
        self.path = path
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id, self.eos_source = self._find_eos(path.parent)

    def _find_eos(self, folder: Path) -> tuple[int | None, str]:
        """(id, where it was named) of the end-of-sequence token; (None, "") where nothing names one."""
        for name in EOS_SOURCES:
            try:
                conf = json.loads((folder / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if name == "tokenizer_config.json":
                token = conf.get("eos_token")
                token = token.get("content") if isinstance(token, dict) else token
                found = self._tok.token_to_id(token) if isinstance(token, str) else None
            else:
                ids = conf.get("eos_token_id")
                found = ids[0] if isinstance(ids, list) and ids else ids
            if isinstance(found, int) and 0 <= found < self.vocab_size:
                return found, name
        for token in EOS_STRINGS:
            if self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token), f"the vocabulary's {token!r}"
        return None, ""

    def describe(self) -> str:
        eos = (f"end of sequence {self._tok.id_to_token(self.eos_id)!r} (id {self.eos_id}, from {self.eos_source})"
               if self.eos_id is not None else "no end-of-sequence token")
        return f"{self.path} ({self.vocab_size} tokens, {eos})"

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
