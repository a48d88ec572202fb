"""Where model weights are found besides a local path: the local Hugging Face cache (a hub
id, never downloaded unless asked), and the one-sentence error for a damaged weights file."""

from __future__ import annotations

import re
from pathlib import Path

from .paths import cache_dir

__all__ = ["DamagedModelError"]


class DamagedModelError(ValueError):
    """A weights file of the model is truncated or corrupt (the message names the file and
    how to get a complete one)."""


def _raise_if_damaged(folder: Path, gguf: str | None, display: str) -> None:
    """Raise :class:`DamagedModelError` if a safetensors file in ``folder`` cannot be opened
    (called after a load failed, to turn the loader's traceback into one sentence)."""
    if gguf:
        return
    from safetensors import safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - any failure to open means a damaged file
            reason = str(e).removeprefix("Error while deserializing header: ")
            if folder.resolve().is_relative_to(cache_dir().resolve() / "models"):
                fix = (
                    f"delete the folder {folder} and load the model again: tokrag rebuilds it "
                    "from the installed package"
                )
            elif "models--" in str(folder):
                fix = f"download it again: hf download {display} --force-download"
            else:
                fix = "replace it with a complete copy"
            raise DamagedModelError(
                f"The model file {weights} is damaged ({reason}: a cut-short copy, download "
                f"or conversion); {fix}."
            ) from None


#: A Hugging Face hub id (``org/name`` or a bare legacy ``name``), checked only for strings
#: that are not an existing path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def _not_cached(repo_id: str, revision: str | None) -> FileNotFoundError:
    rev = f" at revision {revision!r}" if revision else ""
    return FileNotFoundError(
        f"Model {repo_id!r}{rev} is neither a local path nor in the Hugging Face cache and is never "
        f"downloaded here; fetch it once with `huggingface-cli download {repo_id}` (or `hf download "
        f"{repo_id}`), or pass 'default', a local folder or a .gguf file."
    )


def _hub_snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    """The cached snapshot folder of hub model ``repo_id`` (``$HF_HUB_CACHE``), without any
    network access unless ``local_files_only`` is False."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (OSError, ValueError):
        if local_files_only:
            raise _not_cached(repo_id, revision) from None
        try:
            folder = snapshot_download(
                repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
            )
        except (OSError, ValueError) as e:
            raise _not_cached(repo_id, revision) from e
    return Path(folder)
