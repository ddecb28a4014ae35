"""Hugging Face hub ids ('org/name') as the local cache holds them: read, never downloaded.

Every fine-tuning tool takes `--model org/name`; snugfit takes it too, from the folder huggingface_hub's cache
keeps for it (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), through huggingface_hub itself
with local_files_only, so the cache's own layout and refs are read as the library reads them.
"""

from __future__ import annotations

import re
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.quiet import quiet_imports

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(name: str) -> bool:
    """'org/name' that is not a path on this machine."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).exists()


def cached_snapshot(name: str) -> Path | None:
    """The local cache's snapshot folder of hub id `name` (with its config.json), or None where the cache has
    none (or huggingface_hub is not installed)."""
    if not looks_like_hub_id(name):
        return None
    try:
        with quiet_imports():
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return folder if (folder / "config.json").is_file() else None


def local_model(name: str) -> str:
    """`name` as a local path: a hub id the cache holds becomes its snapshot folder; anything else is kept."""
    folder = cached_snapshot(name) if name else None
    return str(folder) if folder is not None else name


def not_cached(name: str) -> SnugfitError:
    """The one line for a hub id the local cache does not hold."""
    return SnugfitError(f"{name!r} is not in the local Hugging Face cache and snugfit downloads nothing; fetch it "
                        f"once where there is network (`hf download {name}`, into HF_HUB_CACHE) or pass its folder")
