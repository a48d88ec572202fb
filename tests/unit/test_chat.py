"""The core's one chat-turn splitter, one context splitter, one passage list of an adapter, one
ordering by contribution and one boolean reading (issue 55), on hand-made inputs."""

from __future__ import annotations

import pytest

from tokrag_integrations.adapters.chat import (
    TEMPLATE_CONTEXT,
    adapter_passages,
    split_context,
    split_turns,
)
from tokrag_integrations.config import bool_word, env_switch, option_bool
from tokrag_integrations.prompts import Passage
from tokrag_integrations.trace import by_contribution


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def test_trailing_user_turns_are_the_question_and_system_turns_the_system_prompt():
    got = split_turns([
        _turn("system", "Be brief."),
        _turn("user", "hello"),
        _turn("assistant", "hi"),
        _turn("developer", "Cite."),
        _turn("user", "part one"),
        _turn("user", "  "),
        _turn("user", "part two"),
    ])
    assert got.query == "part one\n\npart two"
    assert got.history == [_turn("user", "hello"), _turn("assistant", "hi")]
    assert got.system_prompt == "Be brief.\n\nCite."
    assert split_turns([_turn("user", "q")]).system_prompt is None


@pytest.mark.parametrize(
    ("turns", "match"),
    [
        ([], "got no messages"),
        ([_turn("user", "q"), _turn("assistant", "a")], "not 'assistant'"),
        ([_turn("system", "s")], "not 'system'"),
    ],
)
def test_a_conversation_that_does_not_end_with_a_user_turn_is_one_sentence(turns, match):
    with pytest.raises(ValueError, match=match) as info:
        split_turns(turns, "ChatTokRAG", "end the list with a HumanMessage")
    assert "\n" not in str(info.value) and "ChatTokRAG" in str(info.value)


def test_a_context_is_cut_around_its_passages_and_loses_nothing():
    a, b = Passage("Alpha is first.", 0.9, {"id": "a"}), Passage("Beta is second.", None, {"id": "b"})
    context = f"{a.text}\n\n{b.text}\n"
    with _no_warning():
        parts = split_context(context, [b, a])  # found wherever they are
    assert [p.text for p in parts] == [f"{a.text}\n\n", f"{b.text}\n"]  # whitespace kept
    assert [(p.score, p.metadata) for p in parts] == [(0.9, {"id": "a"}), (None, {"id": "b"})]


def test_text_outside_every_passage_is_a_passage_of_its_own_with_a_warning():
    a = Passage("Alpha is first.", metadata={"id": "a"})
    context = f"Notes: {a.text} The end."
    with pytest.warns(UserWarning, match="part of the context is no passage's text"):
        parts = split_context(context, [a])
    assert "".join(p.text for p in parts) == context
    assert [p.metadata for p in parts] == [TEMPLATE_CONTEXT, {"id": "a"}, TEMPLATE_CONTEXT]
    with pytest.warns(UserWarning, match=r"passage\(s\) \[0\] are not in the context \(not found: a\)"):
        assert split_context("Nothing here.", [a]) is None


def test_a_passage_is_found_by_the_longest_of_its_texts():
    a = Passage("body", metadata={"id": "a"})
    context = "title: T\n\nbody"
    with _no_warning():
        parts = split_context(context, [a], [["body", "title: T\n\nbody"]])
    assert [p.text for p in parts] == [context]


def test_an_adapter_passage_list():
    def convert(item):
        return Passage(item["t"]) if isinstance(item, dict) else item

    assert adapter_passages(None, convert, "dicts") is None
    assert adapter_passages([{"t": "x"}, "y"], convert, "dicts") == [Passage("x"), "y"]
    for single in ("text", {"t": "x"}):
        with pytest.raises(TypeError, match=r"must be a list \(of dicts, strings"):
            adapter_passages(single, convert, "dicts")


def test_by_contribution_then_as_given_then_not_decoded():
    items = ["a", "b", "c", "d"]
    assert by_contribution(items, ["c", "a"]) == ["c", "a", "b", "d"]
    assert by_contribution(items, ["c"], decoded={"a", "c", "d"}) == ["c", "a", "d", "b"]
    assert by_contribution(items, [], decoded={"a"}) == items  # no citations: as given


def test_one_reading_of_booleans_given_as_data(monkeypatch):
    for value, want in [(True, True), (0, False), ("TRUE", True), (" 0 ", False), ("false", False)]:
        assert bool_word(value) is want and option_bool("fuse", value) is want
    for bad in ("yes", "on", 2, 0.0, None, "False!"):
        assert bool_word(bad) is None
        with pytest.raises(ValueError, match=f"fuse must be True or False \\(or 1/0\\), got {bad!r}"):
            option_bool("fuse", bad)
    assert bool_word("yes", switch=True) is True and bool_word("OFF", switch=True) is False
    monkeypatch.setenv("TOKRAG_VERBOSE", "on")
    assert env_switch("TOKRAG_VERBOSE", False) is True


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)
