"""Twenty JSON schemas (nested objects, enums, arrays, numbers, patterns, unions) on the
packaged model under ``tokrag`` and ``rag``: batched and alone, every answer parses, validates
and stops because its JSON is complete, the batch gives each query the tokens (and sources) it
gets alone, and the trace records each token's source (issue 57's acceptance)."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from _structured import sample_questions  # noqa: E402

from tokrag_integrations import generate, generate_batch  # noqa: E402
from tokrag_integrations.structured import parse_structured, response_format_of  # noqa: E402


def obj(**properties):
    """A closed-by-default object schema requiring every property."""
    return {"type": "object", "properties": properties, "required": list(properties)}


def text(n):
    return {"type": "string", "maxLength": n}


SCHEMAS = [
    obj(answer=text(40)),
    obj(answer=text(40), confidence={"enum": ["high", "medium", "low"]}),
    obj(name=text(30), year={"type": "integer", "minimum": 1900, "maximum": 2100}),
    obj(count={"type": "integer", "minimum": 0, "maximum": 1000}),
    obj(value={"type": "number", "minimum": 0, "maximum": 100}),
    obj(answered={"type": "boolean"}),
    obj(items={"type": "array", "items": text(20), "minItems": 1, "maxItems": 3}),
    obj(person=obj(first=text(20), last=text(20))),
    obj(answer=text(40), sources={"type": "array", "maxItems": 2,
                                  "items": obj(doc=text(30), score={"type": "number", "minimum": 0, "maximum": 1})}),
    {"type": "string", "enum": ["yes", "no", "unknown"]},
    obj(kind={"enum": ["person", "place", "thing", "number"]}, text=text(30)),
    obj(days={"type": "integer", "minimum": 0, "maximum": 365}, unit={"const": "days"}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 1, "maxItems": 3},
    obj(answer={"anyOf": [text(30), {"type": "integer", "minimum": 0, "maximum": 9999}]}),
    obj(city=text(20), country=text(20), population={"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}),
    obj(steps={"type": "array", "maxItems": 2, "items": obj(n={"type": "integer", "minimum": 1, "maximum": 9}, text=text(30))}),
    obj(code={"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"}),
    obj(answer=text(40), quote=text(60), confidence={"type": "number", "minimum": 0, "maximum": 1}),
    obj(meta=obj(question=text(60), answered={"type": "boolean"}), answer=text(30)),
    obj(ratings=obj(relevance={"type": "integer", "minimum": 1, "maximum": 5},
                    certainty={"type": "integer", "minimum": 1, "maximum": 5})),
]
QUESTIONS = sample_questions(10)
CASES = [(QUESTIONS[i % len(QUESTIONS)], {**schema, "title": f"S{i}"}) for i, schema in enumerate(SCHEMAS)]
MAX_TOKENS = 96
SOURCES = {"rag": {"rag"}, "tokrag": {"rag", "pure", "agree"}}


def test_there_are_twenty_distinct_schemas():
    assert len({repr(s) for s in SCHEMAS}) == 20


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_twenty_schemas_parse_and_validate_batched_and_alone(lm, policy):
    specs = [response_format_of(schema) for _, schema in CASES]
    batch = generate_batch(lm, [q for (q, _), _ in CASES], [p for (_, p), _ in CASES], policy=policy,
                           max_new_tokens=MAX_TOKENS, constraint=specs)
    for ((question, passages), schema), spec, got in zip(CASES, specs, batch, strict=True):
        assert got.stop_reason == "stop", (schema["title"], got.text)
        jsonschema.validate(parse_structured(got.text, schema), schema)
        assert len(got.trace.steps) == len(got.token_ids)
        assert {s.source for s in got.trace.steps} <= SOURCES[policy]
        alone = generate(lm, question, passages, policy=policy, max_new_tokens=MAX_TOKENS, constraint=spec)
        assert alone.token_ids == got.token_ids, schema["title"]
        assert [s.source for s in alone.trace.steps] == [s.source for s in got.trace.steps]
