"""``speed=`` and the one policy-options style (issue 34): no model is loaded."""

from __future__ import annotations

import warnings

import pytest

from tokrag_integrations.engine.speed import PRESETS, Speed, speed_of
from tokrag_integrations.policies import checked_policy_options, get_policy


def test_presets_and_dicts_give_speeds():
    assert speed_of(None) == speed_of("auto") == Speed() == PRESETS["auto"]
    ref = speed_of("reference")
    assert (ref.fuse, ref.speculative, ref.share_lens) == (False, False, False)
    got = speed_of({"speculative": "true", "block": 4})
    assert got == Speed(speculative=True, block=4) and got.drafter == "auto"
    assert speed_of(got) is got
    assert Speed().options() == {"speculative": False, "fuse": True}
    assert got.options() == {"speculative": True, "block": 4, "drafter": "auto"}


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("fast", ValueError, "unknown speed preset 'fast'; presets: auto, reference"),
        ({"fsue": False}, ValueError, "unknown speed option 'fsue'"),
        ({"block": 0}, ValueError, "block must be a positive int or None, got 0"),
        ({"drafter": "both"}, ValueError, "drafter must be 'auto', 'pure' or 'rag'"),
        ({"fuse": "yes"}, ValueError, "fuse must be True or False"),
        (3, TypeError, "speed must be a Speed, a preset name or a dict, got int"),
    ],
)
def test_bad_speeds_are_refused_with_a_sentence(value, error, match):
    with pytest.raises(error, match=match):
        speed_of(value)


def test_a_speed_field_given_as_a_string_is_refused_by_the_dataclass():
    with pytest.raises(ValueError, match="speculative must be True or False, got 'False'"):
        Speed(speculative="False")  # type: ignore[arg-type]


def test_speed_choices_are_not_policy_options():
    for name in ("rag", "tokrag"):
        with pytest.raises(ValueError, match="unknown option 'fuse'"):
            get_policy(name, fuse=False)  # speed=, never an option of a rule


def test_policy_options_dict_and_loose_keywords():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checked_policy_options({"top_k": 2}, {}, "generate") == {"top_k": 2}
        assert checked_policy_options(None, None, "generate") == {}
    with pytest.raises(TypeError, match=r"policy_options=\{'top_k': 2\}"):
        checked_policy_options(None, {"top_k": 2}, "generate")
    with pytest.raises(TypeError, match="policy_options must be a dict"):
        checked_policy_options(["top_k"], None, "generate")  # type: ignore[arg-type]
