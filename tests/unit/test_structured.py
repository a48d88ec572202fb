"""Constraints, schemas and tool specs of ``tokrag_integrations.structured`` on the packaged
SmolLM2's tokenizer (no model weights): the mask steps through real token ids."""

from __future__ import annotations

from typing import TypedDict

import pytest
import torch

pytest.importorskip("llguidance")

from _structured import TokenizerOnly, ids_of, packaged_tokenizer, walk  # noqa: E402

from tokrag_integrations.structured import (  # noqa: E402
    constraint_for,
    json_schema_of,
    parse_structured,
    response_format_of,
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return packaged_tokenizer()


@pytest.fixture
def lm(smollm2_tokenizer):  # replaces the refused session model: a tokenizer, no weights
    return TokenizerOnly(smollm2_tokenizer)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    },
    "required": ["name", "age"],
}


def test_json_schema_constraint_steps_through_a_valid_document(lm):
    spec = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON, "strict": True}}
    c = constraint_for(spec, lm)
    eos = lm.eos_token_ids[0]
    assert not c.allowed(eos) and not c.is_finished()  # nothing yet: EOS cannot end it
    text = '{"name": "Ada", "age": 36, "tags": ["a", "b"]}'
    tokens = ids_of(lm, text)
    for i, token in enumerate(tokens):
        assert c.allowed(token)
        if i == 1:  # after '{"': a key the schema does not have is refused
            assert not c.allowed(ids_of(lm, "x")[0])
        c.accept(token)
        if i < len(tokens) - 1:
            assert not c.is_finished() and not c.allowed(eos)
    assert c.is_finished() and c.allowed(eos)  # the object is closed: only EOS may follow
    assert parse_structured(text, PERSON)["age"] == 36


def test_bitmask_layout_and_a_refused_token(lm):
    c = constraint_for({"type": "json_object"}, lm)
    mask = torch.zeros((3, (lm.vocab_size + 31) // 32), dtype=torch.int32)
    c.fill_bitmask(mask, 1)
    assert mask[0].eq(0).all() and mask[2].eq(0).all()  # other rows untouched
    allowed = [t for t in range(lm.vocab_size) if (int(mask[1, t // 32]) >> (t % 32)) & 1]
    texts = {lm.tokenizer.decode([t]) for t in allowed}
    assert texts and all(s.startswith("{") for s in texts)  # a JSON object starts with "{"
    bad = ids_of(lm, "hello")[0]
    assert bad not in allowed
    with pytest.raises(ValueError, match=r"not allowed here by the JSON object"):
        c.accept(bad)
    with pytest.raises(ValueError, match=r"words per row"):
        c.fork().fill_bitmask(torch.zeros((1, 10), dtype=torch.int32), 0)


def test_fork_starts_over_and_the_bridge_is_built_once(lm):
    c = constraint_for({"type": "regex", "regex": r"[0-9]{3}-[a-z]+"}, lm)
    walk(c, lm, "123-ab")
    assert c.is_accepting() and c.allowed(lm.eos_token_ids[0]) and not c.is_finished()
    fresh = c.fork()
    assert not fresh.is_accepting() and not fresh.allowed(ids_of(lm, "ab")[0])
    walk(fresh, lm, "9")
    constraint_for({"type": "json_object"}, lm)
    assert lm.builds == 1  # one tokenizer bridge per model, whatever the spec


def test_lark_and_gbnf_grammars_end_where_the_grammar_ends(lm):
    for grammar in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        c = constraint_for({"type": "grammar", "grammar": grammar}, lm)
        assert not c.allowed(ids_of(lm, "maybe")[0])
        walk(c, lm, "no")
        assert c.is_finished()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "regex", "regex": "(?<=a)b"}, r"regex .* cannot be compiled: .*look-around"),
        ({"type": "regex", "regex": "[a-"}, r"cannot be compiled: .*unclosed character class"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
         r"JSON schema 'x' is not valid at type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "odd"}}},
         r"JSON schema 'x' cannot be compiled: Unknown format: odd"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, r'has no "schema"'),
        ({"type": "grammar", "grammar": "start: foo"}, r'grammar cannot be compiled: unknown name: "foo"'),
        ({"type": "xml"}, r"unknown constraint type 'xml'; use one of"),
        ({"type": "text"}, r"pass constraint=None"),
    ],
)
def test_bad_specs_fail_at_constraint_for_with_one_sentence(lm, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        constraint_for(spec, lm)
    assert "\n" not in str(info.value)


def test_closed_objects_refuse_unnamed_keys_but_an_open_schema_takes_them(lm):
    closed = constraint_for(response_format_of({"type": "object", "properties": {"a": {"type": "integer"}}}), lm)
    walk(closed, lm, '{"')
    assert not closed.allowed(ids_of(lm, "b")[0])
    opened = constraint_for(
        response_format_of({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}),
        lm,
    )
    walk(opened, lm, '{"b": 1}')
    assert opened.is_finished()


def test_json_schema_of_each_kind_and_parse_structured():
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    class Point(TypedDict):
        x: float
        y: float

    schema, name = json_schema_of(City)
    assert name == "City" and schema["required"] == ["name", "population"]
    schema, name = json_schema_of(Point)
    assert name == "Point" and set(schema["properties"]) == {"x", "y"}
    assert json_schema_of({"title": "T", "type": "object"}) == ({"title": "T", "type": "object"}, "T")
    assert json_schema_of({"name": "W", "schema": {"type": "object"}})[1] == "W"
    assert response_format_of(City)["json_schema"]["name"] == "City"

    assert parse_structured('{"name": "Oslo", "population": 700000}', City) == City(name="Oslo", population=700000)
    assert parse_structured('{"x": 1, "y": 2.5}', Point) == {"x": 1, "y": 2.5}
    with pytest.raises(ValueError, match=r"does not validate against City: population"):
        parse_structured('{"name": "Oslo"}', City)
    with pytest.raises(ValueError, match=r"does not validate against 'T' at a: 'x' is not of type 'integer'"):
        parse_structured('{"a": "x"}', {"title": "T", "type": "object", "properties": {"a": {"type": "integer"}}})
    with pytest.raises(ValueError, match=r"the output is not JSON"):
        parse_structured('{"a": ', None)
    with pytest.raises(TypeError, match="pydantic model class, a TypedDict class or a JSON-schema dict"):
        json_schema_of(42)
