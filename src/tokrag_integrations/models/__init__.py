"""Loading a local causal LM (safetensors or GGUF, the packaged default models, a cached hub
id or a loaded model) into the handle every entry point decodes with (:class:`LoadedModel`),
and the loading options every entry point shares (:data:`LOAD_OPTIONS`), checked before
anything is loaded.

Three rooms: :mod:`.handle` (the :class:`LoadedModel` handle), :mod:`.files` (where a name
points, the packaged models, GGUF conversion, damaged-file checks) and :mod:`.loader`
(:func:`load_model` and its options). Import from here.
"""

from __future__ import annotations

from .files import (
    DEFAULT_MODEL_NAME,
    GEMMA_ALIASES,
    GEMMA_MODEL_NAME,
    DamagedModelError,
    convert_gguf,
    default_model_path,
    gemma_model_path,
    show_loading_progress,
)
from .handle import LoadedModel, cache_argument, model_cache
from .loader import (
    FALLBACK_CONTEXT_WINDOW,
    LOAD_FIELDS,
    LOAD_OPTIONS,
    MAX_CONTEXT_WINDOW,
    check_device_and_dtype,
    load_model,
    unknown_arguments,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FALLBACK_CONTEXT_WINDOW",
    "GEMMA_ALIASES",
    "GEMMA_MODEL_NAME",
    "LOAD_FIELDS",
    "LOAD_OPTIONS",
    "MAX_CONTEXT_WINDOW",
    "DamagedModelError",
    "LoadedModel",
    "cache_argument",
    "check_device_and_dtype",
    "convert_gguf",
    "default_model_path",
    "gemma_model_path",
    "load_model",
    "model_cache",
    "show_loading_progress",
    "unknown_arguments",
]
