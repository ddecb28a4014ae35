"""Chat data: {"messages": [{"role": ..., "content": ...}, ...]} records (or ShareGPT's {"conversations": [{"from",
"value"}, ...]}) rendered with the model's own chat template, with the loss on the assistant turns only.

The template is the model folder's (tokenizer_config.json `chat_template`), applied through transformers'
tokenizer, offline. Which tokens belong to an assistant turn is found by rendering the conversation up to
each assistant message twice: once ending in the generation prompt (where the assistant starts) and once
through that message (where its turn ends, end-of-turn tokens included). Everything in between is learned;
system, user and tool turns and the template's own headers are not. This needs nothing from the template
(most have no `{% generation %}` markers) but that rendering a prefix of a conversation gives a prefix of its
tokens, which is checked.
"""

from __future__ import annotations

import os
from pathlib import Path

from snugfit.data.instruct import IGNORE, Examples, stack_examples
from snugfit.data.records import read_records
from snugfit.errors import SnugfitError
from snugfit.quiet import quiet_imports

ROLES = ("system", "user", "assistant", "tool")


def chat_tokenizer(folder: Path):
    """The folder's transformers tokenizer, with its chat template; read locally, never downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with quiet_imports():
            from transformers import AutoTokenizer
    except ImportError as e:
        raise SnugfitError("chat data needs transformers: pip install -e \".[hf]\"") from e
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise SnugfitError(f"cannot load the tokenizer of {folder}: {e}; point data.tokenizer at a local model "
                           "folder with tokenizer.json and tokenizer_config.json") from e
    if not getattr(tok, "chat_template", None):
        raise SnugfitError(f"{folder} has no chat template (tokenizer_config.json 'chat_template'); use a model "
                           "folder that has one, or prompt/response data (data.format = 'instruct')")
    return tok


def _render(tok, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def encode_chat(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation: labels are the ids on assistant turns and IGNORE elsewhere."""
    ids = _render(tok, messages)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tok, messages[:i], generation_prompt=True) if i else []
        end = _render(tok, messages[: i + 1])
        if ids[: len(end)] != end or end[: len(start)] != start:
            raise SnugfitError(f"{where}: the chat template does not render a conversation's beginning as the "
                               "beginning of its tokens, so assistant turns cannot be found; use prompt/response "
                               "data (data.format = 'instruct')")
        labels[len(start):len(end)] = end[len(start):]
    return ids, labels


# ShareGPT's conversations: {"conversations": [{"from": "human" | "gpt" | ..., "value": ...}]}, read as messages
SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_response": "tool", "observation": "tool"}


def _sharegpt(turns: list, where: str) -> list[dict]:
    out = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from")) if isinstance(t, dict) else None
        if role is None or not isinstance(t.get("value"), str):
            raise SnugfitError(f"{where}: ShareGPT turn {t!r} needs 'from' in {sorted(SHAREGPT_ROLES)} and a string "
                               "'value'; fix the record")
        out.append({"role": role, "content": t["value"]})
    return out


def _messages(record: object, field: str, where: str) -> list[dict]:
    """A record's messages: `field`'s {role, content} list, or ShareGPT's {from, value} conversations."""
    messages = record.get(field) if isinstance(record, dict) else None
    if messages is None and isinstance(record, dict) and isinstance(record.get(SHAREGPT_FIELD), list):
        messages = _sharegpt(record[SHAREGPT_FIELD], where)
    if not isinstance(messages, list) or not messages:
        raise SnugfitError(f"{where}: no {field!r} list of messages; each record needs "
                           f"{{\"{field}\": [{{\"role\": ..., \"content\": ...}}, ...]}} (or set "
                           f"data.messages_field), or ShareGPT's {{\"{SHAREGPT_FIELD}\": [{{\"from\": ..., "
                           "\"value\": ...}}, ...]}}")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise SnugfitError(f"{where}: message {m!r} needs a role in {ROLES} and a string content; fix the record")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_chat(path: str | Path, folder: Path, seq_len: int, field: str = "messages") -> Examples:
    """All conversations of a .jsonl, .parquet or .arrow file in instruct's layout; conversations with no
    assistant token within seq_len are dropped, and counted in the log."""
    p = Path(path)
    if not p.is_file():
        raise SnugfitError(f"chat data {path} does not exist; pass a .jsonl, .parquet or .arrow file")
    tok = chat_tokenizer(folder)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    pairs = (encode_chat(tok, _messages(record, field, where), where) for where, record in read_records(p))
    return stack_examples(pairs, path, seq_len, pad, "conversations")
