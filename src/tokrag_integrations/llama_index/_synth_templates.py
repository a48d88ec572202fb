"""The template path of :class:`TokRAGSynthesizer`, and the checks of its mode arguments.

With a prompt template set, or in one of LlamaIndex's other modes, the answer comes from
LlamaIndex's own synthesizer of that mode, run through a :class:`TokRAGLLM` that keeps each
call's result so the metadata can carry the traces.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.response_synthesizers.factory import get_response_synthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore

from ._convert import call_summary
from ._modes import _totals
from .llm import TokRAGLLM

#: ``response_mode`` values with the package's own prompt: one decode over every node that
#: fits (the default), or LlamaIndex's multi-call modes of the same names.
NATIVE_MODES = ("one_pass", "compact", "refine", "tree_summarize")
#: Every ``response_mode``: the native ones, and LlamaIndex's other built-in modes, which
#: run LlamaIndex's own synthesizer with its templates through :class:`TokRAGLLM`.
RESPONSE_MODES = (*NATIVE_MODES, "simple_summarize", "accumulate", "compact_accumulate", "no_text")
#: The prompt templates of LlamaIndex's synthesizers that this one takes.
TEMPLATE_KEYS = ("text_qa_template", "refine_template", "summary_template")
_DEFAULT_TEMPLATES = {
    "text_qa_template": DEFAULT_TEXT_QA_PROMPT_SEL,
    "refine_template": DEFAULT_REFINE_PROMPT_SEL,
    "summary_template": DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
}


def _mode_name(response_mode: Any) -> str:
    mode = getattr(response_mode, "value", response_mode)
    if mode not in RESPONSE_MODES:
        raise ValueError(
            f"Unknown response_mode {response_mode!r}; TokRAGSynthesizer accepts "
            + ", ".join(repr(m) for m in RESPONSE_MODES)
            + " ('one_pass' is the default)."
        )
    return str(mode)


async def _no_tokens() -> AsyncGenerator[str, None]:
    return
    yield  # an async generator that yields nothing


def _template(key: str, value: Any) -> BasePromptTemplate | None:
    if value is None or isinstance(value, BasePromptTemplate):
        return value
    raise TypeError(
        f"{key} must be a LlamaIndex prompt template (PromptTemplate, ChatPromptTemplate...), "
        f"got {type(value).__name__}"
    )


def _metadata_mode(metadata_mode: Any) -> MetadataMode:
    try:
        return MetadataMode(getattr(metadata_mode, "value", metadata_mode))
    except ValueError:
        raise ValueError(
            f"Unknown metadata_mode {metadata_mode!r}; use one of "
            + ", ".join(f"MetadataMode.{m.name}" for m in MetadataMode)
        ) from None



class _TemplatePath:
    """The template-path methods of :class:`TokRAGSynthesizer` (a mixin; the attributes it
    reads are set by the synthesizer's constructor)."""

    _gen_kwargs: dict[str, Any]
    _policy_name: str
    _policy_options: dict[str, Any]
    _batching: bool
    _lm: Any
    _callback_manager: Any
    _mode: str
    _streaming: bool
    _templates: dict[str, BasePromptTemplate]
    _roles: tuple[str, ...]
    _metadata_mode: MetadataMode

    def _template_llm(self) -> TokRAGLLM:
        """A TokRAGLLM with this synthesizer's settings that keeps its calls' results."""
        kw = self._gen_kwargs
        own: dict[str, Any] = {
            "policy": self._policy_name,
            "max_new_tokens": kw["max_new_tokens"],
            "stop": [kw["stop"]] if isinstance(kw["stop"], str) else kw["stop"],
            "max_context_tokens": kw["max_context_tokens"],
            "policy_options": self._policy_options,
            "batching": self._batching,
        }
        if "system_prompt" in kw:
            own["system_prompt"] = kw["system_prompt"]
        llm = TokRAGLLM(self._lm, callback_manager=self._callback_manager, **own)
        llm._results = []
        return llm

    def _template_synth(self, llm: TokRAGLLM) -> BaseSynthesizer | None:
        """LlamaIndex's synthesizer for the mode (None for ``no_text``: no call at all)."""
        if self._mode == "no_text":
            return None
        mode = "compact" if self._mode == "one_pass" else self._mode
        return get_response_synthesizer(
            llm=llm,
            response_mode=mode,
            streaming=self._streaming,
            callback_manager=self._callback_manager,
            **self._templates,
        )

    def _template_metadata(
        self, llm: TokRAGLLM, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> dict[str, Any]:
        results = list(llm._results or [])
        calls = [call_summary(i, "template", r, [{}], roles=self._roles) for i, r in enumerate(results)]
        final = results[-1] if results else None
        policy_used = final.trace.policy if final is not None else None
        counts, notes, total = _totals(calls, [])
        return {
            "response_mode": self._mode,
            "templates": sorted(self._templates),
            "policy": self._policy_name,
            "policy_used": policy_used,
            "answered_from": "retrieval" if policy_used not in (None, "llm") else "pure_context",
            "counts": final.counts if final is not None else {},
            "counts_all_calls": counts,
            "model": self._lm.name,
            "stop_reason": final.trace.stop_reason if final is not None else None,
            "gate": gate,
            "nodes_used": [n.node.node_id for n in nodes],
            "warnings": notes,
            "trace": calls[-1]["trace"] if calls else None,
            "calls": calls,
            "usage": total,
        }

    def _template_chunks(self, nodes: Sequence[NodeWithScore]) -> list[str]:
        return [n.node.get_content(metadata_mode=self._metadata_mode) for n in nodes]

    def _run_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        llm = self._template_llm()
        synth = self._template_synth(llm)
        if synth is None:
            return (iter(()) if self._streaming else ""), self._template_metadata(llm, nodes, gate)
        answer = synth.get_response(query, self._template_chunks(nodes))
        if not self._streaming or isinstance(answer, str):
            return answer, self._template_metadata(llm, nodes, gate)
        metadata = {"policy": self._policy_name, "gate": gate, "response_mode": self._mode}

        def gen() -> Generator[str, None, None]:
            yield from answer
            metadata.update(self._template_metadata(llm, nodes, gate))

        return gen(), metadata

    async def _arun_templates(
        self, query: str, nodes: Sequence[NodeWithScore], gate: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        llm = self._template_llm()
        synth = self._template_synth(llm)
        if synth is None:
            return (_no_tokens() if self._streaming else ""), self._template_metadata(llm, nodes, gate)
        answer = await synth.aget_response(query, self._template_chunks(nodes))
        if not self._streaming or isinstance(answer, str):
            return answer, self._template_metadata(llm, nodes, gate)
        metadata = {"policy": self._policy_name, "gate": gate, "response_mode": self._mode}

        async def agen() -> AsyncGenerator[str, None]:
            async for token in answer:
                yield token
            metadata.update(self._template_metadata(llm, nodes, gate))

        return agen(), metadata

