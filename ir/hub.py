"""Hugging Face Hub model ids: their local snapshot, from the cache (or downloaded).

A ref is a hub id when it has the hub's ``org/name`` shape and is not a path
that exists. Resolution goes through ``huggingface_hub``: the cache first
(``HF_HUB_CACHE`` or ``HF_HOME``, honoured at call time), then — unless
``HF_HUB_OFFLINE`` is set — a download of what a model needs (config,
safetensors weights, tokenizer and chat template). A model that is neither
cached nor downloadable is an error naming the id and the command that fetches
it; it never becomes a random model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowc.errors import SpecError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a model directory needs; the .bin/.pt pickles are never fetched (they can run code)
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(ref: str) -> bool:
    """``org/name`` and not an existing path."""
    return bool(_HUB_ID.match(ref)) and not Path(ref).expanduser().exists()


def cache_dir() -> str | None:
    """The hub cache the environment names now (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of ``repo_id`` with a config.json, or None."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a partial cache entry
        return None
    return path if (path / "config.json").exists() else None


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of hub model ``repo_id``: cached, else downloaded (not when offline)."""
    got = cached_snapshot(repo_id, revision)
    if got is not None:
        return got
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    where = cache_dir() or "the default cache (~/.cache/huggingface/hub)"
    if offline():
        raise SpecError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set",
            fix=f"download it on a machine with network access: {fetch} (and copy the cache here, or set HF_HOME to it), "
            "or give a local model directory",
        )
    from huggingface_hub import snapshot_download

    try:
        path = Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), allow_patterns=MODEL_FILES, etag_timeout=10)
        )
    except Exception as e:
        raise SpecError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and cannot be downloaded: {type(e).__name__}: {e}",
            fix=f"check the id and the network, or download it: {fetch}; or give a local model directory",
        ) from None
    if not (path / "config.json").exists():
        raise SpecError(f"hub model {repo_id!r} has no config.json", fix="give the id of a transformers model")
    return path
