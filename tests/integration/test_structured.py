"""Structured output and tool calls on the packaged model (the ``lm`` fixture), through the
engine's ``constraint=``: every answer parses and validates against its schema, under ``rag``,
``tokrag`` and ``no_rag``, alone and batched; a tool call under ``tool_choice="required"`` is a
well-formed call to one of the tools; bad specs are refused before decoding."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from _structured import sample_questions  # noqa: E402

from tokrag_integrations import generate, generate_batch  # noqa: E402
from tokrag_integrations.structured import (  # noqa: E402
    find_tool_calls,
    parse_structured,
    render_tools,
    response_format_of,
    tool_call_constraint,
    tool_result_message,
    tool_spec,
)

ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 60},
        "confidence": {"type": "string", "enum": ["high", "medium", "low"]},
        "sources": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 2},
    },
    "required": ["answer", "confidence"],
}
SPEC = response_format_of({**ANSWER, "title": "Answer"})
MAX_TOKENS = 64


QUESTIONS = sample_questions(3)


def check_answer(result, schema=ANSWER) -> dict:
    """The result's text parsed and validated; the decode stopped because the JSON closed."""
    assert result.stop_reason == "stop", (result.stop_reason, result.text)
    value = parse_structured(result.text, schema)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("policy", ["rag", "tokrag", "no_rag"])
def test_json_schema_answers_parse_and_validate(lm, policy):
    for question, passages in QUESTIONS:
        result = generate(lm, question, passages, policy=policy, max_new_tokens=MAX_TOKENS, constraint=SPEC)
        check_answer(result)
        steps = result.trace.steps
        assert len(steps) == len(result.token_ids) and all(s.source for s in steps)  # provenance kept


def test_the_founders_answer_is_read_from_the_passage(lm):
    question, passages = QUESTIONS[0]
    value = check_answer(generate(lm, question, passages, policy="tokrag", max_new_tokens=MAX_TOKENS, constraint=SPEC))
    assert "Varga" in value["answer"]  # the constraint shapes the answer; the passage fills it


def test_batched_constrained_answers_equal_the_answers_alone(lm):
    questions = [q for q, _ in QUESTIONS]
    passages = [p for _, p in QUESTIONS]
    batch = generate_batch(lm, questions, passages, policy="tokrag", max_new_tokens=MAX_TOKENS, constraint=SPEC)
    for (question, p), result in zip(QUESTIONS, batch, strict=True):
        check_answer(result)
        alone = generate(lm, question, p, policy="tokrag", max_new_tokens=MAX_TOKENS, constraint=SPEC)
        assert result.token_ids == alone.token_ids
        assert [s.source for s in result.trace.steps] == [s.source for s in alone.trace.steps]


def test_a_pydantic_schema_with_nested_objects_numbers_and_enums(lm):
    from pydantic import BaseModel, Field

    class Office(BaseModel):
        city: str = Field(max_length=30)
        staff: int = Field(ge=0, le=100000)

    class Company(BaseModel):
        name: str = Field(max_length=40)
        kind: str = Field(json_schema_extra={"enum": ["aerospace", "software", "retail"]})
        offices: list[Office] = Field(max_length=2)
        rating: float = Field(ge=0, le=5)

    question, passages = QUESTIONS[0]
    result = generate(
        lm, "Describe the company as JSON.", passages, policy="tokrag", max_new_tokens=120,
        constraint=response_format_of(Company), seed=3, temperature=0.7,
    )
    assert result.stop_reason == "stop", result.text
    company = parse_structured(result.text, Company)
    assert isinstance(company, Company) and company.kind in ("aerospace", "software", "retail")
    assert result.trace.sampling["temperature"] == 0.7


