"""The handle every entry point decodes with: a causal LM, its tokenizer and the facts the
decoder needs (:class:`LoadedModel`), and the KV-cache spelling of the installed transformers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadedModel", "cache_argument", "model_cache"]


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
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per model and ``key``, then the same object again: for facts that
        depend only on the weights and tokenizer (a policy's vocabulary masks), which a
        policy's ``prepare`` would otherwise rebuild for every call. Callers must not modify
        what it returns. Two threads may both build on a first call; one result is kept."""
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
    (``past_key_values`` still works there but warns on every call), ``past_key_values`` before."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_cache(output: Any) -> Any:
    """The updated KV cache of a forward's output, under either name (see ``cache_argument``)."""
    fields = getattr(output, "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values
