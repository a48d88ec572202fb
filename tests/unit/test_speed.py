"""``speed=`` and the one policy-options style (issue 34): no model is loaded."""

from __future__ import annotations

import warnings

import pytest

from tokrag_integrations.engine.speed import PRESETS, Speed, speed_of
from tokrag_integrations.policies import get_policy, merge_policy_options
from tokrag_integrations.runner import resolve_speed


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


def test_old_speed_options_of_a_policy_warn_and_still_apply():
    with pytest.warns(DeprecationWarning, match="speed choices, not policy options"):
        pol = get_policy("tokrag", speculative="true", block=3)
    assert pol.legacy_speed == {"speculative": True, "block": 3}
    assert "speculative" not in pol.options()
    assert resolve_speed(None, pol) == Speed(speculative=True, block=3)
    assert resolve_speed({"speculative": True, "block": 3}, pol) == Speed(speculative=True, block=3)
    with pytest.raises(ValueError, match="give the speed once"):
        resolve_speed("reference", pol)
    with pytest.warns(DeprecationWarning, match="policy.fuse is deprecated"):
        assert pol.fuse is True
    with pytest.warns(DeprecationWarning, match="setting policy.fuse is deprecated"):
        pol.fuse = False
    assert resolve_speed(None, pol).fuse is False


def test_a_policy_without_old_speed_options_takes_speed_as_given():
    pol = get_policy("rag")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pol.legacy_speed == {} and resolve_speed("reference", pol) == PRESETS["reference"]
    with pytest.raises(ValueError, match="unknown option 'fuse'"):
        get_policy("rag", fuse=False)  # never an option of a one-context rule


def test_policy_options_dict_and_the_old_keywords():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge_policy_options({"top_k": 2}, {}, "generate") == {"top_k": 2}
        assert merge_policy_options(None, None, "generate") == {}
    with pytest.warns(DeprecationWarning, match=r"policy_options=\{'top_k': 2\}"):
        assert merge_policy_options(None, {"top_k": 2}, "generate") == {"top_k": 2}
    with pytest.raises(ValueError, match="'top_k' given twice"), pytest.warns(DeprecationWarning):
        merge_policy_options({"top_k": 2}, {"top_k": 3}, "generate")
    with pytest.raises(TypeError, match="policy_options must be a dict"):
        merge_policy_options(["top_k"], None, "generate")  # type: ignore[arg-type]
