"""The entry points' inputs: checked before anything is decoded (a sentence naming the
fix), then turned into prompt plans by the one prompt builder."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from .models import LoadedModel
from .prompts import PromptBuilder, PromptPlan, RenderedPrompt, clean_text


def _plans(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None],
    *,
    max_new_tokens: int,
    messages: Sequence[list[dict[str, str]] | None] | None,
    system_prompt: Any,
    max_context_tokens: int | None,
    prompt_format: str = "qa",
    rendered: Sequence[RenderedPrompt | None] | None = None,
) -> list[PromptPlan]:
    kw: dict[str, Any] = {"context_window": lm.context_window}
    if system_prompt is not _DEFAULT:
        kw["system_prompt"] = system_prompt
    elif prompt_format != "qa":
        kw["system_prompt"] = None  # a raw prompt gets no injected wording
    builder = PromptBuilder(lm.tokenizer, **kw)
    plans = []
    for i, (q, p) in enumerate(zip(queries, passages, strict=True)):
        limits = {
            "max_new_tokens": max_new_tokens,
            "messages": messages[i] if messages else None,
            "max_context_tokens": max_context_tokens,
        }
        if rendered and rendered[i] is not None:
            plans.append(builder.build_rendered(q, rendered[i], **limits))
        else:
            plans.append(builder.build(q, p, prompt_format=prompt_format, **limits))
    return plans


#: ``system_prompt`` not given: the builder's default (none for a raw prompt).
_DEFAULT: Any = object()


def _where(what: str, i: int | None) -> str:
    return what if i is None else f"{what} {i}"


def _check_query(q: Any, i: int | None) -> str:
    if not isinstance(q, str):
        raise TypeError(f"{_where('query', i)} must be a string, got {type(q).__name__}")
    return clean_text(q, _where("query", i))


def _check_passages(p: Any, i: int | None) -> None:
    if p is None:
        return
    what = "passages" if i is None else f"the passages of query {i}"
    if isinstance(p, (str, bytes)):
        raise TypeError(f"{what} must be a list of passages, not a single {type(p).__name__}; wrap it in a list")
    if not isinstance(p, Sequence):
        raise TypeError(f"{what} must be a list of passages (str, Passage or (text, score)), got {type(p).__name__}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _check_inputs(
    queries: Sequence[str],
    passages: Sequence[Any],
    rendered: Sequence[Any] | None,
    max_new_tokens: Any,
    max_context_tokens: Any,
) -> None:
    """The checks of one call after its queries': passages, rendered prompts, counts."""
    for i, p in enumerate(passages):
        _check_passages(p, i if len(passages) > 1 else None)
    if rendered is not None:
        if len(rendered) != len(queries):
            raise ValueError(f"got {len(queries)} queries but {len(rendered)} rendered prompts")
        for i, r in enumerate(rendered):
            if r is not None and not isinstance(r, RenderedPrompt):
                raise TypeError(f"{_where('rendered', i)} must be a RenderedPrompt, got {type(r).__name__}")
            if r is not None and passages[i]:
                raise ValueError("give passages or a rendered prompt (its context), not both")
    _check_count("max_new_tokens", max_new_tokens)
    if max_context_tokens is not None:
        _check_count("max_context_tokens", max_context_tokens)

