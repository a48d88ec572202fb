"""The loading options every entry point shares (:data:`LOAD_OPTIONS`) and their checks, made
before anything is loaded."""

from __future__ import annotations

from typing import Any

__all__ = ["LOAD_OPTIONS", "check_device_and_dtype", "check_greedy", "unknown_arguments"]


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


#: Keyword arguments of :func:`load_model` that every adapter (``TokRAGLLM``,
#: ``TokRAGSynthesizer``, ``ChatTokRAG``, ``create_tokrag_chain``) takes as well.
LOAD_OPTIONS = (
    "tokenizer",
    "device",
    "device_map",
    "dtype",
    "model_kwargs",
    "tokenizer_kwargs",
    "trust_remote_code",
    "revision",
    "local_files_only",
    "require_signals",
    "cpu_kernels",
)


def check_greedy(temperature: Any, owner: str) -> None:
    """Refuse a sampling temperature: every policy decodes greedily (the same sentence in every
    adapter)."""
    if temperature is None or (isinstance(temperature, (int, float)) and temperature == 0):
        return
    raise ValueError(
        f"{owner} decodes greedily, so temperature must be 0 or None (got {temperature!r}); "
        "Tok-RAG compares the greedy choices of the pure and the RAG context."
    )


def unknown_arguments(owner: str, unknown: Any, accepted: Any) -> TypeError:
    """The error for keyword arguments an adapter does not take, naming the ones it does."""
    names = ", ".join(repr(k) for k in sorted(unknown))
    return TypeError(
        f"{owner} got unknown keyword argument(s) {names}; accepted: {', '.join(sorted(accepted))}"
    )
