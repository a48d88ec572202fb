"""The stock baseline of ``tokrag bench`` (:mod:`.cost`): Hugging Face ``model.generate``,
greedy, on the prompt ids the package's ``rag`` decodes, with its dynamic cache or its static
cache and compiled step; each answer cut where the package's decoder stops."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class HFRun:
    """A :func:`hf_generate` call: each answer's new token ids, in order (EOS left out: as
    ``GenerationResult.token_ids``, one per ``Trace.steps``); ``prefill_s`` from the call until
    the first token's logits (the prompts' tokenisation included); ``seconds`` the whole call."""

    answers: list[list[int]]
    prefill_s: float
    seconds: float


def rag_prompt_ids(
    lm: Any, queries: Sequence[str], passages: Sequence[Sequence[Any]], max_new_tokens: int
) -> list[list[int]]:
    """The prompt ids the ``rag`` policy decodes for each query: its RAG context, or its pure
    context where no passage is usable (``rag`` then answers as ``no_rag``)."""
    from tokrag_integrations.inputs import _DEFAULT, _plans

    plans = _plans(
        lm,
        list(queries),
        list(passages),
        max_new_tokens=max_new_tokens,
        messages=None,
        system_prompt=_DEFAULT,
        max_context_tokens=None,
    )
    return [p.rag_ids if p.has_passages else p.pure_ids for p in plans]


def _answer(lm: Any, new: list[int], stop: Sequence[str], max_new_tokens: int) -> list[int]:
    """The answer in one row of ``generate``'s new tokens, cut where the package's decoder
    stops (``engine.decoder.step_event``): before EOS, after the token whose text completes a
    stop string, or at ``max_new_tokens``; what follows is ``generate``'s padding of a finished
    row."""
    eos = set(lm.eos_token_ids)
    ids: list[int] = []
    for tid in new[:max_new_tokens]:
        if tid in eos:
            break
        ids.append(tid)
        if stop and any(s in lm.tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
            break
    return ids


def hf_generate(
    lm: Any,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any]],
    *,
    max_new_tokens: int,
    cache: str = "dynamic",
    stop: Sequence[str] | None = None,
    compile: bool = True,
) -> HFRun:
    """The stock baseline: Hugging Face ``lm.model.generate``, greedy, on the ids of the RAG
    prompts ``rag`` decodes (:func:`rag_prompt_ids`; several queries left-padded into one
    batch), the same ``max_new_tokens``, stopping at EOS (and at ``stop`` strings).

    ``cache="dynamic"``: transformers' default cache. ``cache="static"``: its static cache,
    with the decode step compiled (``torch.compile``, mode ``reduce-overhead``: CUDA graphs) as
    ``generate`` does for a static cache (transformers compiles on accelerators only; here on
    CPU too; ``compile=False`` leaves it eager). A first call at a new batch size or a longer
    prompt compiles: warm it up before timing.
    """
    import torch
    from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be 'dynamic' or 'static', got {cache!r}")
    stops = list(stop or [])
    t0 = time.perf_counter()
    prompts = rag_prompt_ids(lm, queries, passages, max_new_tokens)
    width = max(len(p) for p in prompts)
    pad = lm.pad_token_id
    device = lm.model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    first: list[float] = []

    class _FirstLogits(LogitsProcessor):
        """Notes when the first token's logits exist (the end of the prefill)."""

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if not first:
                if scores.device.type == "cuda":
                    torch.cuda.synchronize(scores.device)
                first.append(time.perf_counter())
            return scores

    kw: dict[str, Any] = {}
    if cache == "static":
        kw["cache_implementation"] = "static"
        if compile:
            cc = CompileConfig()
            cc._compile_all_devices = True  # transformers compiles on accelerators only
            kw["compile_config"] = cc
        else:
            kw["disable_compile"] = True
    if stops:
        kw.update(stop_strings=stops, tokenizer=lm.tokenizer)
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=max_new_tokens,
            eos_token_id=lm.eos_token_ids,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList([_FirstLogits()]),
            **kw,
        )
    rows = out[:, width:].tolist()
    seconds = time.perf_counter() - t0
    answers = [_answer(lm, row, stops, max_new_tokens) for row in rows]
    return HFRun(answers, (first[0] if first else time.perf_counter()) - t0, seconds)
