"""The LlamaIndex events of each model call of :class:`TokRAGSynthesizer` (a mixin): the
``CBEventType.LLM`` callback event and the LLMCompletionStart/End instrumentation events, with
the exact token counts in ``raw["usage"]`` so ``TokenCountingHandler`` counts them."""

from __future__ import annotations

from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)

from ..adapters.synthesis import Call, Session
from ..adapters.translate import result_summary, usage
from ..engine import scheduler
from ..results import GenerationResult

dispatcher = instrument.get_dispatcher(__name__.rsplit(".", 1)[0] + ".synthesizer")


class _CallEvents:
    """Decode one planned call (sync or async) between its start and end events."""

    _llm: Any
    _lm: Any
    _callback_manager: Any
    _policy_name: str
    _mode: str
    _roles: tuple[str, ...]
    _batching: bool
    _gen_kwargs: dict[str, Any]

    def _llm_start(self, sess: Session, call: Call) -> tuple[str, str]:
        """Emit the LLM start events of one call; (event id, prompt text)."""
        prompt = sess.prompt_text(call)
        llm = self._llm
        model_dict = llm.to_payload() if hasattr(llm, "to_payload") else llm.to_dict()
        extra = {
            "policy": self._policy_name,
            "response_mode": self._mode,
            "call": len(sess.calls),
            "kind": call.kind,
        }
        dispatcher.event(
            LLMCompletionStartEvent(prompt=prompt, additional_kwargs=extra, model_dict=model_dict)
        )
        event_id = self._callback_manager.on_event_start(
            CBEventType.LLM,
            payload={
                EventPayload.PROMPT: prompt,
                EventPayload.ADDITIONAL_KWARGS: extra,
                EventPayload.SERIALIZED: model_dict,
            },
        )
        return event_id, prompt

    def _llm_end(
        self, sess: Session, call: Call, event_id: str, prompt: str, result: GenerationResult
    ) -> None:
        sess.record(call, result)
        response = CompletionResponse(
            text=result.text,
            additional_kwargs=result_summary(result),
            raw={"usage": usage(result, self._roles)},
        )
        self._callback_manager.on_event_end(
            CBEventType.LLM,
            payload={EventPayload.PROMPT: prompt, EventPayload.COMPLETION: response},
            event_id=event_id,
        )
        dispatcher.event(LLMCompletionEndEvent(prompt=prompt, response=response))

    def _llm_error(self, event_id: str, error: BaseException) -> None:
        self._callback_manager.on_event_end(
            CBEventType.LLM, payload={EventPayload.EXCEPTION: error}, event_id=event_id
        )

    def _call(self, sess: Session, call: Call) -> GenerationResult:
        event_id, prompt = self._llm_start(sess, call)
        try:
            result = scheduler.generate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        except BaseException as e:
            self._llm_error(event_id, e)
            raise
        self._llm_end(sess, call, event_id, prompt, result)
        return result

    async def _acall(self, sess: Session, call: Call) -> GenerationResult:
        event_id, prompt = self._llm_start(sess, call)
        try:
            result = await scheduler.agenerate(
                self._lm, sess.query, call.passages, batching=self._batching, **self._gen_kwargs
            )
        except BaseException as e:
            self._llm_error(event_id, e)
            raise
        self._llm_end(sess, call, event_id, prompt, result)
        return result
