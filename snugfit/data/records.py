"""Records (one dict per example) from a local .jsonl, .parquet or .arrow file.

Parquet and Arrow go through the `datasets` library, offline: it reads the local file and downloads
nothing (extra: data). Each record comes with where it is, so a bad one is named in the error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from snugfit.errors import SnugfitError

TABLE_SUFFIXES = (".parquet", ".arrow")


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of the file; a .jsonl line that is not JSON is a one-line error."""
    if path.suffix in TABLE_SUFFIXES:
        yield from _table_rows(path)
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise SnugfitError(f"{path}:{lineno}: not JSON ({e}); fix the line") from e


def _table_rows(path: Path) -> Iterator[tuple[str, dict]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        with quiet_imports():
            import datasets
    except ImportError as e:
        raise SnugfitError(f"reading {path.suffix} files needs the datasets library: pip install -e \".[data]\"") from e
    try:
        if path.suffix == ".arrow":
            table = datasets.Dataset.from_file(str(path))
        else:
            table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as e:  # pyarrow and datasets raise many kinds on a malformed file
        raise SnugfitError(f"cannot read {path}: {e}; pass a valid {path.suffix} file") from e
    for i, row in enumerate(table):
        yield f"{path} row {i}", row
