"""Data: tokenizers, token streams from local files or the embedded corpus, the resumable sampler."""

from snugfit.data.dataset import BatchSampler, Splits, eval_batches, load_tokens, split
from snugfit.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["BatchSampler", "ByteTokenizer", "Splits", "eval_batches", "load_tokenizer", "load_tokens", "split"]
