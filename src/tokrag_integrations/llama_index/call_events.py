"""The LlamaIndex events of one model call of a ``TokRAGSynthesizer`` (its native modes call
the core directly, so they make the events LlamaIndex's own LLM calls make)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
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
from ..results import GenerationResult

dispatcher = instrument.get_dispatcher(__name__)


class LLMEvent:
    """The LlamaIndex events of one model call of a :class:`TokRAGSynthesizer`: the
    ``CBEventType.LLM`` callback event and the LLMCompletionStart/End instrumentation events
    (started when made), with the exact token counts in ``raw["usage"]``."""

    def __init__(self, synth: Any, sess: Session, call: Call) -> None:
        self.synth, self.sess, self.call = synth, sess, call
        self.prompt = sess.prompt_text(call)
        self.ended = False
        llm = synth._llm
        model_dict = llm.to_payload() if hasattr(llm, "to_payload") else llm.to_dict()
        extra = {
            "policy": synth._policy_name,
            "response_mode": synth._mode,
            "call": len(sess.calls),
            "kind": call.kind,
        }
        dispatcher.event(
            LLMCompletionStartEvent(
                prompt=self.prompt, additional_kwargs=extra, model_dict=model_dict
            )
        )
        self.event_id = synth._callback_manager.on_event_start(
            CBEventType.LLM,
            payload={
                EventPayload.PROMPT: self.prompt,
                EventPayload.ADDITIONAL_KWARGS: extra,
                EventPayload.SERIALIZED: model_dict,
            },
        )

    def end(self, result: GenerationResult) -> GenerationResult:
        self.ended = True
        self.sess.calls.append((self.call, result))
        response = CompletionResponse(
            text=result.text,
            additional_kwargs=result_summary(result),
            raw={"usage": usage(result, self.synth._roles)},
        )
        self.synth._callback_manager.on_event_end(
            CBEventType.LLM,
            payload={EventPayload.PROMPT: self.prompt, EventPayload.COMPLETION: response},
            event_id=self.event_id,
        )
        dispatcher.event(LLMCompletionEndEvent(prompt=self.prompt, response=response))
        return result

    @contextmanager
    def failing(self) -> Generator[None, None, None]:
        """The error end of the event when the block raises before the call ended."""
        try:
            yield
        except BaseException as e:
            if not self.ended:
                self.synth._callback_manager.on_event_end(
                    CBEventType.LLM, payload={EventPayload.EXCEPTION: e}, event_id=self.event_id
                )
            raise