def test_json_object_regex_and_grammar_constraints(lm):
    question, passages = QUESTIONS[1]
    obj = generate(lm, question, passages, policy="rag", max_new_tokens=MAX_TOKENS, constraint={"type": "json_object"})
    assert obj.stop_reason in ("stop", "length")
    if obj.stop_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    yes_no = generate(lm, "Is Quillfeather an aerospace company?", passages, policy="tokrag", max_new_tokens=8,
                      constraint={"type": "grammar", "grammar": 'start: "yes" | "no"'})
    assert yes_no.text in ("yes", "no") and yes_no.stop_reason == "stop"
    code = generate(lm, question, passages, policy="no_rag", max_new_tokens=12,
                    constraint={"type": "regex", "regex": r"[A-Z][a-z]{2,12}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,12}", code.text), code.text


def test_bad_specs_are_refused_before_decoding(lm):
    question, passages = QUESTIONS[0]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}
    with pytest.raises(ValueError, match=r"the JSON schema 'x' is not valid at properties/a/type"):
        generate(lm, question, passages, constraint=bad)
    with pytest.raises(ValueError, match=r"look-around"):
        generate(lm, question, passages, constraint={"type": "regex", "regex": "(?=a)b"})


def search_documents(query: str) -> str:
    """Search the company's documents.

    Args:
        query: what to look for
    """
    return query


def office_count(country: str) -> int:
    """How many offices the company has in a country.

    Args:
        country: the country's name
    """
    return 1


TOOLS = [search_documents, office_count]


def tool_prompt(lm, messages):
    """``generate``'s arguments for a conversation with the tools: the system turn, the
    earlier turns and the final user turn's text as the query (a chat, not a Q&A prompt)."""
    turns = render_tools(lm.tokenizer, messages, TOOLS)
    assert turns[0]["role"] == "system" and turns[-1]["role"] == "user"
    return turns[-1]["content"], {"system_prompt": turns[0]["content"], "messages": turns[1:-1], "prompt_format": "chat"}


@pytest.mark.parametrize("policy", ["no_rag", "tokrag"])
def test_required_tool_choice_gives_one_parseable_call(lm, policy):
    specs = {s["function"]["name"]: s["function"]["parameters"] for s in map(tool_spec, TOOLS)}
    for question, passages in QUESTIONS[:2]:
        query, kw = tool_prompt(lm, [{"role": "user", "content": question}])
        c = tool_call_constraint(TOOLS, "required", lm)
        result = generate(lm, query, passages if policy != "no_rag" else None, policy=policy,
                          max_new_tokens=96, constraint=c, **kw)
        assert result.stop_reason == "stop", result.text
        content, calls, invalid = find_tool_calls(result.text)
        assert content == "" and invalid == [] and len(calls) == 1, result.text
        assert calls[0]["name"] in specs
        jsonschema.validate(calls[0]["arguments"], specs[calls[0]["name"]])


def test_named_tool_choice_and_a_result_fed_back(lm):
    question = "How many offices does Quillfeather have in Norway?"
    query, kw = tool_prompt(lm, [{"role": "user", "content": question}])
    first = generate(lm, query, None, policy="no_rag", max_new_tokens=64,
                     constraint=tool_call_constraint(TOOLS, "office_count", lm), **kw)
    _, calls = find_tool_calls(first.text)[:2]
    assert [c["name"] for c in calls] == ["office_count"]
    assert isinstance(calls[0]["arguments"]["country"], str)
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0]["id"], "type": "function",
         "function": {"name": "office_count", "arguments": json.dumps(calls[0]["arguments"])}}]},
        tool_result_message(calls[0]["id"], 2, name="office_count"),
    ]
    query, kw = tool_prompt(lm, history)
    assert query == "<tool_response>\n2\n</tool_response>"
    answer = generate(lm, query, None, policy="no_rag", max_new_tokens=24,
                      constraint=tool_call_constraint(TOOLS, "auto", lm), **kw)
    content, calls, invalid = find_tool_calls(answer.text)
    assert invalid == [] and (content or calls)  # text, or a well-formed further call


def test_auto_tool_choice_answers_in_free_text_or_a_well_formed_call(lm):
    for question, passages in QUESTIONS:
        query, kw = tool_prompt(lm, [{"role": "user", "content": question}])
        result = generate(lm, query, passages, policy="tokrag", max_new_tokens=48,
                          constraint=tool_call_constraint(TOOLS, "auto", lm), **kw)
        content, calls, invalid = find_tool_calls(result.text)
        assert invalid == [], result.text
        assert calls or "<tool_call>" not in content
