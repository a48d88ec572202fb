"""Constraints as token masks: a spec compiled by llguidance, stepped one token at a time.

A constraint turns a grammar (a JSON schema, a regex, a Lark grammar) into the set of tokens
that may come next. The engine asks for that set before each step (:meth:`GrammarConstraint.
fill_bitmask`, one bit per token of the model's vocabulary: bit ``j`` of word ``i`` allows
token ``32 * i + j``), masks every context's logits of the query with it, and tells the
constraint which token was chosen (:meth:`GrammarConstraint.accept`). End-of-sequence tokens
are allowed exactly where the grammar may end; once it cannot go on
(:meth:`GrammarConstraint.is_finished`) the query stops.

The backend is llguidance (https://github.com/guidance-ai/llguidance), the library llama.cpp
and vLLM use for the same job: an Earley parser over a lexer whose token masks are computed by
walking the tokenizer's byte trie, so a mask costs tens of microseconds and no grammar is
compiled ahead over the whole vocabulary. Its tokenizer bridge (``llguidance.hf.
from_tokenizer``, about 0.2 s for a 50k vocabulary) is built once per model and cached on it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .json_schemas import json_grammar, schema_from_response_format
from .llguidance_backend import llguidance_module

#: The spec types :func:`constraint_for` knows (OpenAI's ``response_format`` and vLLM's
#: guided-decoding kinds).
SPEC_TYPES = ("json_object", "json_schema", "regex", "grammar")

#: How many compiled grammars each model keeps (the start state of each, copied per query).
_COMPILED_PER_MODEL = 64


class GrammarConstraint:
    """One query's place in a grammar (the engine's ``TokenConstraint``).

    Not thread-safe: one query, one constraint (:meth:`fork` gives another at the start).
    """

    def __init__(self, matcher: Any, start: Any, bridge: _Bridge, description: str) -> None:
        self._matcher = matcher
        self._start = start  # the compiled grammar at its first token, never stepped
        self._bridge = bridge
        #: What the constraint enforces, for messages (e.g. ``"JSON schema 'Person'"``).
        self.description = description

    @property
    def vocab_size(self) -> int:
        """The number of token ids the masks cover (the model's output vocabulary)."""
        return self._bridge.vocab_size

    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        """Write the tokens allowed next into row ``index`` of ``bitmask``, an int32 CPU
        tensor ``[N, ceil(V / 32)]`` (bit ``j`` of word ``i``: token ``32 * i + j``)."""
        import torch

        words = (self.vocab_size + 31) // 32
        if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32:
            raise TypeError("bitmask must be an int32 torch tensor of shape [N, ceil(V / 32)]")
        if bitmask.device.type != "cpu" or bitmask.dim() != 2 or bitmask.shape[1] != words:
            raise ValueError(
                f"bitmask must be a 2-D CPU tensor with {words} words per row (a vocabulary of "
                f"{self.vocab_size}), got shape {tuple(bitmask.shape)} on {bitmask.device}"
            )
        row = bitmask[index]
        if not row.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        if self._matcher.is_error():  # pragma: no cover - accept() raises before this state
            raise RuntimeError(f"{self.description}: {self._matcher.get_error()}")

    def allowed(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (one mask computed; for tests and checks)."""
        import torch

        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.fill_bitmask(mask, 0)
        return bool((int(mask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> None:
        """Step the grammar over the chosen token; ValueError if the grammar does not allow it
        (the constraint is then spent: fork a new one)."""
        token_id = int(token_id)
        if self._matcher.consume_token(token_id):
            return
        text = self._bridge.tokenizer.dbg_tokens([token_id]) if 0 <= token_id < self.vocab_size else "?"
        error = self._matcher.get_error().strip().splitlines()
        raise ValueError(
            f"token {token_id} ({text}) is not allowed here by the {self.description}"
            + (f" ({error[0]})" if error else "")
        )

    def is_finished(self) -> bool:
        """True once the grammar can take no further token (it is complete: only an
        end-of-sequence token could follow, and the query stops)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_accepting(self) -> bool:
        """True where the text so far is a complete match (the grammar may end here)."""
        return self._matcher.is_accepting()

    def fork(self) -> GrammarConstraint:
        """A fresh constraint at the start of the same grammar (for ``n > 1`` or a retry)."""
        return GrammarConstraint(self._start.deep_copy(), self._start, self._bridge, self.description)

    def __repr__(self) -> str:
        return f"GrammarConstraint({self.description})"


class _Bridge:
    """llguidance's view of one model's tokenizer, with the grammars compiled for it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        llg = llguidance_module()
        try:
            self.tokenizer = llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        except ValueError as exc:
            raise ValueError(
                f"llguidance cannot read this tokenizer ({type(hf_tokenizer).__name__}): {exc}; "
                "structured output needs a fast (Rust-backed) Hugging Face tokenizer"
            ) from exc
        self.vocab_size = vocab_size
        self.hf_tokenizer = hf_tokenizer
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str, what: str) -> Any:
        """A matcher at the start of ``grammar`` (llguidance's grammar text), compiled once
        and copied; ValueError naming ``what`` when llguidance rejects the grammar."""
        with self._lock:
            start = self._compiled.get(grammar)
            if start is not None:
                self._compiled.move_to_end(grammar)
                return start
        llg = llguidance_module()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"{what} cannot be compiled: {_first_line(messages[0])}")
        start = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ValueError(f"{what} cannot be compiled: {_first_line(start.get_error())}")
        with self._lock:
            self._compiled[grammar] = start
            while len(self._compiled) > _COMPILED_PER_MODEL:
                self._compiled.popitem(last=False)
        return start

    def constraint(self, grammar: str, what: str) -> GrammarConstraint:
        start = self.compile(grammar, what)
        return GrammarConstraint(start.deep_copy(), start, self, what)


def _first_line(message: str) -> str:
    """The first line of an llguidance message (the rest points into the grammar text)."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    text = re.sub(r"^at \d+\(\d+\): ", "", lines[0]) if lines else "unknown error"
    # a regex error's first line only says where; its reason is on the line starting "error:"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{text.rstrip(':')} ({reason})" if reason else text.rstrip(":")


def bridge_for(lm: Any) -> _Bridge:
    """The tokenizer bridge of ``lm`` (a :class:`~tokrag_integrations.models.LoadedModel`),
    built on first use and cached on the model (``lm.memo``)."""
    tokenizer = getattr(lm, "tokenizer", None)
    if tokenizer is None:
        raise TypeError(f"constraint_for needs a loaded model (load_model(...)), got {type(lm).__name__}")
    vocab_size = int(lm.vocab_size)
    eos_ids = [int(i) for i in lm.eos_token_ids]
    key = ("structured.bridge", vocab_size, tuple(eos_ids))
    return lm.memo(key, lambda: _Bridge(tokenizer, vocab_size, eos_ids))


def grammar_of(spec: Any) -> tuple[str, str]:
    """``(llguidance grammar text, description)`` of a spec (see :func:`constraint_for`);
    ValueError / TypeError naming what is wrong with it. Compiles nothing."""
    llg = llguidance_module()
    if not isinstance(spec, Mapping):
        raise TypeError(
            "constraint must be a TokenConstraint or a spec dict such as "
            f'{{"type": "json_object"}}, got {type(spec).__name__}'
        )
    kind = spec.get("type")
    if kind == "json_object":
        return json_grammar({"type": "object"}), "JSON object"
    if kind == "json_schema":
        schema, name = schema_from_response_format(spec)
        return json_grammar(schema), f"JSON schema {name!r}"
    if kind == "regex":
        regex = spec.get("regex")
        if not isinstance(regex, str) or not regex:
            raise ValueError('a regex constraint needs a non-empty "regex" string')
        return llg.LLMatcher.grammar_from_regex(regex), f"regex {_short(regex)}"
    if kind == "grammar":
        text = spec.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise ValueError('a grammar constraint needs a non-empty "grammar" string (Lark or GBNF)')
        try:
            return llg.grammar_from("grammar", text), "grammar"
        except ValueError as exc:  # a GBNF grammar the converter cannot read
            raise ValueError(f"the grammar cannot be read: {_first_line(str(exc))}") from exc
    if kind == "text":
        raise ValueError('{"type": "text"} is no constraint: pass constraint=None for free text')
    raise ValueError(
        f"unknown constraint type {kind!r}; use one of {', '.join(map(repr, SPEC_TYPES))}"
    )


def _short(text: str, limit: int = 60) -> str:
    shown = json.dumps(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + '..."'


def constraint_for(spec: Any, lm: Any) -> GrammarConstraint:
    """A :class:`GrammarConstraint` at the start of ``spec`` for the model ``lm``.

    ``spec`` is one of

    * ``{"type": "json_object"}``: any JSON object;
    * ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
      (OpenAI's ``response_format``): JSON valid against the schema (objects without
      ``additionalProperties`` are closed: see :func:`.json_schemas.closed_schema`);
    * ``{"type": "regex", "regex": "..."}``: text matching the regex (Rust ``regex`` syntax,
      no look-around);
    * ``{"type": "grammar", "grammar": "..."}``: a Lark grammar in llguidance's dialect (or a
      GBNF one, converted).

    A spec that cannot be compiled (an invalid schema, a regex llguidance rejects, an unknown
    type) raises ValueError here, in one sentence naming the problem.
    """
    grammar, description = grammar_of(spec)
    return bridge_for(lm).constraint(grammar, description)
