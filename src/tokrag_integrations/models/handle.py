"""The handle every entry point decodes with (:class:`LoadedModel`: a causal LM, its tokenizer,
its context window and its lock), and the name its forward takes the KV cache under."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
